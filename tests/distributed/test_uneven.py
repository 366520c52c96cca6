"""Uneven splits finish without hanging and write every shard exactly once, equal to the single process.

Cases (tiny Qwen3-MoE, fp32, shards of 2 rows, one micro-batch of 2):
  five_over_dp2   10 samples = 5 shards over 2 DP ranks (3 + 2: rank 1 runs one padding forward)
  ragged_dp2       9 samples = 5 shards, the last with one row, over 2 DP ranks
  one_over_dp2     2 samples = 1 shard over 2 DP ranks (DP rank 1 has no data: padding forwards only)
  three_over_dp4   6 samples = 3 shards over world 4 = DP 4 (DP rank 3 has no data), through the CLI
Each run must: exit 0 within its timeout (a rank that skipped a collective would hang), pass
``verify_cache``, hold exactly shards ``0..n-1``, report ``n`` shards written in total (no shard twice),
and be byte-identical, shard by shard and in the target weights, to the single-process cache (DP ranks
forward exactly the single process's micro-batches, so fp32 bytes agree).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launchers import ensure_shm_op_built, run_launcher  # noqa: E402
from support import safetensors_digests  # noqa: E402

from tests.distributed import _kill_helpers as kh  # noqa: E402

from ds_capture.cache.registry import verify_cache

pytestmark = [pytest.mark.distributed]
LAYOUT_WORKER = str(Path(__file__).resolve().parent / "test_layouts.py")
CASES = {  # name -> (num_samples, world)
    "five_over_dp2": (10, 2),
    "ragged_dp2": (9, 2),
    "one_over_dp2": (2, 2),
    "three_over_dp4": (6, 4),
}


def _recipe(path: Path, target: Path, out: Path, num_samples: int) -> Path:
    path.write_text(yaml.safe_dump({
        "recipe_args": {"target_model_name_or_path": str(target), "train_data_path": "demo:conversations",
                        "train_split": f"train[:{num_samples}]", "cache_output_dir": str(out), "seq_length": 32,
                        "micro_batch_size": 2, "cache_shard_size": 2, "cache_dtype": "fp32"},
        "capture": {"cpu_threads": 1},  # one thread per rank whatever the world: the count is part of the bits
        "dist_env": {"timeout_minutes": 2},
    }))
    return path


@pytest.fixture(scope="module")
def uneven_runs(tiny_target, tmp_path_factory) -> dict:
    """Single-process references in this process; the world-2 cases in one launch, world 4 through the CLI."""
    from ds_capture.recipe.config import load_config
    from ds_capture.runner import run_capture

    ensure_shm_op_built()
    root = tmp_path_factory.mktemp("uneven")
    target = tiny_target("qwen3_moe", num_hidden_layers=2)
    results: dict[str, dict] = {}
    specs = []
    for name, (num_samples, world) in CASES.items():
        ref = root / name / "single"
        run_capture(load_config(str(_recipe(root / f"{name}-single.yaml", target, ref, num_samples)), []),
                    show_progress=False)
        cfg = _recipe(root / f"{name}.yaml", target, root / name / "cache", num_samples)
        results[name] = {"single": ref, "cache": root / name / "cache", "config": cfg, "world": world}
        if world == 2:
            specs.append({"name": name, "config": str(cfg)})
    (root / "specs.json").write_text(json.dumps(specs))
    result = run_launcher("torchrun", 2, [LAYOUT_WORKER, "worker", str(root / "specs.json"), str(root)], None, 300,
                          num_ports=len(specs))  # the layouts worker gives each run its own store port
    assert result.returncode == 0, result.stdout[-6000:]
    for spec in specs:
        summary = json.loads((root / spec["name"] / "summary.rank0.json").read_text())
        results[spec["name"]]["shards_written"] = summary["shards_written"]
    four = results["three_over_dp4"]
    result = kh.run_cli_forked(4, four["config"], timeout_s=300)
    assert result.returncode == 0, result.stdout[-6000:]
    assert result.leftover_shm == []
    match = re.search(r"(\d+) shards written", result.stdout)
    assert match, result.stdout[-3000:]
    four["shards_written"] = int(match.group(1))
    return results


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_uneven_split_writes_every_shard_once(uneven_runs, name):
    run = uneven_runs[name]
    num_samples, _world = CASES[name]
    num_shards = -(-num_samples // 2)
    report = verify_cache(run["cache"])
    assert report.ok, report.problems
    indices = sorted(int(p.name[6:12]) for p in run["cache"].glob("shard-*.safetensors"))
    assert indices == list(range(num_shards))
    assert run["shards_written"] == num_shards
    assert not list(run["cache"].glob("*.tmp"))
    assert safetensors_digests(run["cache"]) == safetensors_digests(run["single"])
    manifest = json.loads((run["cache"] / "manifest.json").read_text())
    assert manifest["producer"]["dp_size"] == run["world"]
