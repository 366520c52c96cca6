"""``ds-capture regenerate`` throughput against a real server: rows/s at concurrency 1 and 4, side by side.

    python benchmarks/regenerate_throughput.py                          # 40 demo rows, 32 tokens a reply, 3 repeats
    python benchmarks/regenerate_throughput.py --rows 80 --concurrency 1 4 16 --out benchmarks/results/x.json

The server is ``transformers serve`` (transformers' own OpenAI-compatible server, CPU, offline) serving the demo
target (``tests/regenerate/server.py``), in two modes, one after the other: as it starts by default (one
``generate`` at a time) and with ``--continuous-batching`` (requests in flight decode together). For each mode
the server is started once; each repeat runs every concurrency once, in an order that alternates between repeats,
each into a fresh output; rows/s and generated tokens/s are the request loop's (``RegenerateSummary``: after
validation, before assembly), medians over the repeats. A warm-up run first (continuous batching sets up its
cache on the first request). Greedy decoding: ``outputs_equal`` says whether every run of a mode wrote the same
bytes. Prints one JSON object; ``--out`` also writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout: the package and tests/regenerate/server.py

from ds_capture.demo import demo_data_path, ensure_demo_target  # noqa: E402
from ds_capture.regenerate.client import GenerationSettings  # noqa: E402
from ds_capture.regenerate.driver import RegenerateOptions, regenerate  # noqa: E402
from tests.regenerate.server import TransformersServe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=40, help="the first N demo conversations")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--server-threads", type=int, default=2, help="the server's torch threads")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    result = {"server": "transformers serve (transformers 5.24), CPU, the demo target", "rows": args.rows,
              "max_tokens": args.max_tokens, "server_threads": args.server_threads, "repeats": args.repeats}
    with tempfile.TemporaryDirectory(prefix="regenerate_bench_") as tmp:
        work = Path(tmp)
        os.environ.setdefault("DS_CAPTURE_HOME", str(work / "home"))
        for mode, extra_args in (("sequential", ()), ("continuous_batching", ("--continuous-batching",))):
            with TransformersServe(ensure_demo_target(), work, threads=args.server_threads,
                                   extra_args=extra_args) as server:
                result[mode] = _measure(server, args, work / mode)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def _measure(server: TransformersServe, args: argparse.Namespace, work: Path) -> dict:
    work.mkdir()

    def one_run(name: str, concurrency: int):
        out = work / f"{name}.jsonl"
        summary = regenerate(RegenerateOptions(
            data=str(demo_data_path()), split=f"train[:{args.rows}]", output=out, url=server.url,
            generation=GenerationSettings(model=server.model, max_tokens=args.max_tokens),
            concurrency=concurrency, show_progress=False))
        return summary, out.read_bytes()

    one_run("warmup", max(args.concurrency))
    runs: dict[int, list[dict]] = {c: [] for c in args.concurrency}
    outputs = set()
    for repeat in range(args.repeats):
        for concurrency in args.concurrency if repeat % 2 == 0 else list(reversed(args.concurrency)):
            summary, output = one_run(f"c{concurrency}_r{repeat}", concurrency)
            outputs.add(output)
            runs[concurrency].append({"seconds": round(summary.seconds, 3),
                                      "rows_per_s": round(summary.new_rows / summary.seconds, 3),
                                      "tokens_per_s": round(summary.new_tokens / summary.seconds, 1)})
    medians = {c: {key: statistics.median(run[key] for run in runs[c]) for key in ("rows_per_s", "tokens_per_s")}
               for c in args.concurrency}
    base = medians[args.concurrency[0]]["rows_per_s"]
    return {
        "turns": summary.counts.turns,
        "median": {f"concurrency_{c}": medians[c] for c in args.concurrency},
        "rows_per_s_vs_first": {f"concurrency_{c}": round(medians[c]["rows_per_s"] / base, 3)
                                for c in args.concurrency},
        "runs": {f"concurrency_{c}": runs[c] for c in args.concurrency},
        "outputs_equal": len(outputs) == 1,
    }


if __name__ == "__main__":
    main()
