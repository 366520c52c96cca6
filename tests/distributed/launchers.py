"""Start N real gloo ranks on this host through the launchers users use, bounded and cleaned up.

In:  a launcher kind, a rank count, the Python arguments (``["-m", "ds_capture", "run", "-c", cfg]`` or
     ``["path/to/script.py", ...]``), extra environment, a timeout.
Out: a ``subprocess.CompletedProcess`` whose ``stdout`` holds stdout and stderr of every process
     (merged), ``returncode`` 124 on timeout, and ``leftover_shm``: the DeepSpeed shm all-reduce
     buffers the run left in /dev/shm (the job should remove its own; they are deleted here anyway).

Kinds: ``single`` (plain python), ``deepspeed`` (``--num_accelerators N``), ``deepspeed_module``
(same, through ``--module``), ``deepspeed_hostfile`` (``localhost slots=N``), ``deepspeed_two_nodes``
(two ``--no_ssh --node_rank {0,1}`` launchers, hosts ``localhost`` and ``127.0.0.1``), ``torchrun``
and ``mpirun`` (OpenMPI).

Ports: every run gets its own master port (a block of ``num_ports`` consecutive ones where a worker runs several
sessions), so its shm buffer names are its own too. They are *reserved*, not just found free: taken from below
the kernel's ephemeral range (``ip_local_port_range``), which the kernel never hands to a ``bind(0)`` or to the
local end of a ``connect`` (a port found free by ``bind(0)`` is in that range, and any gloo connection or store
client of a concurrent job could take it before the job listens: the EADDRINUSE of issue 21), and held with an
flock in ``PORT_LOCK_DIR`` for the run's life, so concurrent tests and suites (other worktrees too) never pick
the same one. A start that still fails with EADDRINUSE (a foreign listener in the window) is retried on new ports.
The ports are exported to the ranks as ``DS_CAPTURE_TEST_PORTS=<first>:<count>``.

    from tests.distributed.launchers import run_launcher   # or put tests/distributed on sys.path
    result = run_launcher("torchrun", 2, ["-m", "ds_capture", "run", "-c", str(cfg)], None, 120)
    assert result.returncode == 0, result.stdout
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
KINDS = ("single", "deepspeed", "deepspeed_module", "deepspeed_hostfile", "deepspeed_two_nodes", "torchrun", "mpirun")
# Launcher variables a parent (pytest run under a launcher, Slurm allocation) may leak into children.
_LEAKY_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_", "MPI_LOCAL")
_LEAKY_KEYS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "CROSS_RANK", "CROSS_SIZE", "GROUP_RANK"}
SHM_BUFFER_GLOB = "/dev/shm/deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_*"


PORT_LOCK_DIR = Path(tempfile.gettempdir()) / "ds_capture_test_ports"
PORTS_ENV = "DS_CAPTURE_TEST_PORTS"
# What a port taken between reservation and listen looks like (torch's TCPStore, gloo, the OS's own words).
ADDR_IN_USE = ("EADDRINUSE", "Address already in use", "address already in use")
START_ATTEMPTS = 3
# (first port, count) of every reservation made in this process, for tests/distributed/conftest.py's checks.
HANDED_OUT: list[tuple[int, int]] = []


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel's pick, in the ephemeral range: prefer reserve_ports)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reservable_ports() -> range:
    """Ports outside the kernel's ephemeral range: below it when there is room, else above it."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    if low - 1024 >= 2000:
        return range(max(1024, low - 12000), low)
    if 65535 - high >= 2000:
        return range(high + 1, 65536)
    raise RuntimeError(f"ip_local_port_range {low}-{high} leaves no room for reserved test ports")


