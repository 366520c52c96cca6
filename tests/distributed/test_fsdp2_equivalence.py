"""``engine: fsdp2`` produces the single-process cache: the real CLI on forked gloo ranks, then compare_caches.

fp32 caches must be equal within 1e-5 (compare's fp32 default) for tiny Qwen3, Qwen3-MoE and
DeepSeek-V3 targets at world 2; Qwen3 also at world 4. bf16 is checked on the forward itself
(tests/distributed/_fsdp2_worker.py): every router's top-k expert set must be identical per token and
every hidden state within bf16's compare tolerance (``atol 1e-5 + rtol 1.6e-2``, ~2 ulp; DESIGN §6
measured 0.0). 6 samples in 3 shards of 2 over 2 ranks: rank 1 runs one padding forward, so the
lockstep of the all-gathers is exercised too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launchers import ensure_shm_op_built, run_launcher  # noqa: E402
from support import max_rel_diff, record  # noqa: E402

from tests.distributed import _kill_helpers as kh  # noqa: E402

from ds_capture.cache.common.verify import DEFAULT_TOLERANCES
from ds_capture.cache.dspark.reader import read_manifest  # noqa: E402
from ds_capture.cache.registry import compare_caches

pytestmark = [pytest.mark.distributed]
WORKER = "tests/distributed/_fsdp2_worker.py"

# The CLI's gloo init loads DeepSpeed's shm op: build it outside every test's budget (no-op once cached).
ensure_shm_op_built()


def _recipe(path: Path, target: Path, out: Path, *, engine: str, dtype: str = "fp32") -> Path:
    recipe = {
        "engine": engine,
        "recipe_args": {
            "target_model_name_or_path": str(target), "train_data_path": "demo:conversations",
            "train_split": "train[:6]", "cache_output_dir": str(out), "seq_length": 48, "micro_batch_size": 1,
            "cache_shard_size": 2, "cache_dtype": dtype,
        },
        "capture": {"cpu_threads": 1},  # one thread per rank whatever the world: the count is part of the bits
        "dist_env": {"timeout_minutes": 2},
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


def _single_cache(tmp_path: Path, target: Path) -> Path:
    """The reference: the same recipe in this process, world 1 (the plain Hugging Face model)."""
    from ds_capture.recipe.config import load_config
    from ds_capture.runner import run_capture

    out = tmp_path / "single"
    run_capture(load_config(str(_recipe(tmp_path / "single.yaml", target, out, engine="deepspeed")), []),
                show_progress=False)
    return out


def _fsdp2_cache(tmp_path: Path, target: Path, nproc: int) -> Path:
    out = tmp_path / f"fsdp2_w{nproc}"
    cfg = _recipe(tmp_path / f"fsdp2_w{nproc}.yaml", target, out, engine="fsdp2")
    result = kh.run_cli_forked(nproc, cfg, timeout_s=150)
    assert result.returncode == 0, result.stdout[-6000:]
    assert result.leftover_shm == [], "the job left its shm buffers behind"
    return out


def _assert_equal(fsdp2: Path, single: Path, nproc: int) -> None:
    producer = read_manifest(fsdp2).bookkeeping["producer"]
    assert (producer["engine"], producer["world_size"], producer["dp_size"]) == ("fsdp2", nproc, nproc)
    report = compare_caches(fsdp2, single, atol=None, rtol=None)
    assert (report.atol, report.rtol) == DEFAULT_TOLERANCES["fp32"]
    assert report.equal, report.format()
    assert len(report.shards) == 1 + 3  # target weights + 3 shards, all compared
    assert report.keys["target_hidden_states"].numel > 0


@pytest.mark.timeout(200)
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_fsdp2_world2_cache_equals_single_process(tiny_target, tmp_path: Path, model_type: str) -> None:
    target = tiny_target(model_type)
    fsdp2, single = _fsdp2_cache(tmp_path, target, 2), _single_cache(tmp_path, target)
    _assert_equal(fsdp2, single, 2)
    record(model_type, "fsdp2", {"status": "equal", "max_rel_diff": max_rel_diff(single, fsdp2), "nproc": 2,
                                 "tp_size": 1, "ep_size": 1})  # docs/support.md's FSDP2 column


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_fsdp2_world4_cache_equals_single_process(tiny_target, tmp_path: Path, model_type: str) -> None:
    # 3 shards over 4 ranks: rank 3 has no data at all and runs only padding forwards.
    target = tiny_target(model_type)
    _assert_equal(_fsdp2_cache(tmp_path, target, 4), _single_cache(tmp_path, target), 4)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("model_type", ["qwen3_moe", pytest.param("deepseek_v3", marks=pytest.mark.slow)])  # CI: GQA
def test_fsdp2_bf16_same_experts_and_hidden_states(tiny_target, tmp_path: Path, model_type: str) -> None:
    target = tiny_target(model_type)
    out = tmp_path / "worker"
    result = run_launcher("torchrun", 2, [WORKER, str(target), str(out), "--dtype", "bf16"], None, timeout_s=150)
    assert result.returncode == 0, result.stdout[-6000:]
    atol, rtol = DEFAULT_TOLERANCES["bf16"]
    for rank in range(2):
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert report["routers"] > 0 and report["routed_total"] > 0
        assert report["routed_same"] == report["routed_total"], report  # identical expert choice per token
        # Hidden states are O(1) after the norms; the sharded forward must sit within bf16's compare tolerance.
        assert report["max_diff"] <= atol + rtol, report
        # The rank holds only its dim-0 chunk of the parameters (about half at world 2).
        assert report["local_numel"] <= report["whole_numel"] // 2 + 4096, report
