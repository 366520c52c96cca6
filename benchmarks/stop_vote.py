"""Stop vote: what the per-step SIGTERM/SIGINT vote (``interrupt.StopVote``) costs the capture loop.

In: nothing (2 forked gloo ranks on this host). Out: one JSON object on stdout: for each variant the median
over ``--repeats`` of the seconds per step, and ``overhead`` = variant / no vote - 1.

Each rank runs ``--steps`` steps of a stand-in forward: a sleep (the device's time; the CPU is free, as on a
GPU), ``--step-ms`` long on average but uneven across ranks (rank 0 slow on even steps, rank 1 on odd ones,
by ``--skew`` of the mean), as data-parallel ranks with batches of different lengths are. Variants:

- ``none``: no vote (the loop before this change; no collective inside the loop).
- ``lagged``: the runner's vote (an async all-reduce on a gloo side group, read ``VOTE_LAG_STEPS`` later).
- ``blocking``: the same vote read at once (lag 0): every step waits for the slowest rank of that step.

    python benchmarks/stop_vote.py [--steps 200] [--step-ms 20] [--skew 0.5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rank(rank: int, port: int, args, out_path: Path) -> None:
    import torch.distributed as torch_dist

    from ds_capture.capture.interrupt import VOTE_LAG_STEPS, StopOnSignal, StopVote

    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results: dict[str, list[float]] = {"none": [], "lagged": [], "blocking": []}
    with StopOnSignal(announce=False) as stop:
        for _ in range(args.repeats):
            for variant, lag in (("none", None), ("lagged", VOTE_LAG_STEPS), ("blocking", 0)):
                vote = StopVote(stop, lag=lag) if lag is not None else None
                torch_dist.barrier()
                started = time.perf_counter()
                for step in range(args.steps):
                    if vote is not None and vote.should_stop():
                        raise AssertionError("nobody sent a signal")
                    slow = (step + rank) % 2 == 0
                    time.sleep(args.step_ms / 1000 * (1 + (args.skew if slow else -args.skew)))
                torch_dist.barrier()  # the loop ends when the last rank is done
                results[variant].append((time.perf_counter() - started) / args.steps)
                if vote is not None:
                    vote.close()
    if rank == 0:
        out_path.write_text(json.dumps(results))
    torch_dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--skew", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import socket
    import tempfile

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out_path = Path(tempfile.mkdtemp(prefix="stop_vote_")) / "result.json"
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _rank(rank, port, args, out_path)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    assert codes == [0, 0], codes
    raw = json.loads(out_path.read_text())
    median = {variant: statistics.median(values) for variant, values in raw.items()}
    print(json.dumps({
        "steps": args.steps, "step_ms": args.step_ms, "skew": args.skew, "repeats": args.repeats,
        "seconds_per_step": {k: round(v, 6) for k, v in median.items()},
        "overhead": {k: round(median[k] / median["none"] - 1, 4) for k in ("lagged", "blocking")},
        "runs": raw,
    }, indent=2))


if __name__ == "__main__":
    main()