def _bindable(port: int) -> bool:
    """Nothing listens on or is bound to ``port`` (TIME_WAIT leftovers are fine: the store binds with
    SO_REUSEADDR too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextmanager
def reserve_ports(count: int = 1, *, rng: random.Random | None = None, tries: int = 500) -> Iterator[int]:
    """The first of ``count`` consecutive ports, flock-held in ``PORT_LOCK_DIR`` until the block exits."""
    rng = rng or random.SystemRandom()
    ports = reservable_ports()
    PORT_LOCK_DIR.mkdir(parents=True, exist_ok=True)
    for _ in range(tries):
        first = rng.randrange(ports.start, ports.stop - count + 1)
        held = _lock_block(first, count)
        if held is None:
            continue
        try:
            if all(_bindable(port) for port in range(first, first + count)):
                HANDED_OUT.append((first, count))
                yield first
                return
        finally:
            for fd in held:
                os.close(fd)  # releases its flock
    raise RuntimeError(f"no {count} consecutive free ports in {ports.start}-{ports.stop - 1} after {tries} tries")


def _lock_block(first: int, count: int) -> list[int] | None:
    """The flocked lock files of ports ``first ..`` (open fds), or None if another run holds one of them."""
    held = []
    try:
        for port in range(first, first + count):
            held.append(os.open(PORT_LOCK_DIR / f"{port}.lock", os.O_CREAT | os.O_RDWR, 0o666))
            fcntl.flock(held[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        for fd in held:
            os.close(fd)
        return None
    return held


def start_failed_on_port(result: subprocess.CompletedProcess) -> bool:
    """The run failed because its port was taken (what a retry on another port fixes)."""
    return result.returncode != 0 and any(text in result.stdout for text in ADDR_IN_USE)


def retry_on_addr_in_use(start: Callable[[], subprocess.CompletedProcess],
                         attempts: int | None = None) -> subprocess.CompletedProcess:
    """``start()`` (which reserves its own ports), again while it fails with EADDRINUSE, at most ``attempts``
    (default ``START_ATTEMPTS``) times; the result says how many in ``attempts``."""
    attempts = attempts or START_ATTEMPTS
    for attempt in range(1, attempts + 1):
        result = start()
        result.attempts = attempt
        if not start_failed_on_port(result):
            return result
        print(f"[launchers] port {getattr(result, 'master_port', '?')} was taken before the job listened "
              f"(attempt {attempt} of {attempts})", file=sys.stderr, flush=True)
    return result


def shm_buffers(port: int) -> list[str]:
    """DeepSpeed shm all-reduce buffers of the job whose master is 127.0.0.1:``port``."""
    return sorted(Path("/").glob(SHM_BUFFER_GLOB.format(uid=os.getuid(), port=port).lstrip("/")))


def have_mpirun() -> bool:
    if shutil.which("mpirun") is None:
        return False
    try:
        import mpi4py  # noqa: F401  (DeepSpeed's MPI discovery needs it)
    except ImportError:
        return False
    return True


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment minus launcher variables, one thread per rank, the repo importable."""
    env = {k: v for k, v in os.environ.items() if k not in _LEAKY_KEYS and not k.startswith(_LEAKY_PREFIXES)}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def launcher_commands(kind: str, nproc: int, argv: list[str], port: int, workdir: Path) -> list[list[str]]:
    """The command line(s) for one run; ``deepspeed_two_nodes`` has one per simulated node."""
    python = sys.executable
    deepspeed = [str(Path(python).with_name("deepspeed"))]  # the venv's `deepspeed` console script
    common = ["--master_addr", "127.0.0.1", "--master_port", str(port)]
    script = ["--module", *argv[1:]] if argv[:1] == ["-m"] else argv
    if kind == "single":
        return [[python, *argv]]
    if kind in ("deepspeed", "deepspeed_module"):
        return [[*deepspeed, "--num_accelerators", str(nproc), "--no_ssh_check", *common, *script]]
    if kind == "deepspeed_hostfile":
        hostfile = workdir / "hostfile"
        hostfile.write_text(f"localhost slots={nproc}\n")
        return [[*deepspeed, "--hostfile", str(hostfile), "--no_ssh_check", *common, *script]]
    if kind == "deepspeed_two_nodes":
        if nproc % 2:
            raise ValueError(f"deepspeed_two_nodes needs an even nproc, got {nproc}")
        hostfile = workdir / "hostfile"
        hostfile.write_text(f"localhost slots={nproc // 2}\n127.0.0.1 slots={nproc // 2}\n")
        return [[*deepspeed, "--hostfile", str(hostfile), "--no_ssh", "--num_nodes", "2", "--node_rank",
                 str(node), *common, *script] for node in (0, 1)]
    if kind == "torchrun":
        return [[python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
                 "127.0.0.1", "--master_port", str(port), *argv]]
    if kind == "torchrun_script":  # launch/torchrun.sh: argv is `-m ds_capture run ... -c CFG ...`
        config = argv[argv.index("-c") + 1]
        rest = [arg for arg in argv[argv.index("run") + 1:] if arg not in ("-c", config)]
        return [["env", f"PATH={Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}", f"NPROC={nproc}",
                 f"RDZV_ENDPOINT=127.0.0.1:{port}", f"CONFIG={config}", "bash", str(REPO_ROOT / "launch" / "torchrun.sh"),
                 *rest]]
    if kind == "mpirun":
        return [["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(nproc),
                 "-x", f"MASTER_PORT={port}", python, *argv]]
    raise ValueError(f"unknown launcher kind {kind!r}; one of {', '.join(KINDS)}")


