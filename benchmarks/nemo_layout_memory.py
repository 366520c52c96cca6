"""FSDP2's expert-parallel layout on the tiny release-layout Kimi K3 and DeepSeek-V4.1: plan's per-rank figure beside
the measured memory per rank, at world 1, 2 and 4.

In:  nothing. The tiny releases (tests/nemo_k3_release.py, tests/nemo_v41_release.py: quantized as released) are
     written under /tmp and deleted after.
Out: one JSON object on stdout (also ``benchmarks/results/nemo_layout_memory.json``): per target and world, per rank
       * ``plan_param_mb``: ``ds-capture plan``'s parameter bytes for that rank (``engine: fsdp2``,
         ``distributed.ep_size`` = world, ``capture.expert_storage: checkpoint``; world 1: the plain model,
         experts dequantized), ``plan_gather_mb`` its FSDP2 transient (root + two layers) and
         ``plan_peak_mb_without_reserve`` its peak less the flat 3 GiB GPU reserve (fp32, 2 x 32 tokens);
       * ``param_mb``: the rank's parameters + buffers as built (DTensor local shards, packed experts' stored bytes);
       * ``load_growth_mb`` / ``forward_growth_mb``: peak RSS added by building + loading, and after one forward of
         2 x 32 tokens, over the baseline after imports and process-group setup (VmHWM - VmRSS).
     fp32 compute on CPU (gloo), torchrun ranks, one run each (box shared: RSS figures are +-5 MB).

    python benchmarks/nemo_layout_memory.py
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYER_IDS = {"deepseek_v41": [0, 1, 2, 5], "kimi_k3": [-1, 0, 1, 3]}


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def worker(release: str, storage: str) -> None:
    import torch

    torch.set_num_threads(1)
    from ds_capture.parallel.dist import discover_env, distributed_session
    from ds_capture.parallel.engines import build_model
    from ds_capture.parallel.layout import ParallelLayout, build_layout, new_groups
    from ds_capture.parallel.packed_grouped_experts import packed_stacks
    from ds_capture.target.families import read_target_info

    target = read_target_info(Path(release))
    env = discover_env()
    with distributed_session(env, backend="gloo", timeout_minutes=10):
        if env.world_size == 1:
            plan, groups = ParallelLayout.single(), None
        else:
            plan = build_layout(world_size=env.world_size, rank=env.rank, tp_size=1, ep_size=env.world_size,
                                num_experts=target.num_experts, num_attention_heads=target.num_attention_heads,
                                num_key_value_heads=target.tp_key_value_heads)
            groups = new_groups(plan)
        baseline_kb = _status_kb("VmRSS")
        model = build_model("fsdp2", target, plan, groups, dtype=torch.float32, attn_implementation=None,
                            ds_config=None, expert_storage=storage)
        load_peak_kb = _status_kb("VmHWM")
        input_ids = torch.randint(1, 100, (2, 32), generator=torch.Generator().manual_seed(env.rank))
        with torch.no_grad():
            model(input_ids=input_ids)
        forward_peak_kb = _status_kb("VmHWM")

        def local_bytes(t: torch.Tensor) -> int:
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size()

        local = sum(local_bytes(t) for t in (*model.parameters(), *model.buffers()))
        local += sum(stack.packed_bytes() for stack in packed_stacks(model).values())
        print("MEM " + json.dumps({
            "rank": env.rank, "param_mb": local / 2**20, "load_growth_mb": (load_peak_kb - baseline_kb) / 1024,
            "forward_growth_mb": (forward_peak_kb - baseline_kb) / 1024}), flush=True)


def _plan(recipe: Path, world: int) -> list[dict]:
    from ds_capture.recipe.config import load_config
    from ds_capture.sizing import memory_model as mm
    from ds_capture.sizing.command import plan_capture

    report = plan_capture(load_config(recipe), world_size=world, gpu_memory_gib=1e6, compute_dtype="fp32",
                          suggest=False, count_dataset=False)
    mb = 2**20
    return [{"plan_param_mb": round(r.param_bytes / mb, 2), "plan_gather_mb": round(r.fsdp2_gather_bytes / mb, 2),
             "plan_peak_mb_without_reserve": round((r.peak_bytes - mm.RUNTIME_RESERVE_BYTES) / mb, 2)}
            for r in report.ranks]


def main() -> None:
    import yaml

    sys.path[:0] = [str(REPO), str(REPO / "tests" / "distributed")]
    from launchers import run_launcher

    from ds_capture.demo import demo_tokenizer
    from tests import nemo_k3_release, nemo_v41_release

    tmp = Path(tempfile.mkdtemp(prefix="ds_capture_nemo_layout_memory_", dir="/tmp"))
    report: dict = {"what": "engine fsdp2, ep_size = world, expert_storage checkpoint (world 1: the plain model, "
                            "experts dequantized); fp32, 2 x 32 tokens, CPU gloo ranks", "targets": {}}
    try:
        writers = {"kimi_k3": nemo_k3_release.write_tiny_k3_release,
                   "deepseek_v41": nemo_v41_release.write_tiny_v41_release}
        for model_type, write in writers.items():
            release = write(tmp / model_type, seed=0, tokenizer=demo_tokenizer())
            report["targets"][model_type] = {}
            for world in (1, 2, 4):
                storage = "dequantized" if world == 1 else "checkpoint"
                recipe = tmp / f"{model_type}-{world}.yaml"
                recipe.write_text(yaml.safe_dump({
                    "engine": "fsdp2", "distributed": {"tp_size": 1, "ep_size": world},
                    "capture": {"compute_dtype": "fp32", "expert_storage": storage},
                    "recipe_args": dict(target_model_name_or_path=str(release), train_data_path="demo:conversations",
                                        cache_output_dir=str(tmp / "unused"), seq_length=32, micro_batch_size=2,
                                        cache_dtype="fp32", target_layer_ids=LAYER_IDS[model_type])}))
                planned = _plan(recipe, world)
                result = run_launcher("single" if world == 1 else "torchrun", world,
                                      [__file__, "--worker", str(release), storage], None, 600)
                ranks = sorted((json.loads(line[4:]) for line in result.stdout.splitlines()
                                if line.startswith("MEM ")), key=lambda r: r["rank"])
                if result.returncode != 0 or len(ranks) != world:
                    raise SystemExit(result.stdout[-3000:])
                report["targets"][model_type][f"world{world}"] = [
                    {**planned[r], **{k: round(v, 2) for k, v in ranks[r].items() if k != "rank"}, "rank": r}
                    for r in range(world)]
        print(json.dumps(report, indent=2))
        (REPO / "benchmarks" / "results").mkdir(exist_ok=True)
        (REPO / "benchmarks" / "results" / "nemo_layout_memory.json").write_text(json.dumps(report, indent=2) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
