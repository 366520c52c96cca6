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
bytes.

Then the client's own ceiling: the same runs against an instantaneous endpoint (``--instant-rows`` rows, a
fixed reply of ``--max-tokens`` words, answered at once by a threaded HTTP/1.1 server in another process), so
rows/s there is what the client (validation excluded; requests, journal fsyncs, the event loop) can push at
most; the endpoint counts the TCP connections it accepted, which shows the client reusing its connections.
``--modes`` picks the parts to run. Prints one JSON object; ``--out`` also writes it (``--merge`` updates the
modes run in an existing file and keeps the others).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
    parser.add_argument("--instant-rows", type=int, default=300, help="rows against the instantaneous endpoint")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--merge", action="store_true", help="keep --out's other modes")
    parser.add_argument("--serve-instant", type=int, default=None, help=argparse.SUPPRESS)  # the endpoint process
    args = parser.parse_args()
    if args.serve_instant is not None:
        return _serve_instant(args.serve_instant, args.max_tokens)

    result = {"server": "transformers serve (transformers 5.24), CPU, the demo target", "rows": args.rows,
              "max_tokens": args.max_tokens, "server_threads": args.server_threads, "repeats": args.repeats}
    if args.merge and args.out and args.out.exists():
        result = {**json.loads(args.out.read_text()), **result}
    with tempfile.TemporaryDirectory(prefix="regenerate_bench_") as tmp:
        work = Path(tmp)
        os.environ.setdefault("DS_CAPTURE_HOME", str(work / "home"))
        for mode in args.modes:
            if mode == "instant_endpoint":
                with InstantEndpoint(args.max_tokens) as endpoint:
                    result[mode] = {"rows": args.instant_rows,
                                    **_measure(endpoint, args, work / mode, rows=args.instant_rows)}
                    result[mode]["tcp_connections_accepted"] = endpoint.connections()
                continue
            with TransformersServe(ensure_demo_target(), work, threads=args.server_threads,
                                   extra_args=MODES[mode]) as server:
                result[mode] = _measure(server, args, work / mode)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def _measure(server, args: argparse.Namespace, work: Path, rows: int | None = None) -> dict:
    work.mkdir()
    rows = rows or args.rows

    def one_run(name: str, concurrency: int):
        out = work / f"{name}.jsonl"
        summary = regenerate(RegenerateOptions(
            data=str(demo_data_path()), split=f"train[:{rows}]", output=out, url=server.url,
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


MODES = {"sequential": (), "continuous_batching": ("--continuous-batching",), "instant_endpoint": None}


class InstantEndpoint:
    """A chat-completions endpoint that answers at once (a fixed reply), in its own process; counts connections."""

    def __init__(self, max_tokens: int) -> None:
        self.model = "instant"
        self.max_tokens = max_tokens

    def __enter__(self) -> InstantEndpoint:
        self.process = subprocess.Popen([sys.executable, __file__, "--serve-instant", "0", "--max-tokens",
                                         str(self.max_tokens)], stdout=subprocess.PIPE, text=True)
        try:
            self.port = int(self.process.stdout.readline())  # the port it bound, once it listens
        except ValueError:
            self.process.kill()
            raise
        self.url = f"http://127.0.0.1:{self.port}/v1"
        return self

    def connections(self) -> int:
        import httpx
        return httpx.get(f"http://127.0.0.1:{self.port}/stats", timeout=10).json()["connections"]

    def __exit__(self, *exc) -> None:
        self.process.kill()
        self.process.wait(timeout=30)


def _serve_instant(port: int, max_tokens: int) -> None:
    reply = json.dumps({"choices": [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant", "content": " ".join(["word"] * max_tokens)}}],
        "usage": {"completion_tokens": max_tokens}}).encode()
    connections = [0]
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a client that reuses connections opens few
        disable_nagle_algorithm = True  # else headers and body, two writes, wait on a delayed ACK (40 ms)

        def setup(self) -> None:
            with lock:
                connections[0] += 1
            super().setup()

        def _send(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send(reply)

        def do_GET(self) -> None:  # noqa: N802
            self._send(json.dumps({"connections": connections[0]}).encode())

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
