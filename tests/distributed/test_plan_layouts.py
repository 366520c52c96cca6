"""ds-capture plan counts, per rank, exactly the tensors the real engines hold on that rank: name for name, byte for byte.

The reference is the engine itself: real gloo ranks (forked) build and load tiny targets through the engines' one
entry point (:func:`~ds_capture.parallel.engines.build_model`) in every layout (DP, TP, EP, TP x EP with AutoTP or the
family's own TP plan, FSDP2, FSDP2 + EP, ZeRO-3 + EP, experts packed as released) and report every local parameter and
buffer; plan's per-rank tensor table (:meth:`~ds_capture.sizing.count.Sizer.rank_tensors`: the meta model and the same
:class:`~ds_capture.target.shard_spec.ShardSpec` the engine loads by) must give the same names and the same bytes on
each rank. The engine's tensors do not depend on the cache kind (``build_model`` takes none), so one run per layout
covers both kinds. CI runs 2 ranks; ``DS_CAPTURE_FULL=1`` adds 4 ranks. Each run prints its table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ds_capture.parallel.resolve import layout_of
from ds_capture.recipe.config import parse_config
from ds_capture.sizing.count import Layout, Sizer
from ds_capture.target.families import read_target_info

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.distributed import _kill_helpers as kh  # noqa: E402

WORKER = str(Path(__file__).resolve().parent / "_plan_worker.py")

# (label, target, engine, tp_size, ep_size, expert_storage) per world size: every layout the engines build.
HF_LAYOUTS = {
    2: [("DP", "qwen3_moe", "deepspeed", 1, 1), ("TP", "qwen3_moe", "deepspeed", 2, 1),
        ("EP", "deepseek_v3", "deepspeed", 1, 2), ("TP x EP", "deepseek_v3", "deepspeed", 2, 2),
        ("TP x EP, the family's TP plan", "glm_moe_dsa", "deepspeed", 2, 2), ("FSDP2", "qwen3_moe", "fsdp2", 1, 1)],
    4: [("DP", "qwen3_moe", "deepspeed", 1, 1), ("DP x TP", "qwen3_moe", "deepspeed", 2, 1),
        ("EP", "deepseek_v3", "deepspeed", 1, 4), ("TP x EP over DP", "deepseek_v3", "deepspeed", 2, 2),
        ("TP x EP", "deepseek_v3", "deepspeed", 2, 4), ("TP x EP, the family's TP plan", "glm_moe_dsa", "deepspeed", 2, 4),
        ("FSDP2", "qwen3_moe", "fsdp2", 1, 1)],
}
NEMO_LAYOUTS = [("FSDP2 + EP", "v41", "fsdp2", None), ("ZeRO-3 + EP", "v41", "zero3", None),
                ("FSDP2 + EP, experts packed", "k3", "fsdp2", "checkpoint"),
                ("ZeRO-3 + EP, experts packed", "k3", "zero3", "checkpoint")]


def _sizer(target_dir: Path) -> Sizer:
    cfg = parse_config({"recipe_args": {"target_model_name_or_path": str(target_dir), "train_data_path": "x.jsonl",
                                        "cache_output_dir": "out", "seq_length": 32}},
                       source="<test>", base_dir=Path("."))
    return Sizer(cfg, read_target_info(target_dir), [1, 2], "fp32", tp_grain_size=1)


def _layout(case: dict, world: int, sizer: Sizer) -> Layout:
    """The case's layout as the session resolves it (:func:`~ds_capture.parallel.resolve.layout_of`), as plan sizes it."""
    zero3 = case["engine"] == "zero3"
    engine = "deepspeed" if zero3 else case["engine"]
    parallel = layout_of(sizer.target, engine=engine, zero_stage=3 if zero3 else 0, world_size=world, rank=0,
                         tp_size=case["tp_size"], ep_size=case["ep_size"], expert_storage=None)
    return Layout.of(parallel, engine, 1)


def _run(cases: list[dict], world: int, tmp_path: Path, timeout_s: int) -> list[dict]:
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    result = kh.run_script_forked(world, [WORKER, tmp_path / "cases.json", tmp_path], timeout_s=timeout_s)
    assert result.returncode == 0, result.stdout[-6000:]
    assert not result.leftover_shm, result.leftover_shm
    return [case for rank in range(world) for case in json.loads((tmp_path / f"rank{rank}.json").read_text())]


