"""ds-capture plan counts, per rank, exactly the tensors the real engines hold on that rank.

The reference is the engine itself: 2 real gloo ranks (forked) build and load tiny targets with the DeepSpeed
engine (expert parallel + DeepSpeed AutoTP through ``init_inference``, or the family's own TP plan: GLM-MoE-DSA) and
with FSDP2, and report every local parameter and buffer; plan's tensor table (meta model, stand-in TP group, dim-0
chunk rule) must give the same names and the same element counts on each rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ds_capture.recipe.config import parse_config
from ds_capture.sizing.count import Sizer, fsdp2_local_numel, zero3_local_numel
from ds_capture.target.families import read_target_info

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.distributed import _kill_helpers as kh  # noqa: E402

WORKER = str(Path(__file__).resolve().parent / "_plan_worker.py")


def _sizer(target_dir: Path) -> Sizer:
    cfg = parse_config({"recipe_args": {"target_model_name_or_path": str(target_dir), "train_data_path": "x.jsonl",
                                        "cache_output_dir": "out", "seq_length": 32}},
                       source="<test>", base_dir=Path("."))
    return Sizer(cfg, read_target_info(target_dir), [1, 2], "fp32", tp_grain_size=1)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_plan_counts_the_engines_tensors_on_every_rank(tiny_target, tmp_path):
    targets = {name: tiny_target(name, num_hidden_layers=3) for name in ("qwen3_moe", "deepseek_v3", "glm_moe_dsa")}
    cases = [{"target": str(targets["deepseek_v3"]), "engine": "deepspeed", "tp_size": 2, "ep_size": 2},
             {"target": str(targets["qwen3_moe"]), "engine": "deepspeed", "tp_size": 2, "ep_size": 1},
             {"target": str(targets["glm_moe_dsa"]), "engine": "deepspeed", "tp_size": 2, "ep_size": 2},  # our TP plan
             {"target": str(targets["qwen3_moe"]), "engine": "fsdp2", "tp_size": 1, "ep_size": 1}]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    result = kh.run_script_forked(2, [WORKER, tmp_path / "cases.json", tmp_path], timeout_s=230)
    assert result.returncode == 0, result.stdout[-6000:]
    assert not result.leftover_shm, result.leftover_shm
    per_rank = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]

    sizers = {path: _sizer(Path(path)) for path in {case["target"] for case in cases}}
    for results in per_rank:
        for case in results:
            table = sizers[case["target"]].table(case["engine"], case["tp_size"], case["ep_size"], 2)
            if case["engine"] == "fsdp2":
                planned = {e.name: [fsdp2_local_numel(e, 2, case["rank"]), e.itemsize] for e in table.tensors}
            else:
                planned = {e.name: [e.numel(case["tp_rank"]), e.itemsize] for e in table.tensors}
            label = f"{case['engine']} tp={case['tp_size']} ep={case['ep_size']} rank={case['rank']}"
            assert planned == case["tensors"], (label, {k: (planned.get(k), v) for k, v in case["tensors"].items()
                                                        if planned.get(k) != v})
            # The layout really shards: every case holds less than the whole model on this rank.
            whole = sizers[case["target"]].table("deepspeed", 1, 1, 1)
            assert sum(n for n, _ in planned.values()) < sum(e.numel() for e in whole.tensors), label


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_plan_counts_partitioned_expert_parallel_layouts_of_nemo_families(tmp_path):
    """FSDP2's and ZeRO-3's expert-parallel layouts (engine fsdp2, or engine deepspeed with zero_optimization.stage 3;
    ep_size = world) on the tiny releases: plan's table names every local tensor with its local size (experts E/2,
    Engram rows 1/2, the rest FSDP2's dim-0 chunks or ZeRO-3's ceil(numel / 2) partitions, no ZeRO-3 parameter left
    whole after loading), and with the experts kept packed (K3) plan's routed-expert bytes are the stacks' stored
    bytes."""
    pytest.importorskip("nemo_automodel")
    from ds_capture.demo import demo_tokenizer
    from ds_capture.sizing import memory_model as mm
    from ds_capture.sizing.command import target_quantization
    from tests import nemo_k3_release, nemo_v41_release

    v41 = nemo_v41_release.write_tiny_v41_release(tmp_path / "v41", seed=0, tokenizer=demo_tokenizer())
    k3 = nemo_k3_release.write_tiny_k3_release(tmp_path / "k3", seed=0, tokenizer=demo_tokenizer())
    cases = [{"target": str(v41), "engine": engine, "tp_size": 1, "ep_size": 2} for engine in ("fsdp2", "zero3")]
    cases += [{"target": str(k3), "engine": engine, "tp_size": 1, "ep_size": 2, "expert_storage": "checkpoint"}
              for engine in ("fsdp2", "zero3")]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    result = kh.run_script_forked(2, [WORKER, tmp_path / "cases.json", tmp_path], timeout_s=230)
    assert result.returncode == 0, result.stdout[-6000:]
    per_rank = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for results in per_rank:
        for case in results:
            target = read_target_info(Path(case["target"]))
            table = _sizer(Path(case["target"])).table(case["engine"], 1, 2, 2)
            local = ((lambda e: zero3_local_numel(e, 2)) if case["engine"] == "zero3"
                     else (lambda e: fsdp2_local_numel(e, 2, case["rank"])))
            planned = {e.name: [local(e), e.itemsize] for e in table.tensors}
            label = f"{target.model_type} {case['engine']} {case.get('expert_storage')} rank={case['rank']}"
            assert case["whole_numel"] == 0, label
            if case["engine"] == "zero3":  # really partitioned: the rest's parameters hold half (rounded up) each
                assert any(e.zero3_partitioned for e in table.tensors), label
            if case["packed_bytes"]:
                storage = mm.checkpoint_expert_storage(target_quantization(target))
                experts = [e for e in table.tensors if e.is_expert]
                assert {e.name for e in experts} == set(case["packed_bytes"]), label
                assert sum(case["packed_bytes"].values()) == pytest.approx(
                    sum(mm.stored_bytes(e.numel(), e.itemsize, is_routed_expert=True, storage=storage)
                        for e in experts)), label
                planned = {k: v for k, v in planned.items() if k not in case["packed_bytes"]}
            assert planned == case["tensors"], (label, {k: (planned.get(k), v) for k, v in case["tensors"].items()
                                                        if planned.get(k) != v})
