"""Soak and chaos: ``ds-capture serve`` under NeMo trainers and hostile clients, on one process and on 2-rank EP.

In: the 8-layer tiny Qwen3-MoE of the EAGLE-3 fixtures (fp32, CPU, seq_length 128), served by ``ds-capture serve``
(1 process, and ``torchrun`` 2 ranks with ``ep_size: 2``: one URL per replica). Per layout:

1. *idle*: each well-behaved trainer's batches answered by the idle service, one request at a time (the reference);
2. *calm* (``--calm-s``): ``--trainers`` NeMo clients (NeMo 0.7.0's own ``RemoteEagle3TargetModel``, each in a
   process of its own, one request in flight per URL, its draft vocabulary of 96 ids) send their batches in a loop;
3. *chaos* (``--chaos-s``): the same trainers again, beside hostile clients: a NeMo trainer with another draft
   vocabulary (200 ids, same host), clients SIGKILLed mid-request, clients hanging up mid-reply, clients trickling
   their bodies, oversized / malformed / bad-HTTP requests, reconnect storms (new connections sending ``generate``
   without a vocabulary, health and heartbeat);
4. quiet: the trainers stop; ``ds_capture_serve_in_flight`` (requests admitted and not answered) and the queue must
   be 0 (else: hung futures); SIGTERM must end every rank with exit 0.

Out (JSON, stdout and ``--out``), per layout and phase: every well-behaved answer against the idle one (byte for
byte: ``mismatches``), HTTP errors and deaths of the trainers, latency p50 / p99 / max, tokens/s, per-rank RSS over
time (MiB, every ``--rss-interval`` s) and its growth after warm-up, hostile outcomes, refusals by reason. With
``--losses``, NeMo's ``TrainEagle3Recipe`` (5 steps) against the service alone and again during chaos.

    python benchmarks/serve_soak.py --calm-s 60 --chaos-s 300 --out benchmarks/results/serve_soak.json

The soak is not part of CI (``scripts/dev.py test --full`` does not run it either); it runs from here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEQ_LENGTH = 128
VOCAB = 384


# ---------------------------------------------------------------------------------------------- the trainer process
def _batches(seed: int, count: int) -> list[dict]:
    """A trainer's batches: rows 1-4, lengths 48 / 96 / 128, left padding on some."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    out = []
    for index in range(count):
        rows = 1 + index % 4
        length = (48, 96, 128)[index % 3]
        ids = torch.randint(0, 300, (rows, length), generator=generator)
        mask = torch.ones(rows, length, dtype=torch.long)
        if index % 2:
            mask[:, : length // 4] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "loss_mask": mask.clone()})
    return out


def _digest(result: dict) -> str:
    from ds_capture.serve.wire import encode

    return hashlib.sha256(encode(result)).hexdigest()


def trainer_main(args: argparse.Namespace) -> None:
    """One NeMo client: ``--reference`` answers its batches once and saves their digests; otherwise it loops over
    them from ``go`` for ``--seconds``, comparing each answer with the reference, and writes its summary."""
    import torch
    from nemo_automodel.components.speculative.eagle.remote.client import RemoteEagle3TargetModel

    model = RemoteEagle3TargetModel(args.url, device=torch.device("cpu"), timeout=120, max_retries=3)
    ids = torch.arange(args.draft_vocab)
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[ids] = True
    model.set_vocab_mapping(ids, mask)
    batches = _batches(args.seed, 6)
    out = Path(args.out)

    def ask(index: int) -> dict:
        batch = batches[index % len(batches)]
        payload = model._build_payload(batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
        client = model._clients[next(model._next)]  # generate_batch's round-robin, answers kept raw
        return client.generate(payload)

    if args.reference:
        out.write_text(json.dumps([_digest(ask(i)) for i in range(len(batches))]))
        model.close()
        return
    reference = json.loads(Path(args.reference_file).read_text())
    (out.parent / (out.name + ".ready")).touch()
    while not Path(args.go).exists():
        time.sleep(0.05)
    started = time.monotonic()
    latencies, errors, mismatches, tokens, index = [], [], 0, 0, 0
    while time.monotonic() - started < args.seconds:
        asked = time.monotonic()
        try:
            result = ask(index)
        except Exception as error:  # noqa: BLE001 - a NeMo trainer dies of this: count it
            errors.append(f"{type(error).__name__}: {error}"[:300])
            time.sleep(0.5)
            index += 1
            continue
        latencies.append(time.monotonic() - asked)
        mismatches += _digest(result) != reference[index % len(batches)]
        tokens += int(batches[index % len(batches)]["attention_mask"].sum())
        index += 1
    seconds = time.monotonic() - started
    model.close()
    out.write_text(json.dumps({"requests": len(latencies), "errors": errors, "mismatches": mismatches,
                               "latencies": latencies, "tokens": tokens, "seconds": seconds}))


# ---------------------------------------------------------------------------------------------- hostile clients
def _raw(port: int, data: bytes, *, read: int = 0, timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return sock.recv(read) if read else b""


def _request(path: str, body: bytes, length: int | None = None) -> bytes:
    return (f"POST /{path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode() + body


class Hostile:
    """The hostile clients of the module docstring, each in a thread of its own, until ``stop``."""

    KILL_SCRIPT = ("import socket,sys,time\ns=socket.create_connection(('127.0.0.1',int(sys.argv[1])))\n"
                   "s.sendall(open(sys.argv[2],'rb').read())\nr=b''\n"
                   "while not r.endswith(b'}'): r+=s.recv(4096)\n"
                   "s.sendall(open(sys.argv[3],'rb').read())\ntime.sleep(60)\n")

    def __init__(self, ports: list[int], work: Path, seed: int = 0) -> None:
        from ds_capture.serve.wire import encode

        self.ports, self.work, self.random = ports, work, random.Random(seed)
        self.stop = threading.Event()
        self.counts: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()
        import torch

        batch = _batches(1000 + seed, 4)[3]
        self.body = encode(batch)
        ids = torch.arange(96)  # the well-behaved trainers' vocabulary: these clients reach the forward
        mask = torch.zeros(VOCAB, dtype=torch.bool)
        mask[ids] = True
        self.set_vocab = _request("set_vocab_mapping", encode({"selected_token_ids": ids, "selected_token_mask": mask}))
        self.request_file = work / "hostile_request.bin"
        self.request_file.write_bytes(_request("generate", self.body))
        self.set_vocab_file = work / "hostile_set_vocab.bin"
        self.set_vocab_file.write_bytes(self.set_vocab)

    def _connect(self, timeout: float = 30.0) -> socket.socket:
        """A connection on which this client's draft vocabulary is set (its own, so its generate is forwarded)."""
        sock = socket.create_connection(("127.0.0.1", self._port()), timeout=timeout)
        sock.sendall(self.set_vocab)
        reply = b""
        while not reply.endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError("closed after set_vocab_mapping")
            reply += chunk
        return sock

    def _count(self, kind: str, outcome: str) -> None:
        with self._lock:
            self.counts.setdefault(kind, {}).setdefault(outcome, 0)
            self.counts[kind][outcome] += 1

    def _port(self) -> int:
        return self.random.choice(self.ports)

    def _every(self, kind: str, interval_s: float, action) -> None:
        while not self.stop.wait(interval_s * (0.5 + self.random.random())):
            try:
                self._count(kind, action() or "done")
            except OSError as error:
                self._count(kind, type(error).__name__)

    def sigkilled(self) -> str:
        proc = subprocess.Popen([sys.executable, "-c", self.KILL_SCRIPT, str(self._port()), str(self.set_vocab_file),
                                 str(self.request_file)])
        time.sleep(0.2 + self.random.random() * 0.5)
        proc.kill()
        proc.wait()
        return "killed"

    def hang_up_mid_reply(self) -> str:
        with self._connect() as sock:
            sock.sendall(_request("generate", self.body))
            return sock.recv(64)[:12].decode(errors="replace")

    def trickle(self) -> str:
        with self._connect() as sock:
            data = _request("generate", self.body)
            for start in range(0, min(len(data), 4096), 256):
                if self.stop.is_set():
                    return "stopped"
                sock.sendall(data[start:start + 256])
                time.sleep(0.2)
            return "abandoned"  # hangs up mid-body

    def bad(self) -> str:
        port = self._port()
        kind = self.random.choice(["oversized", "malformed", "bad_http", "huge_header"])
        if kind == "oversized":
            reply = _raw(port, _request("generate", b"NMET", length=2**40), read=64)
        elif kind == "malformed":
            reply = _raw(port, _request("generate", os.urandom(300)), read=64)
        elif kind == "bad_http":
            reply = _raw(port, b"GARBAGE / NOT-HTTP\r\n\r\n", read=64)
        else:
            reply = _raw(port, b"GET /health HTTP/1.1\r\nX: " + b"a" * 200_000 + b"\r\n\r\n", read=64)
        return f"{kind} {reply[9:12].decode(errors='replace') or 'closed'}"

    def storm(self) -> str:
        import httpx

        statuses = []
        for _ in range(20):
            port = self._port()
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                statuses.append(client.get("/health").status_code)
                statuses.append(client.post("/heartbeat", content=b"{}").status_code)
                statuses.append(client.post("/generate", content=self.body).status_code)  # no vocabulary of its own
        return ",".join(sorted({str(s) for s in statuses}))

    def start(self) -> list[threading.Thread]:
        plan = [("sigkilled_mid_request", 1.5, self.sigkilled), ("hang_up_mid_reply", 1.0, self.hang_up_mid_reply),
                ("trickled_body", 1.0, self.trickle), ("bad_requests", 0.3, self.bad),
                ("reconnect_storm", 5.0, self.storm)]
        threads = [threading.Thread(target=self._every, args=item, daemon=True) for item in plan]
        for thread in threads:
            thread.start()
        return threads


# ---------------------------------------------------------------------------------------------- the driver
def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50_s": None, "p99_s": None, "max_s": None}
    ordered = sorted(values)
    return {"p50_s": round(ordered[len(ordered) // 2], 4),
            "p99_s": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 4),
            "max_s": round(ordered[-1], 4)}


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _metrics(url: str) -> dict[str, float]:
    import httpx

    samples = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def _trainers(args, work: Path, phase: str, urls: list[str], specs: list[tuple[int, int]], *, seconds: float,
              hostile: Hostile | None, rss: "RssSampler") -> dict:
    """Run ``specs`` (seed, draft vocabulary) trainers from ``go`` for ``seconds``; the phase's figures."""
    go = work / f"{phase}.go"
    procs = []
    for index, (seed, vocab) in enumerate(specs):
        out = work / f"{phase}_{index}.json"
        command = [sys.executable, __file__, "--trainer", "--seed", str(seed), "--draft-vocab", str(vocab),
                   "--out", str(out), "--reference-file", str(work / f"reference_{seed}_{vocab}.json"),
                   "--go", str(go), "--seconds", str(seconds), *sum((["--url", url] for url in urls), [])]
        procs.append((out, subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(ROOT)})))
    deadline = time.monotonic() + 600
    while not all((out.parent / (out.name + ".ready")).exists() for out, _ in procs):
        if any(proc.poll() is not None for _, proc in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"a trainer of phase {phase} did not start")
        time.sleep(0.2)
    threads = hostile.start() if hostile is not None else []
    rss.mark(phase)
    go.touch()
    for _, proc in procs:
        proc.wait(timeout=seconds + 600)
    if hostile is not None:
        hostile.stop.set()
        for thread in threads:
            thread.join(60)
    results = []
    for (out, proc), (seed, vocab) in zip(procs, specs):
        result = json.loads(out.read_text()) if out.exists() else {"requests": 0, "errors": ["no summary"],
                                                                   "mismatches": 0, "latencies": [], "tokens": 0,
                                                                   "seconds": seconds}
        result.update(seed=seed, draft_vocab=vocab, exit_code=proc.returncode)
        results.append(result)
    return results


def _summarise(results: list[dict]) -> dict:
    latencies = [t for r in results for t in r["latencies"]]
    seconds = max(r["seconds"] for r in results)
    return {"trainers": len(results), "answers": sum(r["requests"] for r in results),
            "mismatches_vs_idle": sum(r["mismatches"] for r in results),
            "http_errors": sum(len(r["errors"]) for r in results),
            "first_errors": [e for r in results for e in r["errors"]][:5],
            "trainer_deaths": sum(r["exit_code"] != 0 for r in results),
            "tokens_per_s": round(sum(r["tokens"] for r in results) / seconds, 1),
            **_percentiles(latencies)}


class RssSampler:
    """Per-rank RSS every ``interval_s`` (MiB), with the phase marks."""

    def __init__(self, pids: list[int], interval_s: float) -> None:
        self.pids, self.interval_s = pids, interval_s
        self.samples: list[dict] = []
        self.marks: dict[str, float] = {}
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def mark(self, phase: str) -> None:
        self.marks[phase] = round(time.monotonic() - self.started, 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append({"t_s": round(time.monotonic() - self.started, 1),
                                 "rss_mib": [round(_rss_mib(pid) or 0, 1) for pid in self.pids]})
            self._stop.wait(self.interval_s)

    def close(self, warm_up_s: float) -> dict:
        self._stop.set()
        self._thread.join(5)
        return {"interval_s": self.interval_s, "phases_at_s": self.marks, "samples": self.samples,
                **rss_growth(self.samples, warm_up_s), "warm_up_s": warm_up_s}


def rss_growth(samples: list[dict], warm_up_s: float) -> dict:
    """Each rank's RSS growth after warm-up, in percent of the first sample after it: to the last sample (the
    service quiet again) and to the largest (the peak under chaos; the goal is judged on this one)."""
    after = [s for s in samples if s["t_s"] >= warm_up_s]
    if len(after) < 2:
        return {"growth_after_warm_up_percent": None, "peak_growth_after_warm_up_percent": None}
    firsts = after[0]["rss_mib"]
    to_last = [round(100 * (last - first) / first, 2) if first else None
               for first, last in zip(firsts, after[-1]["rss_mib"])]
    peaks = [round(100 * (max(s["rss_mib"][rank] for s in after) - first) / first, 2) if first else None
             for rank, first in enumerate(firsts)]
    return {"growth_after_warm_up_percent": to_last, "peak_growth_after_warm_up_percent": peaks}


def soak_layout(args, layout: str, target: Path, work: Path) -> dict:
    from tests.serve_support import ServiceProcess, run_nemo, write_serve_recipe

    distributed = {"ep_size": 2} if layout == "ep2" else {}
    nproc = 2 if layout == "ep2" else 1
    recipe = write_serve_recipe(work / f"{layout}.yaml", target, seq_length=SEQ_LENGTH, **distributed)
    service = ServiceProcess(recipe, nproc=nproc, extra=["--log-interval", "30", *args.serve_args.split()],
                             start_timeout_s=300)
    urls = [f"http://127.0.0.1:{service.port + d}" for d in range(nproc)]
    ports = [service.port + d for d in range(nproc)]
    rss = RssSampler(service.rank_pids(), args.rss_interval)
    report: dict = {"layout": layout, "urls": urls}
    try:
        specs = [(seed, 96) for seed in range(args.trainers)]
        other = [(50, 200)]
        # 1. idle: every trainer's answers, one request at a time, nothing else in flight.
        rss.mark("idle")
        for seed, vocab in specs + other:
            subprocess.run([sys.executable, __file__, "--trainer", "--reference", "--seed", str(seed), "--draft-vocab",
                            str(vocab), "--out", str(work / f"reference_{seed}_{vocab}.json"),
                            *sum((["--url", url] for url in urls), [])], check=True, env={**os.environ,
                                                                                         "PYTHONPATH": str(ROOT)})
        if args.losses:
            report["nemo_losses_alone"] = run_nemo("train_eagle3.py", "--target", str(target), "--data",
                                                   str(ROOT / "tests/fixtures/eagle3/data.jsonl"), "--seq-length",
                                                   str(SEQ_LENGTH), "--ttt-steps", "3",
                                                   *sum((["--remote-url", url] for url in urls), []),
                                                   timeout_s=900)["losses"]
        # 2. calm: the trainers alone.
        calm = _trainers(args, work, f"{layout}_calm", urls, specs, seconds=args.calm_s, hostile=None, rss=rss)
        report["calm"] = _summarise(calm)
        # 3. chaos: the trainers, a trainer with another vocabulary, the hostile clients (and NeMo's recipe).
        hostile = Hostile(ports, work)
        losses: dict = {}
        if args.losses:
            def train() -> None:
                time.sleep(min(30.0, args.chaos_s / 4))
                try:
                    losses["losses"] = run_nemo("train_eagle3.py", "--target", str(target), "--data",
                                                str(ROOT / "tests/fixtures/eagle3/data.jsonl"), "--seq-length",
                                                str(SEQ_LENGTH), "--ttt-steps", "3",
                                                *sum((["--remote-url", url] for url in urls), []),
                                                timeout_s=900)["losses"]
                except Exception as error:  # noqa: BLE001 - reported
                    losses["error"] = str(error)[-500:]
            trainer_thread = threading.Thread(target=train)
            trainer_thread.start()
        chaos = _trainers(args, work, f"{layout}_chaos", urls, specs + other, seconds=args.chaos_s,
                          hostile=hostile, rss=rss)
        if args.losses:
            trainer_thread.join(900)
            report["nemo_losses_under_chaos"] = losses.get("losses", losses)
            report["nemo_losses_equal"] = report["nemo_losses_alone"] == losses.get("losses")
        report["chaos"] = _summarise(chaos[: len(specs)])
        report["chaos_other_vocabulary_trainer"] = _summarise(chaos[len(specs):])
        report["hostile"] = hostile.counts
        calm_p99, chaos_p99 = report["calm"]["p99_s"], report["chaos"]["p99_s"]
        report["p99_chaos_over_calm"] = round(chaos_p99 / calm_p99, 2) if calm_p99 and chaos_p99 else None
        # 4. quiet: nothing admitted is left unanswered.
        time.sleep(3)
        metrics = [_metrics(url) for url in urls]
        report["hung_futures"] = int(sum(m.get("ds_capture_serve_in_flight", 0) for m in metrics))
        report["queue_depth_after"] = int(sum(m.get("ds_capture_serve_queue_depth", 0) for m in metrics))
        report["refusals"] = {key.split('"')[1]: int(sum(m.get(key, 0) for m in metrics))
                              for key in metrics[0] if key.startswith("ds_capture_serve_refusals_total")}
        report["rss"] = rss.close(warm_up_s=rss.marks.get(f"{layout}_calm", 0) + min(60.0, args.calm_s))
        report["service_deaths"] = int(service.proc.poll() is not None)
        code = service.stop(signal.SIGTERM, timeout_s=60)
        report["sigterm_exit"] = code
        report["sigterm_seconds"] = round(service.stop_seconds or -1, 2)
    finally:
        rss._stop.set()
        service.stop(signal.SIGKILL)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="single,ep2")
    parser.add_argument("--calm-s", type=float, default=60.0)
    parser.add_argument("--chaos-s", type=float, default=540.0)
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--rss-interval", type=float, default=5.0)
    parser.add_argument("--losses", action="store_true", help="NeMo's 5-step losses alone and under chaos")
    parser.add_argument("--out", default=None)
    parser.add_argument("--serve-args", default="", help="extra ds-capture serve flags, e.g. '--batch-requests'")
    # The trainer process (internal).
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--draft-vocab", type=int, default=96, help=argparse.SUPPRESS)
    parser.add_argument("--reference-file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--go", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        trainer_main(args)
        return

    from tests.eagle3_support import build_fixture_target, read_spec

    work = Path(tempfile.mkdtemp(prefix="serve_soak-"))
    target = build_fixture_target(read_spec(), "qwen3_moe", work / "qwen3_moe")
    report = {"calm_s": args.calm_s, "chaos_s": args.chaos_s, "trainers": args.trainers, "serve_args": args.serve_args,
              "host_cpus": os.cpu_count(), "layouts": {}}
    for layout in args.layouts.split(","):
        report["layouts"][layout] = soak_layout(args, layout, target, work)
        print(json.dumps({layout: {k: v for k, v in report["layouts"][layout].items() if k != "rss"}}), flush=True)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