def _compare(results: list[dict], world: int) -> list[str]:
    """Plan's table equals the engine's on every rank; returns the printed table's rows."""
    from ds_capture.sizing import memory_model as mm
    from ds_capture.sizing.command import target_quantization

    sizers: dict[str, Sizer] = {}
    rows = []
    for case in sorted(results, key=lambda c: (c["index"], c["rank"])):
        sizer = sizers.setdefault(case["target"], _sizer(Path(case["target"])))
        layout = _layout(case, world, sizer)
        planned = {name: list(value) for name, value in sizer.rank_tensors(layout, case["rank"]).items()}
        label = f"{case['label']} ({sizer.target.model_type}, {layout.describe()}) rank {case['rank']}"
        packed_bytes = planned_packed = 0
        if case["packed_bytes"]:  # kept as released: plan counts the stacks' stored bytes from the quantization
            storage = mm.checkpoint_expert_storage(target_quantization(sizer.target))
            table = sizer.table(layout.sharding, layout.tp_size, layout.ep_size, world)
            assert {e.name for e in table.tensors if e.is_expert} == set(case["packed_bytes"]), label
            packed_bytes = sum(case["packed_bytes"].values())
            planned_packed = sum(mm.stored_bytes(planned[n][0], planned[n][1], is_routed_expert=True, storage=storage)
                                 for n in case["packed_bytes"])
            assert packed_bytes == pytest.approx(planned_packed), label
            planned = {k: v for k, v in planned.items() if k not in case["packed_bytes"]}
        assert planned == case["tensors"], (label, {k: (planned.get(k), v) for k, v in case["tensors"].items()
                                                    if planned.get(k) != v}, sorted(set(planned) ^ set(case["tensors"])))
        assert case["whole_numel"] == 0, label  # no ZeRO-3 parameter left whole after loading
        engine_bytes = sum(n * size for n, size in case["tensors"].values()) + packed_bytes
        plan_bytes = sum(n * size for n, size in planned.values()) + planned_packed
        whole = sizer.rank_tensors(Layout("deepspeed", 1, 1, 1, 1), 0)
        if layout.world_size > 1 and (layout.tp_size, layout.ep_size, layout.sharding) != (1, 1, "deepspeed"):
            assert engine_bytes < sum(n * size for n, size in whole.values()), label  # the layout really shards
        rows.append(f"| {case['label']} | {sizer.target.model_type} | {case['rank']} | {len(case['tensors'])} | "
                    f"{plan_bytes:,.0f} | {engine_bytes:,} | equal |")
    table = ["| layout | target | rank | tensors | plan bytes | engine bytes | |", "|---|---|---|---|---|---|---|", *rows]
    print(f"\nplan vs engine, {world} gloo ranks:\n" + "\n".join(table))
    return table


def _hf_cases(tiny_target, world: int) -> list[dict]:
    return [{"index": i, "label": label, "target": str(tiny_target(model_type, num_hidden_layers=3)),
             "engine": engine, "tp_size": tp, "ep_size": ep}
            for i, (label, model_type, engine, tp, ep) in enumerate(HF_LAYOUTS[world])]


def _nemo_cases(tmp_path: Path, world: int) -> list[dict]:
    from ds_capture.demo import demo_tokenizer
    from tests import nemo_k3_release, nemo_v41_release

    releases = {"v41": nemo_v41_release.write_tiny_v41_release(tmp_path / "v41", seed=0, tokenizer=demo_tokenizer()),
                "k3": nemo_k3_release.write_tiny_k3_release(tmp_path / "k3", seed=0, tokenizer=demo_tokenizer())}
    return [{"index": i, "label": label, "target": str(releases[release]), "engine": engine, "tp_size": 1,
             "ep_size": world, **({"expert_storage": storage} if storage else {})}
            for i, (label, release, engine, storage) in enumerate(NEMO_LAYOUTS)]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_plan_counts_the_engines_tensors_on_every_rank(tiny_target, tmp_path):
    _compare(_run(_hf_cases(tiny_target, 2), 2, tmp_path, 230), 2)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_plan_counts_partitioned_expert_parallel_layouts_of_nemo_families(tmp_path):
    """FSDP2's and ZeRO-3's expert-parallel layouts (engine fsdp2, or engine deepspeed with zero_optimization.stage 3;
    ep_size = world) on the tiny releases: experts E/2, Engram rows 1/2, the rest FSDP2's dim-0 chunks or ZeRO-3's
    ceil(numel / 2) partitions, no ZeRO-3 parameter left whole after loading; with the experts kept packed (K3) plan's
    routed-expert bytes are the stacks' stored bytes."""
    pytest.importorskip("nemo_automodel")
    _compare(_run(_nemo_cases(tmp_path, 2), 2, tmp_path, 230), 2)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_plan_counts_the_engines_tensors_on_four_ranks(tiny_target, tmp_path):
    pytest.importorskip("nemo_automodel")
    hf = _hf_cases(tiny_target, 4)
    nemo = [{**case, "index": case["index"] + len(hf)} for case in _nemo_cases(tmp_path, 4)]
    _compare(_run(hf + nemo, 4, tmp_path, 580), 4)
