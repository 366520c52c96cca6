"""A real OpenAI-compatible server for the regenerate tests and benchmark: ``transformers serve`` (transformers'
own server, its ``[serving]`` extra) serving a local checkpoint on CPU, offline, on a reserved port.

    with TransformersServe(checkpoint, log_dir) as server:   # started and healthy; stopped on every path
        server.url                                           # http://127.0.0.1:PORT/v1
        server.stop(); server.start()                        # a restart listens on a new port

The checkpoint's path is the model name requests give (the server is pinned to it: any other name is a 400).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.distributed.launchers import ADDR_IN_USE, START_ATTEMPTS, reserve_ports

READY_TIMEOUT_S = 180.0  # a cold import of transformers' serving stack on a loaded 2-core box
STOP_TIMEOUT_S = 20.0


class TransformersServe:
    def __init__(self, checkpoint: Path, log_dir: Path, *, threads: int = 1, extra_args: tuple[str, ...] = ()) -> None:
        self.model = str(checkpoint)
        self.extra_args = extra_args  # e.g. ("--continuous-batching",)
        self.log_dir = log_dir
        self.threads = threads
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        for _ in range(START_ATTEMPTS):
            with reserve_ports(1) as port:  # held until the server listens on it
                self.port = port
                if self._launch():
                    return
        raise RuntimeError(f"transformers serve found its port taken {START_ATTEMPTS} times; see {self._log}")

    def _launch(self) -> bool:
        """True once the server answers /health; False when its port was taken; raises on any other failure."""
        self.starts += 1
        self._log = self.log_dir / f"transformers_serve_{self.starts}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(self.threads), "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "transformers.cli.transformers", "serve", "--host", "127.0.0.1", "--port",
                   str(self.port), "--device", "cpu", "--log-level", "warning", *self.extra_args, self.model]
        with open(self._log, "wb") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                text = self._log.read_text(errors="replace")
                self.process = None
                if any(words in text for words in ADDR_IN_USE):
                    return False
                raise RuntimeError(f"transformers serve exited before it was ready:\n{text[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2.0).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"transformers serve did not answer /health within {READY_TIMEOUT_S:.0f} s; see {self._log}")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after STOP_TIMEOUT_S; waits until it is gone."""
        process, self.process = self.process, None
        if process is None:
            return
        for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, STOP_TIMEOUT_S)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                pass
            try:
                process.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def __enter__(self) -> "TransformersServe":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
