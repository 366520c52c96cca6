"""A real one-host Slurm cluster for the tests: munged, slurmctld and slurmd on localhost, under a temp dir.

In:  a directory to keep everything in (config, munge key and socket, state, spool, logs), run as root
     with Debian's ``slurm-wlm`` and ``munge`` installed (``.ci/run`` installs them).
Out: a started :class:`SlurmCluster` whose :attr:`env` points Slurm's client commands (``sbatch``,
     ``srun``, ``scancel``, ``scontrol``) at it; :meth:`stop` ends every job and every daemon it started.
     :func:`why_slurm_cannot_start` says why not, for a skip reason, where it cannot run.

Nothing outside the directory is touched: munged gets its own key, socket, pid and seed files, the
daemons listen on free ports and ``slurm.conf`` lives in the directory (``SLURM_CONF``). No cgroups
(``proctrack/linuxproc``, ``task/none``), no accounting database; one node with 2 CPUs whose configured
memory is taken as is (``SlurmdParameters=config_overrides``, a container reports the host's).

    cluster = SlurmCluster(tmp_dir)
    cluster.start()
    job = cluster.sbatch(["--ntasks=2", "launch/slurm.sbatch"], env)
    state = cluster.wait_job(job, timeout_s=300)
    cluster.stop()
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scancel", "scontrol", "sinfo", "squeue")
# The node is this host under its own name: ds_capture takes rank 0's address from SLURM_JOB_NODELIST, so the
# node name must resolve (as cluster node names do).
NODE_NAME = socket.gethostname().split(".")[0]
NODE_CPUS = 2
NODE_MEMORY_MB = 4096
# Job states after which a job will not run again by itself (scontrol's JobState=...).
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}


def why_slurm_cannot_start() -> str | None:
    """None when this host can run the cluster; else the reason (a skip message)."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None]
    if missing:
        return (f"Slurm/munge binaries missing: {', '.join(missing)} (Debian: apt-get install slurm-wlm munge; "
                ".ci/run does)")
    try:
        socket.gethostbyname(NODE_NAME)
    except OSError:
        return f"this host's name {NODE_NAME!r} does not resolve (the Slurm node and rank 0's address use it)"
    if os.geteuid() != 0:
        return "the one-host Slurm cluster runs its daemons as root (SlurmUser=root); not root here"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SlurmCluster:
    """munged + slurmctld + slurmd in the foreground as children of this process, all state under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._procs: dict[str, subprocess.Popen] = {}
        self.env = {"SLURM_CONF": str(self.conf)}
        """What a client command needs on top of the caller's environment."""

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 60) -> None:
        """Write the config, start the three daemons and wait until the node is idle; raises RuntimeError
        (with the daemons' logs) if it is not within ``timeout_s``; nothing is left running then."""
        try:
            self._write_files()
            self._spawn("munged", ["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                                   f"--key-file={self.root / 'munge' / 'munge.key'}",
                                   f"--log-file={self.root / 'log' / 'munged.log'}",
                                   f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                                   f"--seed-file={self.root / 'munge' / 'munged.seed'}"])
            self._wait_for(lambda: self.munge_socket.exists(), 10, "munged's socket")
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            self._spawn("slurmd", ["slurmd", "-D", "-N", NODE_NAME, "-f", str(self.conf)])
            self._wait_for(lambda: self.node_state() == "idle", timeout_s, f"node {NODE_NAME} idle")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel every job (its processes die with it), then end the daemons: SIGTERM, then SIGKILL."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            self.client(["scancel", "--full", "--user=root"], check=False, timeout=20)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.client(["squeue", "-h"], check=False, timeout=20).stdout.strip():
                time.sleep(0.5)
        for name in reversed(DAEMONS):
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._kill_stray_stepds()

    def __enter__(self) -> "SlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------ clients

    def client(self, argv: list[str], env: Mapping[str, str] | None = None, *, check: bool = True,
               timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster (``env`` plus :attr:`env`)."""
        full_env = {**(env if env is not None else os.environ), **self.env}
        result = subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    def sbatch(self, argv: list[str], env: Mapping[str, str], cwd: Path) -> int:
        """Submit a batch job (``sbatch --parsable ...``) from ``cwd``; returns its id."""
        full_env = {**env, **self.env}
        result = subprocess.run(["sbatch", "--parsable", *argv], env=full_env, cwd=cwd, capture_output=True,
                                text=True, timeout=60, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(argv)} exited {result.returncode}: {result.stderr.strip()}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, ...); {} once Slurm forgot it."""
        result = self.client(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if result.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", result.stdout))

    def wait_job(self, job_id: int, timeout_s: float, *, until=None) -> dict[str, str]:
        """Wait until the job reaches a final state (or ``until(job)`` holds); returns its record."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            record = self.job(job_id)
            if until is not None and until(record):
                return record
            if until is None and record.get("JobState") in FINAL_STATES:
                return record
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout_s:.0f} s;\n"
                           f"{self.logs()}")

    def node_state(self) -> str:
        result = self.client(["sinfo", "-h", "-N", "-o", "%t"], check=False, timeout=20)
        return result.stdout.strip() if result.returncode == 0 else ""

    def logs(self, tail: int = 40) -> str:
        """The last lines of every daemon's log (for failure messages)."""
        parts = []
        for path in sorted((self.root / "log").glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # ------------------------------------------------------------------------------------------ internals

    def _write_files(self) -> None:
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses a key others can read, and a socket directory others can write to or cannot enter.
        os.chmod(self.root / "munge", 0o755)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        log = self.root / "log"
        self.conf.write_text("\n".join([
            "ClusterName=dscapture",
            # The controller must be named as this host calls itself (slurmctld refuses to start otherwise).
            f"SlurmctldHost={NODE_NAME}(127.0.0.1)",
            "MailProg=/bin/true",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire (default 120 s) is also how long a requeued job waits before it may start again: a job
            # released earlier (scontrol update StartTime=now) is killed as "Job credential revoked" by slurmd.
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={log / 'slurmctld.log'}",
            f"SlurmdLogFile={log / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # No cgroups in a container: processes tracked by /proc, tasks not bound.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            # Signalled tasks get this long between SIGTERM and SIGKILL (Slurm's preemption grace).
            "KillWait=30",
            "MinJobAge=600",
            "JobRequeue=1",
            f"NodeName={NODE_NAME} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} "
            f"RealMemory={NODE_MEMORY_MB} State=UNKNOWN",
            f"PartitionName=debug Nodes={NODE_NAME} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "wb")
        self._procs[name] = subprocess.Popen(argv, env={**os.environ, **self.env}, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def _wait_for(self, condition, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [name for name, proc in self._procs.items() if proc.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}:\n{self._all_output()}")
            if condition():
                return
            time.sleep(0.3)
        raise RuntimeError(f"{what} not reached within {timeout_s:.0f} s:\n{self._all_output()}")

    def _all_output(self) -> str:
        parts = [self.logs()]
        for path in sorted((self.root / "log").glob("*.stdout")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def _kill_stray_stepds(self) -> None:
        """slurmstepd processes of this cluster that outlived slurmd (they name our spool dir on their
        command line or environment) are ended too: a test must leave no daemon behind."""
        marker = str(self.conf).encode()
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes() if b"slurmstepd" in cmdline else b""
            except OSError:
                continue
            if b"slurmstepd" in cmdline and marker in environ:
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
