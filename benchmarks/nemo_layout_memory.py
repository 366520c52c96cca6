"""An engine's expert-parallel layout on larger tiny release-layout Kimi K3 and DeepSeek-V4.1 targets: plan's
per-rank figures beside the measured memory per rank, at world 1, 2 and 4.

In:  ``--engine``: ``fsdp2`` (default; FSDP2's layout) or ``zero3`` (``engine: deepspeed`` with
     ``deepspeed_config: {zero_optimization: {stage: 3}}``: DeepSpeed ZeRO-3's layout). Two
     releases per family, written under /tmp and deleted after, quantized as released (tests/nemo_k3_release.py: K3's
     MXFP4 experts; tests/nemo_v41_release.py: V4.1's FP4 experts, FP8 blocks, FP8 Engram tables): the tiny one
     (``scale`` 1, ~1-2 MB in fp32) for the warm-up, and the measured one, every width times :data:`SCALE`
     (~240 MB / ~270 MB of parameters in fp32), so that the parameter bytes outweigh a process's fixed build cost.
Out: one JSON object on stdout (also ``benchmarks/results/nemo_layout_memory.json``, or
     ``nemo_layout_memory_zero3.json`` for ``--engine zero3``):
     ``targets.<family>.world<N>``, per rank:
       * ``plan_param_mb``: ``ds-capture plan``'s parameter bytes for that rank (``engine`` as given,
         ``distributed.ep_size`` = world, ``capture.expert_storage: checkpoint``; world 1: the plain model,
         experts dequantized); ``plan_gather_mb`` its gathered transient (FSDP2: root + two layers; ZeRO-3: the
         largest chain of modules' own parameters, or the load's module + block partitions), ``plan_activation_mb``
         its forward activations (with one MoE layer's local experts dequantized as scratch under ``checkpoint``)
         and ``plan_peak_mb_without_reserve`` its peak less the flat 3 GiB GPU reserve (fp32, 2 x 32 tokens);
       * ``param_mb``: the rank's parameters + buffers as built (DTensor local shards, ZeRO-3 partitions, packed
         experts' stored bytes);
       * ``load_rss_mb``: RSS after building + loading, ``load_growth_mb``: the peak RSS while building + loading,
         ``forward_growth_mb``: the peak RSS during one forward of 2 x 32 tokens, all over the baseline, with
         glibc's mmap threshold fixed (:data:`FIXED_MMAP_THRESHOLD`), so that RSS follows what the process holds;
       * ``peak_growth_mb_adaptive_malloc``: the larger of the two peaks in a second run with glibc's default
         (adaptive) threshold: what a CPU run sees, the freed gathered layers kept by the heap.
     ``summary.<family>.world<N>``: the medians over ranks of those figures, and each world's ratio to world 1,
     measured beside plan's: ``rss_ratio`` (``load_rss_mb``) vs ``plan_param_ratio``, ``peak_ratio``
     (``peak_growth_mb``: the larger of load and forward growth) vs ``plan_peak_ratio``.

The baseline: every rank first builds the *tiny* release of the same family with the same engine, plan, process
groups and expert storage, forwards the same 2 x 32 tokens once, deletes it, runs ``gc.collect()`` and glibc's
``malloc_trim(0)``; the baseline is VmRSS then, and the peak (VmHWM) is reset to it by writing 5 to
/proc/self/clear_refs (reset again before the forward). So the imports, process-group setup and every one-time
first-build / first-forward cost (lazy imports and first-call setup in transformers, NeMo, FSDP2 and gloo: the
~115-130 MB per rank that swamped the 2 MB models) sit in the baseline, and the growth is what
the larger model costs: its parameters, and the transients that scale with it (FSDP2's all-gathered layers, the
loader's read buffers, the dequantized experts, the activations). fp32 compute on CPU (gloo), torchrun ranks,
one thread each, one run each (box shared: RSS figures are +-5 MB); about 4 minutes on 2 cores.

    python benchmarks/nemo_layout_memory.py [--engine fsdp2|zero3]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYER_IDS = {"deepseek_v41": [0, 1, 2, 5], "kimi_k3": [-1, 0, 1, 3]}
SCALE = {"kimi_k3": 16, "deepseek_v41": 20}
"""Widths times 16 / 20: K3 hidden 1024, routed experts 1024 x 1024 (63% of its 60M parameters); V4.1 hidden 640,
experts 640 x 640 (43% of its 68M), Engram tables of 5120 rows."""
WORLDS = (1, 2, 4)
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
"""glibc's initial mmap threshold, made fixed: every allocation over 128 KiB is its own mapping, returned to the
system when freed. Left adaptive (the default), the threshold rises to the largest block freed so far (up to
32 MiB), so FSDP2's gathered layers, once freed, come back from the heap and the heap keeps the pages."""
MB = 2**20
ENGINES = {"fsdp2": ("fsdp2", None), "zero3": ("deepspeed", {"zero_optimization": {"stage": 3}})}
"""``--engine`` -> (the recipe's ``engine``, its ``deepspeed_config``)."""


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> None:
    """VmHWM := VmRSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def worker(engine: str, tiny_release: str, release: str, storage: str) -> None:
    import torch

    torch.set_num_threads(1)
    from ds_capture.parallel.dist import discover_env, distributed_session
    from ds_capture.parallel.engines import build_model
    from ds_capture.parallel.layout import ParallelLayout, build_layout, new_groups
    from ds_capture.parallel.packed_grouped_experts import packed_stacks
    from ds_capture.target.families import read_target_info

    env = discover_env()
    target = read_target_info(Path(release))
    input_ids = torch.randint(1, 100, (2, 32), generator=torch.Generator().manual_seed(env.rank))
    with distributed_session(env, backend="gloo", timeout_minutes=10):
        if env.world_size == 1:
            plan, groups = ParallelLayout.single(), None
        else:  # the tiny release has the same expert and head counts: one plan for both
            plan = build_layout(world_size=env.world_size, rank=env.rank, tp_size=1, ep_size=env.world_size,
                                num_experts=target.num_experts, num_attention_heads=target.num_attention_heads,
                                num_key_value_heads=target.tp_key_value_heads)
            groups = new_groups(plan)

        def build(path: str) -> torch.nn.Module:
            name, ds_config = ENGINES[engine]
            return build_model(name, read_target_info(Path(path)), plan, groups, dtype=torch.float32,
                               attn_implementation=None, ds_config=ds_config, expert_storage=storage)

        with torch.no_grad():  # the warm-up: every one-time cost of a build and a forward, then nothing held
            build(tiny_release)(input_ids=input_ids)
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        baseline_kb = _status_kb("VmRSS")
        _reset_peak()
        model = build(release)
        load_peak_kb, load_rss_kb = _status_kb("VmHWM"), _status_kb("VmRSS")
        _reset_peak()
        with torch.no_grad():
            model(input_ids=input_ids)
        forward_peak_kb = _status_kb("VmHWM")

        def local_bytes(t: torch.Tensor) -> int:
            t = t.to_local() if hasattr(t, "to_local") else getattr(t, "ds_tensor", t)
            return t.numel() * t.element_size()

        local = sum(local_bytes(t) for t in (*model.parameters(), *model.buffers()))
        local += sum(stack.packed_bytes() for stack in packed_stacks(model).values())
        print("MEM " + json.dumps({
            "rank": env.rank, "baseline_mb": baseline_kb / 1024, "param_mb": local / MB,
            "load_rss_mb": (load_rss_kb - baseline_kb) / 1024, "load_growth_mb": (load_peak_kb - baseline_kb) / 1024,
            "forward_growth_mb": (forward_peak_kb - baseline_kb) / 1024}), flush=True)


def _plan(recipe: Path, world: int) -> list[dict]:
    from ds_capture.recipe.config import load_config
    from ds_capture.sizing import memory_model as mm
    from ds_capture.sizing.command import plan_capture

    report = plan_capture(load_config(recipe), world_size=world, gpu_memory_gib=1e6, compute_dtype="fp32",
                          suggest=False, count_dataset=False)
    return [{"plan_param_mb": round(r.param_bytes / MB, 2), "plan_gather_mb": round(r.fsdp2_gather_bytes / MB, 2),
             "plan_activation_mb": round(r.activation_bytes / MB, 2),
             "plan_peak_mb_without_reserve": round((r.peak_bytes - mm.RUNTIME_RESERVE_BYTES) / MB, 2)}
            for r in report.ranks]


def summarize(worlds: dict[str, list[dict]]) -> dict[str, dict]:
    """Per world, the medians over ranks and each world's ratio to world 1, measured beside plan's."""
    def median(ranks: list[dict], key) -> float:
        return statistics.median(key(r) for r in ranks)

    figures = {}
    for name, ranks in worlds.items():
        figures[name] = {
            "load_rss_mb": median(ranks, lambda r: r["load_rss_mb"]),
            "load_growth_mb": median(ranks, lambda r: r["load_growth_mb"]),
            "forward_growth_mb": median(ranks, lambda r: r["forward_growth_mb"]),
            "peak_growth_mb": median(ranks, lambda r: max(r["load_growth_mb"], r["forward_growth_mb"])),
            "peak_growth_mb_adaptive_malloc": median(ranks, lambda r: r["peak_growth_mb_adaptive_malloc"]),
            "plan_param_mb": median(ranks, lambda r: r["plan_param_mb"]),
            "plan_peak_mb_without_reserve": median(ranks, lambda r: r["plan_peak_mb_without_reserve"])}
    one = figures["world1"]
    for figure in figures.values():
        figure.update(rss_ratio=figure["load_rss_mb"] / one["load_rss_mb"],
                      plan_param_ratio=figure["plan_param_mb"] / one["plan_param_mb"],
                      peak_ratio=figure["peak_growth_mb"] / one["peak_growth_mb"],
                      plan_peak_ratio=figure["plan_peak_mb_without_reserve"] / one["plan_peak_mb_without_reserve"])
    return {name: {k: round(v, 3 if k.endswith("ratio") else 2) for k, v in figure.items()}
            for name, figure in figures.items()}


def _measure(run_launcher, world: int, argv: list[str], env: dict[str, str]) -> list[dict]:
    """The worker's figures, one dict per rank in rank order."""
    result = run_launcher("single" if world == 1 else "torchrun", world, argv, env, 600)
    ranks = sorted((json.loads(line[4:]) for line in result.stdout.splitlines() if line.startswith("MEM ")),
                   key=lambda r: r["rank"])
    if result.returncode != 0 or len(ranks) != world:
        raise SystemExit(result.stdout[-3000:])
    return ranks