def run_launcher(kind: str, nproc: int, argv: list[str], env: Mapping[str, str] | None = None,
                 timeout_s: int = 120, cwd: str | os.PathLike | None = None, *,
                 num_ports: int = 1) -> subprocess.CompletedProcess:
    """Run ``argv`` on ``nproc`` ranks through ``kind`` on reserved ports (``num_ports`` consecutive ones from
    the master port), retried on new ports after EADDRINUSE; each attempt never outlives ``timeout_s``; cleans
    /dev/shm. A retried command must be idempotent (a capture is: it resumes)."""
    def start() -> subprocess.CompletedProcess:
        with reserve_ports(num_ports) as port:
            return _run_once(kind, nproc, argv, {**(env or {}), PORTS_ENV: f"{port}:{num_ports}"}, timeout_s, cwd,
                             port, num_ports)

    return retry_on_addr_in_use(start)



def run_cli(nproc: int, recipe: Path, env: Mapping[str, str] | None = None,
            timeout_s: int = 170) -> subprocess.CompletedProcess:
    """``ds-capture run -c recipe --no-progress`` as one process (``nproc`` 1) or on ``nproc`` torchrun ranks."""
    return run_launcher("single" if nproc == 1 else "torchrun", nproc,
                        ["-m", "ds_capture", "run", "-c", str(recipe), "--no-progress"], env, timeout_s)

def _run_once(kind: str, nproc: int, argv: list[str], env: Mapping[str, str], timeout_s: int,
              cwd: str | os.PathLike | None, port: int, num_ports: int) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="ds_capture_launch_") as tmp:
        commands = launcher_commands(kind, nproc, argv, port, Path(tmp))
        log_paths = [Path(tmp) / f"out{i}.log" for i in range(len(commands))]
        procs = []
        try:
            for command, log_path in zip(commands, log_paths):
                with open(log_path, "wb") as log:
                    # Own session: a timeout kills the launcher and every rank it forked (mpirun
                    # ranks live in their own process groups, but mpirun kills them when it dies).
                    procs.append(subprocess.Popen(command, cwd=cwd or REPO_ROOT, env=child_env(env), stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
            returncode = _wait_all(procs, time.monotonic() + timeout_s)
        finally:
            for proc in procs:
                _kill_session(proc)
        stdout = "".join(p.read_text(errors="replace") for p in log_paths)
    leftover = [str(p) for offset in range(num_ports) for p in shm_buffers(port + offset)]
    for path in leftover:
        Path(path).unlink(missing_ok=True)
    result = subprocess.CompletedProcess(commands[0] if len(commands) == 1 else commands, returncode, stdout, "")
    result.leftover_shm = leftover
    result.master_port = port
    return result


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> int:
    """0 when all succeed; the first non-zero exit code as soon as one fails; 124 at the deadline."""
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]  # its peers would only wait for it: the caller kills them
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)
    return 124


def _kill_session(proc: subprocess.Popen) -> None:
    """Stop a launcher that overran or whose peer failed: SIGTERM, then SIGKILL, to its process group and to
    every process below it (torchrun starts each rank in a session of its own, out of the group's reach)."""
    if proc.poll() is not None:
        return
    pids = descendants(proc.pid)  # before any signal: a dead launcher's ranks are reparented out of view
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        send_signal(pids, sig, group=proc.pid)
        try:
            proc.wait(timeout=grace)
            if not any(_alive(pid) for pid in pids):
                return
        except subprocess.TimeoutExpired:
            continue


def send_signal(pids: list[int], sig: int, group: int | None = None) -> None:
    """``sig`` to each of ``pids``, then to process group ``group``; processes already gone are skipped."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    if group is not None:
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) no longer runs
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children before grandchildren."""
    found, stack = [], [pid]
    while stack:
        parent = stack.pop()
        kids = []
        try:
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as handle:
                    kids += [int(kid) for kid in handle.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
        found += kids
        stack += kids
    return found


def ensure_shm_op_built(timeout_s: int = 900) -> None:
    """JIT-build DeepSpeed's CPU shm comm op once, outside any rank's timeout (about 3 min on 2 cores).

    Every rank of a gloo job loads it in ``deepspeed.init_distributed``; a first build inside a
    bounded test would time out, and a build killed half-way leaves torch's ``lock`` file behind,
    after which every later build waits forever.
    """
    code = ("from deepspeed.accelerator import get_accelerator; "
            "b = get_accelerator().create_op_builder('ShareMemCommBuilder'); b is None or b.load()")
    subprocess.run([sys.executable, "-c", code], env=child_env(), timeout=timeout_s, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
