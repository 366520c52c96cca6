"""Slurm for real: a one-host cluster (``slurm_cluster``) runs ``launch/slurm.sbatch`` and ``srun`` with 2 tasks, and
the preemption path through Slurm itself (``scancel --signal=TERM`` mid-run, the script's requeue on exit 75).

Every cache must equal a one-process capture of the same recipe: same shard and target-weight bytes, and
``ds-capture compare`` says equal (the manifests differ only in bookkeeping: the producer's dp size). Skipped,
with the reason, where the cluster cannot start (no Slurm binaries, not root).

The cluster is started once for the session and stopped afterwards (no daemon, job or step left).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed import _kill_helpers as kh
from tests.distributed.launchers import REPO_ROOT, child_env, free_port
from tests.distributed.slurm_cluster import SlurmCluster, why_slurm_cannot_start
from tests.distributed.support import safetensors_digests
from tests.distributed.test_crash_resume import write_recipe

pytestmark = [pytest.mark.distributed]

NUM_SAMPLES, SHARD_SIZE = 96, 4  # 24 steps per rank at 2 ranks: room for the signal to land mid-run
NUM_SHARDS = NUM_SAMPLES // SHARD_SIZE
DATA = REPO_ROOT / "ds_capture" / "demo_data" / "conversations.jsonl"
SBATCH = REPO_ROOT / "launch" / "slurm.sbatch"
# The script's header asks for 2 nodes x 8 GPUs; the command line overrides it for this 2-CPU node.
SMALL = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", "--time=00:10:00"]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    reason = why_slurm_cannot_start()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"the one-host Slurm cluster did not start: {str(error)[:2000]}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def setup(slurm_cluster, tiny_target, tmp_path_factory) -> dict:
    """Target, data, and a one-process capture of the recipe (the reference)."""
    import ds_capture.runner  # noqa: F401  (paid once: the forked process starts at once)

    kh.disable_shm_op()
    root = tmp_path_factory.mktemp("slurm_setup")
    target = tiny_target("qwen3_moe", seed=0)
    data = root / "data.jsonl"
    data.write_text("".join(DATA.read_text().splitlines(keepends=True)[:NUM_SAMPLES]))
    reference = root / "reference"
    result = kh.run_forked_ranks(1, write_recipe(root / "reference.yaml", target, data, reference),
                                 log_path=root / "reference.log", timeout_s=200)
    assert result["codes"] == [0], (root / "reference.log").read_text()[-3000:]
    return {"target": target, "data": data, "reference": reference}


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """What a job step needs: this venv's ``python`` first on PATH, this checkout importable, a free port."""
    env = child_env({"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                     "MASTER_PORT": str(free_port()), "DS_ACCELERATOR": "cpu", **(extra or {})})
    return env


def assert_equals_reference(cache: Path, reference: Path) -> None:
    assert safetensors_digests(cache) == safetensors_digests(reference)
    compared = subprocess.run([sys.executable, "-m", "ds_capture", "compare", str(cache), str(reference)],
                              env=child_env(), capture_output=True, text=True, timeout=120)
    assert compared.returncode == 0, compared.stdout + compared.stderr


def job_output(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else "(no output file)"


@pytest.mark.timeout(300)
def test_the_sbatch_script_with_2_tasks_gives_the_one_process_cache(slurm_cluster, setup, tmp_path) -> None:
    out = tmp_path / "cache"
    cfg = write_recipe(tmp_path / "run.yaml", setup["target"], setup["data"], out)
    log = tmp_path / "job.out"
    job = slurm_cluster.sbatch([*SMALL, f"--output={log}", str(SBATCH), "--no-progress"],
                               job_env({"CONFIG": str(cfg)}), cwd=REPO_ROOT)
    record = slurm_cluster.wait_job(job, timeout_s=240)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), job_output(log)[-4000:]
    assert f"captured {NUM_SAMPLES} samples" in job_output(log)
    assert_equals_reference(out, setup["reference"])


@pytest.mark.slow  # CI cut: the sbatch script (which runs srun itself) stays; srun typed directly with --full
@pytest.mark.timeout(300)
def test_srun_with_2_tasks_gives_the_one_process_cache(slurm_cluster, setup, tmp_path) -> None:
    out = tmp_path / "cache"
    cfg = write_recipe(tmp_path / "run.yaml", setup["target"], setup["data"], out)
    result = slurm_cluster.client(
        ["srun", "--ntasks=2", "--cpus-per-task=1", "--kill-on-bad-exit=1", "--time=00:10:00", sys.executable,
         "-m", "ds_capture", "run", "-c", str(cfg), "--no-progress"], env=job_env(), check=False, timeout=240)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert f"captured {NUM_SAMPLES} samples" in result.stdout
    assert_equals_reference(out, setup["reference"])


@pytest.mark.slow  # CI cut: the sbatch run stays; preemption + requeue (43 s) runs with --full
@pytest.mark.timeout(400)
def test_scancel_signal_term_mid_run_requeues_and_finishes_the_same_cache(slurm_cluster, setup, tmp_path) -> None:
    """``scancel --signal=TERM``, as a preemption sends it: both tasks stop at a boundary and exit 75, the script
    requeues the job (``#SBATCH --requeue``), and the second run finishes the cache byte-identically."""
    out = tmp_path / "cache"
    cfg = write_recipe(tmp_path / "run.yaml", setup["target"], setup["data"], out)
    log = tmp_path / "job.out"
    job = slurm_cluster.sbatch([*SMALL, f"--output={log}", str(SBATCH), "--no-progress"],
                               job_env({"CONFIG": str(cfg)}), cwd=REPO_ROOT)
    deadline = time.monotonic() + 200
    # As soon as the manifest (complete: false) is there: Slurm's signal path (scancel -> slurmctld -> slurmd ->
    # the steps) takes seconds to land here, many steps of this tiny run. Landing during the model load is fine:
    # the first vote's ballot is read 2 steps later, after every rank finished its first shard.
    while not (out / "manifest.json").is_file():
        state = slurm_cluster.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (state, job_output(log)[-3000:])
        assert time.monotonic() < deadline, job_output(log)[-3000:]
        time.sleep(0.05)
    slurm_cluster.client(["scancel", "--signal=TERM", str(job)])
    # Slurm holds a requeued batch job for the credential lifetime (cred_expire: 10 s on this cluster) before it
    # starts it again. Releasing it sooner (scontrol update StartTime=now) races slurmd, which then kills the new
    # start as "Job credential revoked" (seen: 1 run in 3 in a full suite), so the test waits for Slurm's own time.
    record = slurm_cluster.wait_job(job, timeout_s=240)
    text = job_output(log)
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("COMPLETED", "0:0", "1"), text[-4000:]
    # The first run: the stop said once, the requeue; the second: the rest written, the finished shards kept.
    stops = [line for line in text.splitlines() if "rerun the same command to continue" in line]
    assert len(stops) == 1 and "stopped by SIGTERM" in stops[0], text[-4000:]
    assert "requeueing job" in text, text[-4000:]
    written, kept = kh.summary_counts(text)
    assert 0 < kept < NUM_SHARDS and written + kept == NUM_SHARDS, text[-2000:]
    assert not list(out.rglob("*.tmp")) and not (out / ".ds_capture" / "lock").exists()
    assert_equals_reference(out, setup["reference"])
    print(f"slurm: SIGTERM once the manifest was written, requeued once: kept {kept}, wrote {written}")


# ------------------------------------------------------------------------------------------------ the service
SERVE_SEQ = 128
SERVE_DATA = REPO_ROOT / "tests" / "fixtures" / "eagle3" / "data.jsonl"  # 10 rows: 5 steps an epoch
SERVE_LIMIT_S = 6  # dist_env.heartbeat_timeout_seconds of write_serve_recipe
TRAIN_SERVE = ["--data", str(SERVE_DATA), "--seq-length", str(SERVE_SEQ), "--ttt-steps", "3", "--epochs", "4"]


def _rank_pid(job: int, rank: int) -> int | None:
    """The pid of the job's task ``rank`` running ``ds_capture serve`` (found by its Slurm environment)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if (b"ds_capture\0serve" in cmdline and f"SLURM_JOB_ID={job}".encode() in environ
                and f"SLURM_PROCID={rank}".encode() in environ):
            return int(pid)
    return None


def _served(url: str) -> int:
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return -1
    return sum(int(float(line.split()[-1])) for line in text.splitlines()
               if line.startswith('ds_capture_serve_requests_total{endpoint="generate",status="200"}'))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_serving_rank_requeues_the_service_and_a_nemo_trainer_rides_through(slurm_cluster, tmp_path):
    """``COMMAND=serve sbatch launch/slurm.sbatch`` on 2 tasks (EP 2, one URL per replica). NeMo's own trainer
    (``remote_timeout: 30``, ``remote_max_retries: 8``) trains against it; rank 1 is SIGKILLed mid-training. The
    other rank is out within the liveness limit, srun reports the death, the script requeues the job, the
    service comes back on the same ports with the trainer's draft vocabulary, and the trainer finishes with the
    losses of NeMo's colocated target, bit for bit: it never saw an error status, only connection errors it
    retried."""
    from tests.distributed.launchers import reserve_ports
    from tests.eagle3_support import build_fixture_target, read_spec
    from tests.serve_support import write_serve_recipe

    target = build_fixture_target(read_spec(), "qwen3_moe", tmp_path / "target")
    recipe = write_serve_recipe(tmp_path / "serve.yaml", target, seq_length=SERVE_SEQ, ep_size=2)
    log = tmp_path / "job.out"
    with reserve_ports(2) as port:  # held (from other tests) until the service is gone
        _serve_requeue(slurm_cluster, target, recipe, log, port, tmp_path)


def _serve_requeue(slurm_cluster, target, recipe, log, port, tmp_path) -> None:
    import httpx

    from tests.serve_support import run_nemo

    urls = [f"http://127.0.0.1:{port + d}" for d in range(2)]
    job = slurm_cluster.sbatch([*SMALL, f"--output={log}", str(SBATCH), "--port", str(port), "--log-interval", "0"],
                               job_env({"CONFIG": str(recipe), "COMMAND": "serve",
                                        "VOCAB_DIR": str(tmp_path / "vocab")}), cwd=REPO_ROOT)
    trainer = None
    try:
        colocated = run_nemo("train_eagle3.py", "--target", str(target), *TRAIN_SERVE, timeout_s=400)
        deadline = time.monotonic() + 200
        while not all(_served(url) >= 0 for url in urls):
            assert slurm_cluster.job(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), job_output(log)
            assert time.monotonic() < deadline, job_output(log)[-3000:]
            time.sleep(0.5)
        command = [sys.executable, str(REPO_ROOT / "tools" / "nemo_oracle" / "train_eagle3.py"), "--target",
                   str(target), *TRAIN_SERVE, "--remote-url", urls[0], "--remote-url", urls[1],
                   "--remote-timeout", "30", "--remote-max-retries", "8"]
        trainer = subprocess.Popen(command, env={**child_env(), "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while sum(max(0, _served(url)) for url in urls) < 4:  # mid-training
            assert trainer.poll() is None, trainer.communicate()[1][-3000:]
            assert time.monotonic() < deadline, job_output(log)[-3000:]
            time.sleep(0.05)
        rank0, rank1 = _rank_pid(job, 0), _rank_pid(job, 1)
        assert rank0 and rank1, job_output(log)[-3000:]
        os.kill(rank1, 9)
        killed = time.monotonic()
        while _alive(rank0) and time.monotonic() < killed + SERVE_LIMIT_S + 30:
            time.sleep(0.1)
        rank0_out = time.monotonic() - killed
        record = slurm_cluster.wait_job(job, timeout_s=240, until=lambda r: r.get("Restarts") == "1"
                                        and r.get("JobState") == "RUNNING")
        back = None
        while back is None and time.monotonic() < killed + 240:
            if all(_served(url) >= 0 for url in urls):
                back = time.monotonic() - killed
            time.sleep(0.2)
        out, err = trainer.communicate(timeout=400)
        assert trainer.returncode == 0, err[-4000:]
        remote = json.loads(out.strip().splitlines()[-1])
        text = job_output(log)
        print(f"slurm serve: rank 1 SIGKILLed -> rank 0 out in {rank0_out:.1f} s, job requeued "
              f"(Restarts={record.get('Restarts')}), service healthy again {back:.1f} s after the kill; the NeMo "
              f"trainer finished {remote['steps']} steps, losses equal to colocated: "
              f"{remote['losses'] == colocated['losses']}")
        assert rank0_out < SERVE_LIMIT_S + 5, rank0_out
        assert "requeueing job" in text and "restored 1 draft vocabulary" in text, text[-4000:]
        assert remote["steps"] == colocated["steps"] == 20
        assert remote["losses"] == colocated["losses"], (remote, colocated)
        assert httpx.get(f"{urls[0]}/health", timeout=10).status_code == 200
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
        slurm_cluster.client(["scancel", str(job)], check=False)
        slurm_cluster.wait_job(job, timeout_s=120)


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().split(") ", 1)[1][0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"