def main(engine: str) -> None:
    import yaml

    sys.path[:0] = [str(REPO), str(REPO / "tests" / "distributed")]
    from launchers import run_launcher

    from ds_capture.demo import demo_tokenizer
    from tests import nemo_k3_release, nemo_v41_release

    tmp = Path(tempfile.mkdtemp(prefix="ds_capture_nemo_layout_memory_", dir="/tmp"))
    report: dict = {"what": f"engine {engine}, ep_size = world, expert_storage checkpoint (world 1: the plain model, "
                            "experts dequantized); fp32, 2 x 32 tokens, CPU gloo ranks; growth over the RSS after a "
                            "warm-up build + forward of the scale-1 release (module docstring)",
                    "engine": engine, "scale": SCALE, "targets": {}, "summary": {}}
    try:
        writers = {"kimi_k3": nemo_k3_release.write_tiny_k3_release,
                   "deepseek_v41": nemo_v41_release.write_tiny_v41_release}
        for model_type, write in writers.items():
            tiny = write(tmp / f"{model_type}-tiny", seed=0, tokenizer=demo_tokenizer())
            release = write(tmp / model_type, seed=0, tokenizer=demo_tokenizer(), scale=SCALE[model_type])
            worlds = report["targets"][model_type] = {}
            for world in WORLDS:
                storage = "dequantized" if world == 1 else "checkpoint"
                recipe = tmp / f"{model_type}-{world}.yaml"
                name, ds_config = ENGINES[engine]
                recipe.write_text(yaml.safe_dump({
                    "engine": name, **({"deepspeed_config": ds_config} if ds_config else {}),
                    "distributed": {"tp_size": 1, "ep_size": world},
                    "capture": {"compute_dtype": "fp32", "expert_storage": storage},
                    "recipe_args": dict(target_model_name_or_path=str(release), train_data_path="demo:conversations",
                                        cache_output_dir=str(tmp / "unused"), seq_length=32, micro_batch_size=2,
                                        cache_dtype="fp32", target_layer_ids=LAYER_IDS[model_type])}))
                planned = _plan(recipe, world)
                argv = [__file__, "--worker", engine, str(tiny), str(release), storage]
                ranks = _measure(run_launcher, world, argv, FIXED_MMAP_THRESHOLD)
                adaptive = _measure(run_launcher, world, argv, {})
                worlds[f"world{world}"] = [
                    {**planned[r], **{k: round(v, 2) for k, v in ranks[r].items() if k != "rank"},
                     "peak_growth_mb_adaptive_malloc": round(max(adaptive[r]["load_growth_mb"],
                                                                 adaptive[r]["forward_growth_mb"]), 2), "rank": r}
                    for r in range(world)]
            report["summary"][model_type] = summarize(worlds)
        print(json.dumps(report, indent=2))
        (REPO / "benchmarks" / "results").mkdir(exist_ok=True)
        out = "nemo_layout_memory.json" if engine == "fsdp2" else f"nemo_layout_memory_{engine}.json"
        (REPO / "benchmarks" / "results" / out).write_text(json.dumps(report, indent=2) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:6])
    else:
        parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        parser.add_argument("--engine", default="fsdp2", choices=sorted(ENGINES),
                            help="fsdp2 (default) or zero3 (engine deepspeed, zero_optimization.stage 3)")
        main(parser.parse_args().engine)
