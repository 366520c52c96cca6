"""Kill a capture at reproducible points and compare what a rerun leaves behind.

Two ways to kill, mixed by the crash tests and ``benchmarks/soak.py``:

- **From inside** (deterministic): ``python tests/distributed/_kill_helpers.py run -c cfg.yaml`` is
  ``ds-capture`` with a kill switch read from ``DS_CAPTURE_TEST_KILL=<point>:<k>:<ranks>``; the process
  SIGKILLs itself at the k-th (1-based) event of ``point`` on the listed ranks (``all`` or ``0,1``):

  ``forward``   inside the forward pass (pre-hook of the second decoder layer), peers mid-collective;
  ``save``      mid-shard-write: the shard's ``.tmp`` is half written (truncated), never renamed;
  ``sidecar``   a shard renamed into place but its checksum sidecar not yet written;
  ``flip``      after every shard, before ``manifest.json`` is flipped to ``complete: true``;
  ``after_flip`` right after the flip, before the process exits.

  A fourth field ``raise`` raises instead of dying; ``stop`` SIGSTOPs the rank there (a frozen rank: the liveness
  tests wake it with SIGCONT or end it with SIGKILL). With ``DS_CAPTURE_TEST_NO_SHM=1`` the script also skips DeepSpeed's shm op (see :func:`disable_shm_op`).

  :func:`install_kill` applies the same switch in-process (the single-process tests fork and call it).
- **From outside** (seeded): :func:`launch` starts a launcher in its own session and
  :func:`kill_when` SIGKILLs the launcher and every process below it once a condition on the output directory holds
  (e.g. "n shard files exist"), the moment chosen by the test's seed.

In: launcher kind, rank count, argv, a condition. Out: digests of the cache files, the set of finished
shards (final name + matching sidecar), the inode of each shard (a rerun must not rewrite finished ones).
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

KILL_ENV = "DS_CAPTURE_TEST_KILL"
POINTS = ("forward", "save", "sidecar", "flip", "after_flip")
SHARD_RE = re.compile(r"^shard-(\d{6})\.safetensors$")


# ---------------------------------------------------------------------------------------------- inside kills


def _this_rank() -> int:
    for key in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class InjectedFailure(RuntimeError):
    """What ``<point>:<k>:<ranks>:raise`` raises instead of SIGKILL (a rank failing with an exception)."""


def install_kill(spec: str) -> None:
    """Patch ds_capture so this process SIGKILLs itself at ``<point>:<k>:<ranks>`` (see module docstring);
    with a fourth field ``raise`` it raises :class:`InjectedFailure` there instead, with ``stop`` it SIGSTOPs."""
    point, k, ranks, *action = spec.split(":")
    k = int(k)
    fail = _die
    if action == ["raise"]:
        def fail() -> None:
            raise InjectedFailure(f"injected failure at {point} #{k} on rank {_this_rank()}")
    elif action == ["stop"]:
        def fail() -> None:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops; SIGCONT resumes right here
    if point not in POINTS:
        raise ValueError(f"unknown kill point {point!r}; one of {', '.join(POINTS)}")
    if ranks != "all" and _this_rank() not in {int(r) for r in ranks.split(",")}:
        return
    import ds_capture.cache.common.files as writer  # the sidecars are written through its write_atomic
    import ds_capture.runner as runner

    count = [0]

    def hit() -> bool:
        count[0] += 1
        return count[0] == k

    if point == "forward":
        build_model = runner.build_model

        def build_and_arm(*args, **kwargs):
            model = build_model(*args, **kwargs)
            layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
            layers[min(1, len(layers) - 1)].register_forward_pre_hook(lambda *_: fail() if hit() else None)
            return model

        runner.build_model = build_and_arm
    elif point == "save":
        from ds_capture.cache.common.shard_file import ShardFile

        finish = ShardFile.finish

        def finish_or_die_half_written(self):
            # Every row is in the .tmp; cut it in half and die before the rename.
            if self.path.name.startswith("shard-") and hit():
                os.truncate(self.tmp, os.path.getsize(self.tmp) // 2)
                fail()
            return finish(self)

        ShardFile.finish = finish_or_die_half_written
    elif point == "sidecar":
        write_atomic = writer.write_atomic

        def atomic_or_die(path, write):
            if Path(path).parent.name == "checksums" and hit():
                fail()
            write_atomic(path, write)

        writer.write_atomic = atomic_or_die
    else:
        import ds_capture.cache.dspark.kind as dspark  # the DSpark kind writes both manifests (complete false, then true)

        write_manifest = dspark.write_manifest

        def manifest_or_die(out_dir, manifest):
            if manifest.complete and point == "flip":
                fail()
            write_manifest(out_dir, manifest)
            if manifest.complete and point == "after_flip":
                fail()

        dspark.write_manifest = manifest_or_die


# ---------------------------------------------------------------------------------------------- outside kills


def launch(kind: str, nproc: int, argv: list[str], env: Mapping[str, str] | None, log_path: Path
           ) -> tuple[subprocess.Popen, int]:
    """Start ``argv`` on ``nproc`` ranks through launcher ``kind`` in a new session; (process, master port)."""
    from tests.distributed.launchers import PORTS_ENV, REPO_ROOT, child_env, launcher_commands, reserve_ports

    reservation = reserve_ports()
    port = reservation.__enter__()  # held until wait_and_reap: no other test can take the port meanwhile
    _RESERVED[port] = reservation
    env = {**(env or {}), PORTS_ENV: f"{port}:1"}
    workdir = Path(tempfile.mkdtemp(prefix="ds_capture_kill_"))
    (command,) = launcher_commands(kind, nproc, argv, port, workdir)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=child_env(env), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, port


_RESERVED: dict = {}  # port -> its reservation, for launch() / wait_and_reap()


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process below it, all at the same moment.

    Not just its process group: torchrun starts each rank in a session of its own, so a killpg of the
    launcher's group would leave the ranks running on. Everything is stopped first, then killed, so no
    rank sees a peer die and reacts before it dies itself.
    """
    from tests.distributed.launchers import descendants, send_signal

    pids = [proc.pid] + descendants(proc.pid)
    send_signal(pids, signal.SIGSTOP)
    send_signal(pids, signal.SIGKILL, group=proc.pid)
    proc.wait(timeout=30)


