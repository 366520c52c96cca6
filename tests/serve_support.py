"""A ``ds-capture serve`` running in the background for a test module, and NeMo's side of the checks.

``ServiceProcess`` starts the service through a real launcher (one process, or ``torchrun`` ranks) on reserved
ports (tests/distributed/launchers.py: the HTTP port and the master port, flock-held for its life), waits (bounded)
for ``GET /health`` to answer 200 (or later, ``wait=False``: a test can run NeMo meanwhile), and on ``stop()``
sends a signal to every rank and records the exit code and the seconds every rank took to leave; anything left is
killed. ``run_nemo(tool, *args)`` runs one of tools/nemo_oracle/ in a process of its own (NeMo's import is slow and
rewrites transformers' auto mappings) and returns its last stdout line as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from tests.distributed.launchers import (
    REPO_ROOT,
    _kill_session,
    child_env,
    descendants,
    launcher_commands,
    reserve_ports,
    shm_buffers,
)

DATA = REPO_ROOT / "tests" / "fixtures" / "eagle3" / "data.jsonl"
ORACLE = REPO_ROOT / "tools" / "nemo_oracle"


def write_serve_recipe(path: Path, target: Path, *, seq_length: int = 48, **distributed) -> Path:
    import yaml

    recipe = {"cache_kind": "eagle3", "engine": "deepspeed",
              "recipe_args": {"target_model_name_or_path": str(target), "train_data_path": str(DATA),
                              "cache_output_dir": str(path.parent / "unused"), "seq_length": seq_length},
              "capture": {"compute_dtype": "fp32"},
              "dist_env": {"timeout_minutes": 2, "heartbeat_timeout_seconds": 6}}
    if distributed:
        recipe["distributed"] = distributed
    path.write_text(yaml.safe_dump(recipe))
    return path


class ServiceProcess:
    """``ds-capture serve -c recipe`` on ``nproc`` ranks (``single`` or ``torchrun``), until :meth:`stop`."""

    def __init__(self, recipe: Path, *, nproc: int = 1, extra: list[str] = (), start_timeout_s: float = 120,
                 wait: bool = True) -> None:
        self._stack = ExitStack()
        # One HTTP port per data-parallel replica (port + dp_rank): as many as ranks covers every layout.
        self.port = self._stack.enter_context(reserve_ports(nproc))
        self.master_port = self._stack.enter_context(reserve_ports(1))
        self.url = f"http://127.0.0.1:{self.port}"
        self._tmp = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="ds_capture_serve_")))
        self.log_path = self._tmp / "serve.log"
        kind = "single" if nproc == 1 else "torchrun"
        argv = ["-m", "ds_capture", "serve", "-c", str(recipe), "--port", str(self.port), *extra]
        (command,) = launcher_commands(kind, nproc, argv, self.master_port, self._tmp)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, cwd=REPO_ROOT, env=child_env(), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self._final_log: str | None = None
        self.returncode: int | None = None
        self.stop_seconds: float | None = None
        self.leftover_shm: list[str] = []
        if wait:
            self.wait_healthy(start_timeout_s)

    def wait_healthy(self, timeout_s: float = 120) -> "ServiceProcess":
        """Until ``GET /health`` answers 200 (the service is stopped, and an AssertionError raised, otherwise)."""
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop(signal.SIGKILL)
            raise
        return self

    def log(self) -> str:
        if self._final_log is not None:
            return self._final_log
        return self.log_path.read_text(errors="replace")

    def health(self) -> int | None:
        """The status of ``GET /health`` (None: nothing answers)."""
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code
        except httpx.HTTPError:
            return None

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the service exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if self.health() == 200:
                return
            time.sleep(0.2)
        raise AssertionError(f"the service did not answer /health 200 within {timeout_s} s:\n{self.log()[-4000:]}")

    def rank_pids(self) -> list[int]:
        """The processes running ``ds_capture serve`` (the ranks; the launcher itself under torchrun is not one)."""
        pids = [self.proc.pid, *descendants(self.proc.pid)]
        found = []
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"ds_capture" in cmdline and b"torch.distributed.run" not in cmdline:
                found.append(pid)
        return found

    def wait(self, timeout_s: float) -> int | None:
        """The launcher's exit code once it (and so every rank) ended, None at the deadline."""
        started = time.monotonic()
        try:
            self.returncode = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        self.stop_seconds = time.monotonic() - started
        return self.returncode

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int | None:
        """``sig`` to every rank, as Slurm or a user's Ctrl-C delivers it (torchrun then exits with its ranks'
        code); the exit code, None if it hung past ``timeout_s``."""
        try:
            if self.proc.poll() is None:
                for pid in self.rank_pids():
                    os.kill(pid, sig)
                self.wait(timeout_s)
            else:
                self.returncode = self.proc.returncode
        finally:
            _kill_session(self.proc)
            if self._final_log is None:
                self._final_log = self.log_path.read_text(errors="replace")  # the temp dir goes below
            self.leftover_shm = shm_buffers(self.master_port)
            for path in self.leftover_shm:
                Path(path).unlink(missing_ok=True)
            self._stack.close()
        return self.returncode


