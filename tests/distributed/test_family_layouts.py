"""Per family, every supported distributed layout writes the same cache as one process; refusals come first.

Each case runs the real CLI (``ds-capture run -c recipe.yaml``) on real gloo ranks forked from this process with
a launcher's environment (the launchers themselves are tests/distributed/test_launch_forms.py's),
on a tiny random-init target (``ds_capture.demo.TINY_CONFIGS``, sharded safetensors; DeepSeek-V4's hash routes
randomised), 8 demo rows, S=32, ids ``[-1, 0, 1, 2, 3]``, fp32, and compares it with the single-process cache:
``input_ids`` / ``loss_mask`` exactly, hidden states within ``1e-5 * max(1, max|a|)``.

Every outcome (equal with its max diff, or the refusal text) is recorded in
``benchmarks/results/support_matrix.json``, which ``tools/support_matrix.py`` turns into the table in docs/support.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launchers import REPO_ROOT  # noqa: E402
from support import max_rel_diff, record  # noqa: E402

from tests.distributed import _kill_helpers as kh  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "tests" / "unit"))
from test_families import family_target_builder  # noqa: E402

from ds_capture.target.families import FAMILIES  # noqa: E402

LAYER_IDS = [-1, 0, 1, 2, 3]

# (model_type, layout name, nproc, tp_size, ep_size): the supported layouts checked for equality.
# Layout names: dp (2 DP ranks), tp (TP=2), ep (EP=2, 2 DP ranks), tp_x_ep (TP=2 x EP=2 on 4 ranks),
# fsdp2 (engine fsdp2 on 2 ranks; qwen3, qwen3_moe and deepseek_v3 are recorded by test_fsdp2_equivalence.py).
EQUAL_CASES = [
    ("deepseek_v4", "ep", 2, 1, 2),
    ("glm_moe_dsa", "ep", 2, 1, 2),
    ("kimi_k25", "ep", 2, 1, 2),
    ("kimi_k25", "tp", 2, 2, 1),
    ("kimi_k25", "tp_x_ep", 4, 2, 2),
    ("mixtral", "ep", 2, 1, 2),
    ("mixtral", "tp", 2, 2, 1),
    ("mixtral", "tp_x_ep", 4, 2, 2),
    ("qwen3", "dp", 2, 1, 1),
    ("qwen3", "tp", 2, 2, 1),
    ("mixtral", "fsdp2", 2, 1, 1),
    ("deepseek_v4", "fsdp2", 2, 1, 1),
    ("glm_moe_dsa", "fsdp2", 2, 1, 1),
    ("gemma4", "fsdp2", 2, 1, 1),
    ("kimi_k25", "fsdp2", 2, 1, 1),
]
# The families added for today's drafters (their single-process equality runs in CI: tests/unit/test_families.py)
# and our own TP plans: only TP=2 for glm_moe_dsa through our own plan (ds_capture.parallel.tensor_parallel) stays in
# CI; every other cell is slow (measured once with DS_CAPTURE_FULL=1: the support table).
_NEW_FAMILY_CASES = [
    ("glm_moe_dsa", "tp", 2, 2, 1),
    ("deepseek_v4", "tp", 2, 2, 1),  # our own plan: head-parallel queries, sinks and grouped o_a_proj
    ("gpt_oss", "tp", 2, 2, 1),  # our own plan: head-parallel GQA with its per-head sinks
]
_NEW_FAMILY_SLOW_CASES = [
    # Plain DP of the families that also run EP or FSDP2 in CI: those cells already put 2 ranks on different data
    # through the same DP split and writer, and DP leaves the model whole (qwen3-dp, a dense family, stays in CI).
    ("deepseek_v4", "dp", 2, 1, 1),
    ("gemma4", "dp", 2, 1, 1),
    ("glm_moe_dsa", "dp", 2, 1, 1),
    ("kimi_k25", "dp", 2, 1, 1),
    ("mixtral", "dp", 2, 1, 1),
    ("glm5_next", "ep", 2, 1, 2),
    ("glm4_moe", "dp", 2, 1, 1),
    ("glm4_moe", "tp", 2, 2, 1),
    ("glm4_moe", "ep", 2, 1, 2),
    ("glm4_moe", "tp_x_ep", 4, 2, 2),
    ("glm4_moe", "fsdp2", 2, 1, 1),
    *[(m, layout, 2, 1, ep) for m in ("qwen3_5_moe", "qwen3_next", "deepseek_v32", "minimax_m2", "kimi_linear")
      for layout, ep in (("dp", 1), ("ep", 2), ("fsdp2", 1))],
    ("gpt_oss", "ep", 2, 1, 2),
    ("gpt_oss", "tp_x_ep", 4, 2, 2),
    ("gpt_oss", "dp", 2, 1, 1),
    ("gpt_oss", "fsdp2", 2, 1, 1),
    ("glm5_next", "dp", 2, 1, 1),
    ("glm5_next", "fsdp2", 2, 1, 1),
    ("llama4", "dp", 2, 1, 1),
    ("llama4", "fsdp2", 2, 1, 1),
    ("glm_moe_dsa", "tp_x_ep", 4, 2, 2),
    ("deepseek_v32", "tp", 2, 2, 1),
    ("deepseek_v32", "tp_x_ep", 4, 2, 2),
    ("deepseek_v4", "tp_x_ep", 4, 2, 2),
    ("gemma4", "tp", 2, 2, 1),  # our own plan: head-parallel GQA, the per-layer input gate replicated
]
EQUAL_CASES = [*EQUAL_CASES, *_NEW_FAMILY_CASES,
               *[pytest.param(*case, marks=pytest.mark.slow) for case in _NEW_FAMILY_SLOW_CASES]]
# Refused before any weight loads: (model_type, layout, nproc, tp_size, ep_size, exact message).
REFUSED_CASES = [
    ("llama4", "ep", 2, 1, 2, f"ep_size 2: {FAMILIES['llama4'].ep_refusal}"),
    *[pytest.param(m, "tp", 2, 2, 1, f"tp_size 2: {FAMILIES[m].tp_refusal}", marks=pytest.mark.slow)
      for m in ("qwen3_5_moe", "qwen3_next", "minimax_m2", "kimi_linear", "glm5_next", "llama4")],
]


def _case_id(case) -> str:
    values = case.values if hasattr(case, "values") else case  # a pytest.param (slow) or a plain tuple
    return f"{values[0]}-{values[1]}"


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return family_target_builder(tmp_path_factory.mktemp("layout_targets"))


def _recipe(target: Path, out: Path, tp_size: int, ep_size: int, engine: str = "deepspeed") -> Path:
    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text(yaml.safe_dump({
        "engine": engine,
        "distributed": {"tp_size": tp_size, "ep_size": ep_size},
        "capture": {"cpu_threads": 1},  # one thread per rank in every layout: the count is part of the bits
        "recipe_args": dict(target_model_name_or_path=str(target), train_data_path="demo:conversations",
                            train_split="train[:8]", cache_output_dir=str(out), seq_length=32, micro_batch_size=2,
                            cache_shard_size=2, cache_dtype="fp32", target_layer_ids=LAYER_IDS)}))
    return recipe


def _run(nproc: int, recipe: Path):
    return kh.run_cli_forked(nproc, recipe)


@pytest.fixture(scope="module")
def single_caches(targets, tmp_path_factory):
    root = tmp_path_factory.mktemp("single_caches")
    made: dict[str, Path] = {}

    def make(model_type: str) -> Path:
        if model_type not in made:
            out = root / model_type
            result = _run(1, _recipe(targets(model_type), out, 1, 1))
            assert result.returncode == 0, result.stdout[-4000:]
            made[model_type] = out
        return made[model_type]

    return make


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("model_type, layout, nproc, tp_size, ep_size", EQUAL_CASES,
                         ids=[_case_id(c) for c in EQUAL_CASES])
def test_layout_equals_single_process(targets, single_caches, tmp_path, model_type, layout, nproc, tp_size, ep_size):
    reference = single_caches(model_type)
    record(model_type, "single", {"status": "equal", "max_rel_diff": 0.0, "note": "reference"})
    out = tmp_path / "cache"
    engine = "fsdp2" if layout == "fsdp2" else "deepspeed"
    result = _run(nproc, _recipe(targets(model_type), out, tp_size, ep_size, engine))
    assert result.returncode == 0, result.stdout[-6000:]
    assert not result.leftover_shm, result.leftover_shm
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["producer"]["engine"] == engine
    assert (manifest["tp_size"] if "tp_size" in manifest else manifest["producer"]["tp_size"]) == tp_size
    diff = max_rel_diff(reference, out)
    record(model_type, layout, {"status": "equal" if diff <= 1e-5 else "differs", "max_rel_diff": diff,
                                 "nproc": nproc, "tp_size": tp_size, "ep_size": ep_size})
    assert diff <= 1e-5, (model_type, layout, diff)


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("model_type, layout, nproc, tp_size, ep_size, message", REFUSED_CASES,
                         ids=[_case_id(c) for c in REFUSED_CASES])
def test_unsupported_layout_is_refused_before_loading(targets, tmp_path, model_type, layout, nproc, tp_size,
                                                      ep_size, message):
    out = tmp_path / "cache"
    result = _run(nproc, _recipe(targets(model_type), out, tp_size, ep_size))
    # Each rank exits 2 (a user error; torchrun would report it as its own exit code 1).
    assert result.returncode == 2, result.stdout[-4000:]
    assert f"ds-capture run: error: {message}" in result.stdout and "Traceback (most recent call last):\n  File" \
        not in result.stdout, result.stdout[-4000:]
    assert "Loading weights" not in result.stdout and not out.exists()
    record(model_type, layout, {"status": "refused", "reason": message})


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_tied_embeddings_under_tensor_parallelism(tmp_path):
    """A tied target (small Qwen3s): AutoTP shards the lm_head, which the loader fills from the embedding."""
    from ds_capture.demo import build_tiny_target

    target = build_tiny_target(tmp_path / "tied_qwen3", "qwen3", tie_word_embeddings=True)
    assert json.loads((target / "config.json").read_text())["tie_word_embeddings"] is True
    single, tp2 = tmp_path / "single", tmp_path / "tp2"
    for out, nproc, tp_size in ((single, 1, 1), (tp2, 2, 2)):
        result = _run(nproc, _recipe(target, out, tp_size, 1))
        assert result.returncode == 0, result.stdout[-6000:]
    assert max_rel_diff(single, tp2) <= 1e-5
    weights = [load_file(out / "target_weights.safetensors") for out in (single, tp2)]
    assert all(torch.equal(w["lm_head.weight"], w["embed_tokens.weight"]) for w in weights)
    assert torch.equal(weights[0]["lm_head.weight"], weights[1]["lm_head.weight"])