def kill_when(proc: subprocess.Popen, condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.005) -> bool:
    """SIGKILL ``proc``'s whole process group as soon as ``condition()`` holds; True if it was killed
    (False: the job ended first). Never outlives ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            kill_group(proc)
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll_s)
    kill_group(proc)
    raise TimeoutError(f"kill condition not reached within {timeout_s} s")


def wait_and_reap(proc: subprocess.Popen, port: int, timeout_s: float) -> int:
    """Wait for the launcher (killing its session at the deadline: 124), then remove its /dev/shm buffers."""
    from tests.distributed.launchers import shm_buffers

    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = 124
    kill_group(proc)  # ranks a launcher left behind die with their session
    for path in shm_buffers(port):
        Path(path).unlink(missing_ok=True)
    if port in _RESERVED:
        _RESERVED.pop(port).__exit__(None, None, None)
    return code


# ---------------------------------------------------------------------------------------------- forked ranks


def disable_shm_op() -> None:
    """Keep forked ranks away from DeepSpeed's JIT-built shm all-reduce op (call before forking).

    Loading it takes torch's build lock under ~/.cache/torch_extensions, shared by every venv on the
    box; venvs with other flags rebuild it in turn, and a process killed while it holds the lock leaves
    it behind, after which every load waits forever. These ranks are dp-only (the op is switched off for
    TP sub-groups anyway), so they never use it: DeepSpeed falls back to torch.distributed.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False



def run_forked_ranks(world_size: int, cfg_path: Path | None, *, kill: str | None = None, log_path: Path,
                     timeout_s: float = 90, kill_when_cond: Callable[[], bool] | None = None,
                     cli_argv: list[str] | None = None, script_argv: list[str] | None = None,
                     watch: Callable[[list[int], dict[int, int]], None] | None = None,
                     own_logging: bool = False) -> dict:
    """Run ``world_size`` real gloo ranks as forks of this process (imports already paid), each with the
    environment a launcher gives (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, MASTER_ADDR/PORT).

    Each rank runs ``run_capture`` on ``cfg_path`` (or ``ds_capture.cli.main(cli_argv)``, or the script
    ``script_argv[0]`` as ``__main__`` with ``sys.argv = script_argv``, as a launcher would run it; ``cfg_path``
    is then None) after ``install_kill(kill)``; its stdout/stderr go to ``log_path``. ``kill_when_cond``: SIGKILL
    every rank once it holds. ``watch(pids, statuses)`` is called every poll (rank -> pid, pid -> wait status of
    the ranks that ended so far). ``own_logging``: each rank drops the logging handlers it inherited from pytest, so
    the CLI's own (``[ds_capture] INFO ...`` on stderr) writes into ``log_path`` as under a launcher. Returns ``{"signals": [...], "codes": [...], "seconds": ..., "summary": {...} |
    None, "leftover_shm": [...]}`` where a rank's signal is its terminating signal (0 if it exited), ``summary``
    is rank 0's ``RunSummary`` fields and ``leftover_shm`` the DeepSpeed shm buffers no rank removed (deleted).
    """
    from tests.distributed.launchers import reserve_ports

    # The port stays reserved until every rank is reaped (forked ranks also inherit the reservation's flock).
    with reserve_ports() as port:
        return _run_forked_ranks(port, world_size, cfg_path, kill=kill, log_path=log_path, timeout_s=timeout_s,
                                 kill_when_cond=kill_when_cond, cli_argv=cli_argv, script_argv=script_argv,
                                 watch=watch, own_logging=own_logging)