def run_nemo(tool: str, *args: str, timeout_s: int = 240) -> dict:
    """tools/nemo_oracle/<tool> in a process of its own; its last stdout line as JSON."""
    result = subprocess.run([sys.executable, str(ORACLE / tool), *args], capture_output=True, text=True,
                            timeout=timeout_s, env={**child_env(), "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def post(url: str, endpoint: str, body: bytes = b"", timeout_s: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/{endpoint}", content=body, timeout=timeout_s)


def identity_mapping(vocab_size: int) -> bytes:
    from ds_capture.serve.wire import encode
    import torch

    return encode({"selected_token_ids": torch.arange(vocab_size),
                   "selected_token_mask": torch.ones(vocab_size, dtype=torch.bool)})


def generate_body(rows: int, length: int, seed: int, vocab: int = 300) -> bytes:
    """A NeMo generate body (random ids, left padding on odd seeds)."""
    import torch

    from ds_capture.serve.wire import encode

    ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(rows, length, dtype=torch.long)
    if seed % 2:
        mask[:, : length // 4] = 0
    return encode({"input_ids": ids, "attention_mask": mask, "loss_mask": mask.clone()})


def answers_in_flight(urls: list[str], bodies: list[bytes], noise: list[bytes], *, mapping: bytes,
                      rounds: int = 2) -> tuple[list[bytes], list[list[bytes]]]:
    """Each of ``bodies`` answered by an idle service (one at a time, per URL), then ``rounds`` times again, all at
    once on every URL while ``noise`` requests (other shapes) are in flight too: (idle answers, in-flight answers
    per round), indexed by ``url x body``."""
    from concurrent.futures import ThreadPoolExecutor

    clients = [httpx.Client(base_url=url, timeout=120) for url in urls]
    try:
        for client in clients:
            assert client.post("/set_vocab_mapping", content=mapping).status_code == 200
        idle = [client.post("/generate", content=body).content for client in clients for body in bodies]

        def ask(url: str, body: bytes) -> bytes:
            with httpx.Client(base_url=url, timeout=120) as client:  # a connection of its own (same host)
                response = client.post("/generate", content=body)
                assert response.status_code == 200, response.text
                return response.content

        busy = []
        with ThreadPoolExecutor(len(urls) * (len(bodies) + len(noise))) as pool:
            for _ in range(rounds):
                futures = [pool.submit(ask, url, body) for url in urls for body in bodies]
                others = [pool.submit(ask, url, body) for url in urls for body in noise]
                busy.append([future.result() for future in futures])
                for future in others:
                    future.result()
        return idle, busy
    finally:
        for client in clients:
            client.close()
