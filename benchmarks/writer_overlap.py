"""Writer overlap: does the asynchronous shard writer hide shard writes behind the forward passes?

In: the demo target and the first ``--samples`` demo conversations (seq 512, the runner's default
trimmed + sorted micro-batches), cut into ``--shard-size``-row shards. Writes are slowed to about
the compute time: ``DSparkShards.finish`` (as the async writer calls it once a shard's rows are in) is
wrapped so each shard's write (rows, checksum, fsync, rename) takes ``--write-factor`` x the measured compute
time per shard (it sleeps for the rest). Out: one JSON object on stdout with, per variant, every
run and the median seconds:

- ``compute_only``: the runner's compute loop (hooks, forward, collect), results dropped;
- ``write_only``: the same micro-batches (captured once beforehand) through the synchronous writer;
- ``synchronous``: compute loop + ``AsyncShardWriter(synchronous=True)`` (writer_buffer_mib 0);
- ``asynchronous``: compute loop + ``AsyncShardWriter`` with ``--buffer-mib`` of slots, ``close`` (the join) included;

and ``ratio`` = asynchronous / max(compute_only, write_only) (goal: <= 1.15). With N shards the
last write cannot overlap any compute, so the floor is about (N + 1) / N: 16 shards by default.

    . .venv/bin/activate && python benchmarks/writer_overlap.py [--samples 128] [--shard-size 8] [--repeats 3]
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from common import TRIMMED, base_parser, capture_loop, interleaved, median, micro_batch, summary, workload

import ds_capture.cache.common.async_writer as async_writer  # noqa: E402 - after common puts the checkout on sys.path
from ds_capture.cache.dspark.kind import host_staging  # noqa: E402
from ds_capture.cache.dspark.writer import DSparkShards  # noqa: E402


def main() -> None:
    parser = base_parser(__doc__, samples=128, shard_size=8)
    parser.add_argument("--write-factor", type=float, default=1.0,
                        help="each shard write is slowed to this x the compute time per shard")
    parser.add_argument("--buffer-mib", type=int, default=64)
    args = parser.parse_args()
    work = workload(args)
    model = work.model()
    manifest = work.manifest()
    plan = work.plan(TRIMMED)
    num_shards = manifest.num_shards

    capture_loop(model, work, plan[:2])  # warm-up
    captured = []
    capture_loop(model, work, plan, sink=lambda b, h, l: captured.append(micro_batch(b, h, l)))
    # Calibrate on the compute-only loop itself (holding the captured tensors made that run slower).
    compute_calibration = [capture_loop(model, work, plan) for _ in range(3)]
    per_shard = args.write_factor * median(compute_calibration) / num_shards

    real_finish = DSparkShards.finish

    def slow_finish(self, index, shard):
        started = time.perf_counter()
        written = real_finish(self, index, shard)
        time.sleep(max(0.0, per_shard - (time.perf_counter() - started)))
        return written

    DSparkShards.finish = slow_finish

    with tempfile.TemporaryDirectory(prefix="writer_overlap-") as tmp:
        def fresh(name: str, repeat: int) -> Path:
            out = Path(tmp) / f"{name}{repeat}"
            out.mkdir()
            return out

        def writer(name: str, repeat: int, *, synchronous: bool):
            staging = host_staging(manifest, work.micro_batch_size, args.buffer_mib, torch.device("cpu"))
            return async_writer.AsyncShardWriter(DSparkShards(fresh(name, repeat), manifest), staging,
                                                 synchronous=synchronous)

        def compute_only(_repeat: int) -> float:
            return capture_loop(model, work, plan)

        def write_only(repeat: int) -> float:
            started = time.perf_counter()
            with writer("write", repeat, synchronous=True) as w:
                for item in captured:
                    w.put(item)
            return time.perf_counter() - started

        def loop_with_writer(name: str, synchronous: bool):
            def run(repeat: int) -> float:
                started = time.perf_counter()
                with writer(name, repeat, synchronous=synchronous) as w:
                    capture_loop(model, work, plan, sink=lambda b, h, l: w.put(micro_batch(b, h, l)))
                assert w.shards_written == num_shards
                return time.perf_counter() - started
            return run

        seconds = interleaved({"compute_only": compute_only, "write_only": write_only,
                               "synchronous": loop_with_writer("sync", True),
                               "asynchronous": loop_with_writer("async", False)}, args.repeats)
        # Same bytes either way (byte-identical shards are asserted by tests/unit/test_throughput.py).
        shard_bytes = sum(p.stat().st_size for p in (Path(tmp) / "async0").glob("shard-*.safetensors"))

    bound = max(median(seconds["compute_only"]), median(seconds["write_only"]))
    ratio = median(seconds["asynchronous"]) / bound
    print(json.dumps({
        "benchmark": "writer_overlap",
        **work.describe(),
        "num_shards": num_shards,
        "buffer_mib": args.buffer_mib,
        "shard_bytes_total": shard_bytes,
        "compute_calibration_seconds": [round(x, 3) for x in compute_calibration],
        "write_seconds_per_shard_target": round(per_shard, 4),
        **{name: summary(values, work.num_tokens) for name, values in seconds.items()},
        "sync_over_async": round(median(seconds["synchronous"]) / median(seconds["asynchronous"]), 3),
        "floor_ratio_(N+1)/N": round((num_shards + 1) / num_shards, 3),
        "ratio": round(ratio, 3),
        "goal_ratio_max": 1.15,
        "goal_met": ratio <= 1.15,
    }, indent=2))


if __name__ == "__main__":
    main()