def _run_forked_ranks(port: int, world_size: int, cfg_path: Path | None, *, kill: str | None, log_path: Path,
                      timeout_s: float, kill_when_cond: Callable[[], bool] | None, cli_argv: list[str] | None,
                      script_argv: list[str] | None,
                      watch: Callable[[list[int], dict[int, int]], None] | None, own_logging: bool = False) -> dict:
    import json

    from tests.distributed.launchers import shm_buffers

    summary_path = Path(log_path).with_suffix(".summary.json")
    summary_path.unlink(missing_ok=True)
    pids = []
    started = time.monotonic()
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:  # the child never returns into the caller (pytest)
            code = 1
            try:
                log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(log_fd, 1)
                os.dup2(log_fd, 2)
                # pytest's sys.stdout/stderr are its own capture objects, not fds 1 and 2: rebind them.
                sys.stdout = open(1, "w", buffering=1, closefd=False)
                sys.stderr = open(2, "w", buffering=1, closefd=False)
                import faulthandler

                # A rank that hangs says where before the parent kills it.
                faulthandler.dump_traceback_later(max(1.0, timeout_s - 5), exit=False)
                if world_size > 1:  # one rank: a plain process, as the ``single`` launcher runs it
                    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                                      LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                if kill:
                    install_kill(kill)
                if own_logging:
                    import logging

                    logging.getLogger().handlers.clear()
                if script_argv is not None:
                    import runpy

                    sys.argv = list(script_argv)
                    try:
                        runpy.run_path(script_argv[0], run_name="__main__")
                        code = 0
                    except SystemExit as exit_:
                        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
                elif cli_argv is not None:
                    from ds_capture.cli import main

                    code = main(cli_argv)
                else:
                    from dataclasses import asdict

                    from ds_capture.recipe.config import load_config
                    from ds_capture.runner import run_capture

                    summary = run_capture(load_config(cfg_path), show_progress=False)
                    if rank == 0:
                        summary_path.write_text(json.dumps(asdict(summary)))
                    code = 0
            except BaseException as error:  # noqa: BLE001 - report, then leave with a failure code
                print(f"rank {rank}: {type(error).__name__}: {error}", flush=True)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    status: dict[int, int] = {}
    deadline = started + timeout_s
    killed_by_parent = False
    while len(status) < world_size and time.monotonic() < deadline:
        if watch is not None:
            watch(pids, status)
        if kill_when_cond is not None and not killed_by_parent and kill_when_cond():
            for pid in pids:
                if pid not in status:
                    os.kill(pid, signal.SIGKILL)
            killed_by_parent = True
        for pid in pids:
            if pid not in status:
                done, value = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[pid] = value
        time.sleep(0.005)
    seconds = time.monotonic() - started
    for pid in pids:
        if pid not in status:  # a hung rank: the test fails on its signal 9 and timeout
            os.kill(pid, signal.SIGKILL)
            status[pid] = os.waitpid(pid, 0)[1]
    leftover_shm = list(shm_buffers(port))
    for path in leftover_shm:
        Path(path).unlink(missing_ok=True)
    values = [status[pid] for pid in pids]
    return {
        "signals": [os.WTERMSIG(v) if os.WIFSIGNALED(v) else 0 for v in values],
        "codes": [os.WEXITSTATUS(v) if os.WIFEXITED(v) else None for v in values],
        "seconds": seconds,
        "timed_out": seconds >= timeout_s,
        "killed_by_parent": killed_by_parent,
        "summary": json.loads(summary_path.read_text()) if summary_path.is_file() else None,
        "leftover_shm": leftover_shm,
    }


