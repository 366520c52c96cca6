"""Engines side by side: DeepSpeed layouts (single, DP=2, TP=2, EP=2) versus FSDP2 at world 2, in one run.

In:  a tiny random-init Qwen3-MoE target built in code (``ds_capture.demo.build_tiny_target``, hidden 128,
     4 layers, 8 experts) and the first ``--samples`` bundled demo conversations.
Out: one JSON object on stdout (per layout: tokens/s of the capture loop, wall time, model load time, peak
     RSS of every rank, cache equality against the single-process cache), ``benchmarks/results/engines.md``
     (a table) and ``benchmarks/results/engines.png`` (bars). Layouts that fail are reported with the tail of
     their log, not hidden.

Every layout runs the real ``ds_capture run`` path (``run_capture``) under ``torchrun`` with one intra-op
thread per rank, the single process included (this box is shared: a second thread there oversubscribes the
cores and makes the baseline noisy), so "vs single" is the speed-up from the second rank. Load time is the time spent in ``ds_capture.parallel.engines.build_model`` (wrapped here, nothing else is
changed); tokens/s counts non-padding tokens over the forward/write loop only. Run it with:

    . .venv/bin/activate
    python benchmarks/engines.py [--samples 32] [--seq-length 256] [--micro-batch-size 4] [--layouts single,fsdp2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
# name -> (ranks, engine, distributed section)
LAYOUTS: dict[str, tuple[int, str, dict]] = {
    "single": (1, "deepspeed", {}),
    "ds_dp2": (2, "deepspeed", {}),
    "ds_tp2": (2, "deepspeed", {"tp_size": 2}),
    "ds_ep2": (2, "deepspeed", {"ep_size": 2}),
    "fsdp2_w2": (2, "fsdp2", {}),
}
TARGET = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, head_dim=32)


def worker(config: str, threads: int) -> None:
    """One rank: run the capture, time the engine build, write ``CONFIG.rank{R}.json``."""
    import torch

    torch.set_num_threads(threads)
    import ds_capture.runner as runner
    from ds_capture.recipe.config import load_config

    load_seconds = []
    build_model = runner.build_model

    def timed_build_model(*args, **kwargs):
        started = time.perf_counter()
        model = build_model(*args, **kwargs)
        load_seconds.append(time.perf_counter() - started)
        return model

    runner.build_model = timed_build_model
    summary = runner.run_capture(load_config(config, []), show_progress=False)
    record = dict(rank=int(os.environ.get("RANK", 0)), load_s=sum(load_seconds), wall_s=summary.seconds,
                  capture_s=summary.capture_seconds, num_tokens=summary.num_tokens,
                  peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    # A file per rank: ranks share one log, where their lines interleave.
    Path(f"{config}.rank{record['rank']}.json").write_text(json.dumps(record))


def _recipe(path: Path, target: Path, out: Path, engine: str, distributed: dict, args: argparse.Namespace) -> Path:
    import yaml

    recipe = {
        "engine": engine,
        "recipe_args": {
            "target_model_name_or_path": str(target), "train_data_path": "demo:conversations",
            "train_split": f"train[:{args.samples}]", "cache_output_dir": str(out), "seq_length": args.seq_length,
            "micro_batch_size": args.micro_batch_size, "cache_shard_size": args.shard_size, "cache_dtype": "fp32",
        },
        "dist_env": {"timeout_minutes": 3},
        "capture": {"cpu_threads": args.threads},  # the worker's count (auto would take cores // ranks)
    }
    if distributed:
        recipe["distributed"] = distributed
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_layout(name: str, target: Path, workdir: Path, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(REPO / "tests" / "distributed"))
    from launchers import run_launcher

    nproc, engine, distributed = LAYOUTS[name]
    out = workdir / name
    cfg = _recipe(workdir / f"{name}.yaml", target, out, engine, distributed, args)
    threads = 1
    argv = [str(Path(__file__).resolve()), "--worker", str(cfg), "--threads", str(threads)]
    started = time.perf_counter()
    kind = "single" if nproc == 1 else "torchrun"
    result = run_launcher(kind, nproc, argv, {"OMP_NUM_THREADS": str(threads)}, timeout_s=args.timeout)
    print(f"{name}: rc {result.returncode}", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - started
    ranks = [json.loads(path.read_text()) for path in sorted(workdir.glob(f"{name}.yaml.rank*.json"))]
    if result.returncode != 0 or len(ranks) != nproc:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{name}.failed.log").write_text(result.stdout)
        return dict(layout=name, ok=False, ranks=nproc, engine=engine, returncode=result.returncode,
                    log=str(RESULTS / f"{name}.failed.log"))
    num_tokens, capture_s = ranks[0]["num_tokens"], max(r["capture_s"] for r in ranks)
    return dict(layout=name, ok=True, ranks=nproc, engine=engine, distributed=distributed, threads_per_rank=threads,
                tokens=num_tokens, tokens_per_s=num_tokens / capture_s, capture_s=capture_s,
                load_s=max(r["load_s"] for r in ranks), wall_s=max(r["wall_s"] for r in ranks),
                launch_s=elapsed, peak_rss_mb=[round(r["peak_rss_mb"], 1) for r in ranks], cache=str(out))


def write_outputs(results: list[dict], meta: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    base = next((r for r in results if r["layout"] == "single" and r["ok"]), None)
    lines = [f"# Engines on {meta['target']} ({meta['samples']} samples x {meta['seq_length']} tokens, fp32, CPU)", "",
             "| layout | ranks | tokens/s | vs single | load s | capture s | peak RSS MB per rank | cache = single |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if not r["ok"]:
            lines.append(f"| {r['layout']} | {r['ranks']} | failed (rc {r['returncode']}) | | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        lines.append(f"| {r['layout']} | {r['ranks']} | {r['tokens_per_s']:,.0f} | {ratio} | {r['load_s']:.2f} | "
                     f"{r['capture_s']:.2f} | {' / '.join(f'{m:.0f}' for m in r['peak_rss_mb'])} | "
                     f"{r.get('equal_to_single', '-')} |")
    (RESULTS / "engines.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r["ok"]]
    names = [r["layout"] for r in ok]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (("tokens/s (capture loop)", [r["tokens_per_s"] for r in ok]),
              ("model load s (max over ranks)", [r["load_s"] for r in ok]),
              ("peak RSS MB (max over ranks)", [max(r["peak_rss_mb"]) for r in ok]))
    for axis, (title, values) in zip(axes, panels):
        axis.bar(names, values, color=["#888" if n == "single" else "#2a6" if n.startswith("fsdp2") else "#36c"
                                       for n in names])
        axis.set_title(title)
        axis.tick_params(axis="x", rotation=30)
    figure.suptitle(f"ds_capture engines: {meta['target']}, {meta['samples']} x {meta['seq_length']} tokens")
    figure.tight_layout()
    figure.savefig(RESULTS / "engines.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--shard-size", type=int, default=8)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {list(LAYOUTS)}")
    parser.add_argument("--timeout", type=int, default=90, help="seconds per layout")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.threads)
        return

    sys.path.insert(0, str(REPO))
    from ds_capture.cache.registry import compare_caches
    from ds_capture.demo import build_tiny_target

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ds_capture_bench_") as tmp:
        workdir = Path(tmp)
        os.environ.setdefault("DS_CAPTURE_HOME", str(workdir / "home"))
        target = build_tiny_target(workdir / "target", "qwen3_moe", **TARGET)
        results = [run_layout(name, target, workdir, args) for name in args.layouts.split(",")]
        single = next((r for r in results if r["layout"] == "single" and r["ok"]), None)
        for r in results:
            if r["ok"] and single is not None and r is not single:
                report = compare_caches(Path(r["cache"]), Path(single["cache"]), atol=None, rtol=None)
                r["equal_to_single"] = report.equal
                r["vs_single"] = dict(identity_diff=report.identity_diff,
                                      max_abs={k: d.max_abs for k, d in report.keys.items()})
        for r in results:
            r.pop("cache", None)
    meta = dict(target="qwen3_moe tiny (hidden 128, 4 layers, 8 experts)", samples=args.samples,
                seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, total_s=time.perf_counter() - started)
    write_outputs(results, meta)
    print(json.dumps(dict(meta=meta, results=results), indent=2))


if __name__ == "__main__":
    main()
