"""The EAGLE-3 cache against NeMo AutoModel 0.7.0's own producer (recorded fixtures, no NeMo needed), and
NeMo's own reader and training checks on our cache (where nemo_automodel is installed: the nemo extra).

``tests/fixtures/eagle3/`` holds caches written by NeMo's ``precompute_eagle3`` on CPU (its loader swapped
for transformers', as NeMo's own CPU test does; regenerate with tools/nemo_oracle/make_eagle3_fixtures.py).
Each case runs our producer, single process, with NeMo's recorded argv mapped one to one
(``recipe_from_nemo_argv``) and compares with ``assert_matches_nemo``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds_capture.recipe.config import parse_config
from ds_capture.runner import run_capture
from tests.eagle3_support import FIXTURES, assert_matches_nemo, build_fixture_target, nemo_case_recipe, read_spec

SPEC = read_spec()
CASES = sorted(SPEC["cases"])
# NeMo's side of the checks runs in a process of its own (its import is slow, and its recipe modules rewrite
# transformers' auto mappings process-wide): this interpreter when the nemo extra is installed here (dev.py's
# test venv), else the one DS_CAPTURE_NEMO_PYTHON names.
NEMO_PYTHON = Path(os.environ.get("DS_CAPTURE_NEMO_PYTHON") or
                   (sys.executable if importlib.util.find_spec("nemo_automodel") else "/nonexistent"))
NO_NEMO = ("nemo_automodel (the nemo extra) is not installed here and DS_CAPTURE_NEMO_PYTHON names no "
           "interpreter that has it")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    """The fixture targets, rebuilt; their bytes must be the ones NeMo's caches were made from."""
    root = tmp_path_factory.mktemp("eagle3_targets")
    recorded = json.loads((FIXTURES / "targets.json").read_text())
    built = {}
    for name in SPEC["targets"]:
        path = build_fixture_target(SPEC, name, root / name)
        found = {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
                 for p in sorted(path.rglob("*")) if p.is_file()}
        assert found == recorded[name], f"target {name} no longer rebuilds byte-identically: regenerate the fixtures"
        built[name] = path
    return built


def _run_case(case: str, target: Path, out: Path):
    return run_capture(parse_config(nemo_case_recipe(case, target, out), source=f"{case}.yaml", base_dir=Path(".")),
                       show_progress=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_single_process_equals_nemo(case, targets, tmp_path):
    target = targets[SPEC["cases"][case]["target"]]
    assert _run_case(case, target, tmp_path / "cache").shards_written == 3
    assert_matches_nemo(tmp_path / "cache", case, target)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not NEMO_PYTHON.is_file(), reason=NO_NEMO)
def test_nemo_reader_and_trainer_accept_our_cache(targets, tmp_path):
    """NeMo's read_manifest, trainer manifest check, CachedEagle3Dataset (every sample) and one
    Eagle3TrainerModule forward/backward, on our full and our top-k cache (one NeMo process: its import is slow)."""
    cases = ["qwen3_full", "qwen3_topk_masked"]
    argv = []
    for case in cases:
        target = targets[SPEC["cases"][case]["target"]]
        _run_case(case, target, tmp_path / case)
        argv += [str(tmp_path / case), str(target)]
    result = subprocess.run([str(NEMO_PYTHON), str(REPO / "tools" / "nemo_oracle" / "check_eagle3_cache.py"), *argv],
                            capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr[-4000:]
    verdicts = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(verdicts) == len(cases)
    for case, verdict in zip(cases, verdicts):
        manifest = json.loads((FIXTURES / case / "manifest.json").read_text())
        assert verdict["num_samples"] == 10 and verdict["embeddings_shape"] == [manifest["target_vocab_size"], 64]
        assert verdict["target_probs_shape"] == [48, manifest["draft_vocab_size"]]
        assert verdict["loss_finite"] and verdict["grads_finite"] and verdict["supervised_positions"] > 0


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not NEMO_PYTHON.is_file(), reason=NO_NEMO)
def test_nemo_resume_accepts_our_directory(targets, tmp_path):
    """NeMo's own --resume, same settings: dict-equal manifest, nothing rewritten but identical bytes;
    another draft vocabulary: refused, naming the fields."""
    case = "qwen3_full"
    target, out = targets[SPEC["cases"][case]["target"]], tmp_path / "cache"
    _run_case(case, target, out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    argv = json.loads((FIXTURES / f"{case}.nemo_args.json").read_text())["argv"]
    argv = [str(target) if a == "qwen3" else str(FIXTURES / "data.jsonl") if a == "data.jsonl" else
            str(out) if a == case else a for a in argv]
    script = REPO / "tools" / "nemo_oracle" / "run_precompute_eagle3.py"

    def nemo(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(NEMO_PYTHON), str(script), *argv, "--resume", *extra], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})

    result = nemo()
    assert result.returncode == 0, result.stderr[-4000:]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    refused = nemo("--draft-vocab-size", "100")
    assert refused.returncode != 0 and "mismatched fields: ['draft_vocab_size', 'selected_token_ids']" in refused.stderr