def run_cli_forked(nproc: int, recipe: Path, *, timeout_s: float = 170) -> subprocess.CompletedProcess:
    """``ds-capture run -c recipe --no-progress`` on ``nproc`` forked gloo ranks (one: a plain process), as
    :func:`tests.distributed.launchers.run_cli` runs it under torchrun, without paying the interpreter, torch,
    transformers and DeepSpeed imports per rank and per run (seconds each on 2 cores). The result looks like
    run_cli's: ``returncode`` (0, else the first failed rank's code), ``stdout`` (every rank's output) and
    ``leftover_shm`` (DeepSpeed's all-reduce buffers no rank removed)."""
    import ds_capture.cli  # noqa: F401  (imported here once, so each forked rank starts at once)

    return _forked_result(nproc, timeout_s, cli_argv=["run", "-c", str(recipe), "--no-progress"])


def _forked_result(nproc: int, timeout_s: float, **what) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="ds_capture_forked_") as tmp:
        log = Path(tmp) / "ranks.log"
        result = run_forked_ranks(nproc, None, log_path=log, timeout_s=timeout_s, **what)
        stdout = log.read_text(errors="replace") if log.is_file() else ""
    failed = [code if code is not None else 128 + sig for code, sig in zip(result["codes"], result["signals"])
              if code != 0]
    returncode = 124 if result["timed_out"] else (failed[0] if failed else 0)
    completed = subprocess.CompletedProcess(["forked", str(nproc)], returncode, stdout, "")
    completed.leftover_shm = result["leftover_shm"]
    return completed


def run_script_forked(nproc: int, script_argv: list[str], *, timeout_s: float = 170) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node nproc SCRIPT ARGS...`` as forked gloo ranks (see :func:`run_cli_forked`)."""
    return _forked_result(nproc, timeout_s, script_argv=[str(arg) for arg in script_argv])


# ---------------------------------------------------------------------------------------------- what is on disk


def cache_digests(out_dir: Path) -> dict[str, str]:
    """sha256 of every cache file (manifest, target weights, shards); bookkeeping under .ds_capture/ excluded."""
    out_dir = Path(out_dir)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out_dir.iterdir())
            if p.is_file() and (p.name in ("manifest.json", "target_weights.safetensors") or SHARD_RE.match(p.name))}


def shard_files(out_dir: Path) -> list[str]:
    return sorted(p.name for p in Path(out_dir).glob("shard-*.safetensors"))


def finished_shards(out_dir: Path) -> set[int]:
    """Shards under their final name whose bytes match the sidecar (what a rerun must keep)."""
    from ds_capture.cache.common.shard_file import file_digest

    out_dir = Path(out_dir)
    done = set()
    for name in shard_files(out_dir):
        index = int(SHARD_RE.match(name).group(1))
        sidecar = out_dir / ".ds_capture" / "checksums" / name.replace(".safetensors", ".checksum")
        if sidecar.is_file() and sidecar.read_text().split()[0] == file_digest(out_dir / name):
            done.add(index)
    return done


def shard_inodes(out_dir: Path) -> dict[str, int]:
    """Each shard's inode: ``os.replace`` gives a rewritten shard a new one."""
    return {name: (Path(out_dir) / name).stat().st_ino for name in shard_files(out_dir)}


def manifest_complete(out_dir: Path) -> bool | None:
    import json

    try:
        return json.loads((Path(out_dir) / "manifest.json").read_text())["complete"]
    except (FileNotFoundError, ValueError, KeyError):
        return None


SUMMARY_RE = re.compile(r"(\d+) shards written, (\d+) already done")


def summary_counts(text: str) -> tuple[int, int] | None:
    """(written, already done) from the ``ds-capture run`` summary line; (0, all) for 'nothing to do'."""
    found = SUMMARY_RE.findall(text)
    if found:
        return int(found[-1][0]), int(found[-1][1])
    return None


NO_SHM_ENV = "DS_CAPTURE_TEST_NO_SHM"

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    if os.environ.get(NO_SHM_ENV) == "1":
        disable_shm_op()
    if os.environ.get(KILL_ENV):
        install_kill(os.environ[KILL_ENV])
    from ds_capture.cli import main

    sys.exit(main(sys.argv[1:]))
