"""Safety of one job's output directory (single process, no process group): the exclusive lock and
its stale reclaim, changed inputs under the same paths, the NaN policy, and a read-only or full
output filesystem (a real tmpfs where ``mount`` works here) giving a clear message and no partial
file under a final shard name."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import ds_capture.capture.safety as safety
import ds_capture.runner as runner
from ds_capture.capture.safety import OutputLock, input_fingerprints
from ds_capture.cli import main
from ds_capture.errors import CaptureError
from ds_capture.recipe.config import load_config
from ds_capture.runner import run_capture

NUM_SAMPLES, SHARD_SIZE = 16, 4
NUM_SHARDS = NUM_SAMPLES // SHARD_SIZE
DATA = Path(__file__).resolve().parents[2] / "ds_capture" / "demo_data" / "conversations.jsonl"
NAN_SAMPLE = 5


def write_recipe(path: Path, target: Path, data: Path, out: Path, **capture) -> Path:
    recipe = {"recipe_args": dict(
        target_model_name_or_path=str(target), train_data_path=str(data), cache_output_dir=str(out),
        seq_length=32, micro_batch_size=2, cache_shard_size=SHARD_SIZE, cache_dtype="fp32",
        mask_generation_prompt=False, mask_reasoning_content=False)}
    if capture:
        recipe["capture"] = capture
    path.write_text(yaml.safe_dump(recipe))
    return path


def run(cfg: Path, *, restart: bool = False):
    return run_capture(load_config(cfg), restart=restart, show_progress=False)


def digests(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir()) if p.is_file()}


def assert_same_cache(out: Path, base: dict) -> None:
    """Byte-identical to the reference, but for the manifest's train_data_path (each test has its own copy)."""
    got, want = digests(out), dict(base["digests"])
    assert {k: v for k, v in got.items() if k != "manifest.json"} == {
        k: v for k, v in want.items() if k != "manifest.json"}
    manifest = json.loads((out / "manifest.json").read_text())
    reference = json.loads((base["reference"] / "manifest.json").read_text())
    assert {**manifest, "train_data_path": None} == {**reference, "train_data_path": None}


@pytest.fixture(scope="module")
def base(tiny_target, tmp_path_factory) -> dict:
    """A tiny qwen3 target, 16 rows of the demo data, and an uninterrupted reference cache."""
    root = tmp_path_factory.mktemp("safety")
    target = tiny_target("qwen3", seed=0)
    data = root / "data.jsonl"
    data.write_text("".join(DATA.read_text().splitlines(keepends=True)[:NUM_SAMPLES]))
    reference = root / "reference"
    assert run(write_recipe(root / "reference.yaml", target, data, reference)).shards_written == NUM_SHARDS
    return {"target": target, "data": data, "reference": reference, "digests": digests(reference)}


def fresh(base: dict, tmp_path: Path, **capture) -> tuple[Path, Path]:
    """(recipe, output dir) of a new run in ``tmp_path`` over a private copy of the data."""
    data = tmp_path / "data.jsonl"
    shutil.copy(base["data"], data)
    out = tmp_path / "cache"
    return write_recipe(tmp_path / "run.yaml", base["target"], data, out, **capture), out


# ---------------------------------------------------------------------------------------------- the lock


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_lock(out: Path, **record) -> Path:
    path = out / ".ds_capture" / "lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), **record}))
    return path


def test_a_second_job_is_refused_naming_host_and_pid(base, tmp_path):
    cfg, out = fresh(base, tmp_path)
    holder = OutputLock(out)
    holder.acquire()  # another live job (this process) owns the directory
    try:
        with pytest.raises(CaptureError) as refused:
            run(cfg)
    finally:
        holder.release()
    message = str(refused.value)
    assert f"host {socket.gethostname()}" in message and f"pid {os.getpid()}" in message
    assert "in use by another ds_capture job" in message
    assert not (out / "manifest.json").exists() and not list(out.glob("*.safetensors"))
    assert not holder.path.exists()  # release removed it
    run(cfg)  # and the directory is usable once the first job is gone
    assert_same_cache(out, base)


def test_the_cli_refusal_is_one_message_exit_2(base, tmp_path, capsys):
    cfg, out = fresh(base, tmp_path)
    with OutputLock(out):
        assert main(["run", "-c", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-capture run: error: ") and f"pid {os.getpid()}" in err and "Traceback" not in err


def test_a_stale_lock_of_a_dead_pid_is_reclaimed_with_a_warning(base, tmp_path, caplog):
    cfg, out = fresh(base, tmp_path)
    pid = dead_pid()
    write_lock(out, pid=pid)
    with caplog.at_level(logging.WARNING, logger="ds_capture"):
        summary = run(cfg)
    assert summary.shards_written == NUM_SHARDS
    warnings = [r.getMessage() for r in caplog.records if "reclaiming a stale lock" in r.getMessage()]
    assert len(warnings) == 1 and f"pid {pid}" in warnings[0] and socket.gethostname() in warnings[0]
    assert not (out / ".ds_capture" / "lock").exists()
    assert_same_cache(out, base)


@pytest.mark.parametrize("age_s, refused", [(10.0, True), (safety.STALE_AFTER_S + 60, False)])
def test_another_hosts_lock_is_judged_by_its_heartbeat(tmp_path, caplog, age_s, refused):
    path = write_lock(tmp_path, host="some-other-node", pid=1)
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    lock = OutputLock(tmp_path)
    if refused:
        with pytest.raises(CaptureError, match="host some-other-node, pid 1"):
            lock.acquire()
        assert json.loads(path.read_text())["host"] == "some-other-node"  # left alone
        return
    with caplog.at_level(logging.WARNING, logger="ds_capture"):
        lock.acquire()
    try:
        assert json.loads(path.read_text())["pid"] == os.getpid()
        assert any("some-other-node" in r.getMessage() for r in caplog.records)
    finally:
        lock.release()


def test_a_torn_lock_file_is_not_a_live_job(tmp_path):
    path = tmp_path / ".ds_capture" / "lock"
    path.parent.mkdir(parents=True)
    path.write_text('{"host": ')
    old = time.time() - safety.STARTING_GRACE_S - 1  # left by a job killed while it was starting
    os.utime(path, (old, old))
    with OutputLock(tmp_path):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert not path.exists()


def test_a_live_pid_with_an_old_heartbeat_is_a_reused_pid(tmp_path, caplog):
    """Our own pid is alive, but a live job would have refreshed its lock: the pid was reused."""
    path = write_lock(tmp_path, pid=os.getpid())
    old = time.time() - safety.STALE_AFTER_S - 60
    os.utime(path, (old, old))
    with caplog.at_level(logging.WARNING, logger="ds_capture"), OutputLock(tmp_path):
        assert any("reclaiming a stale lock" in r.getMessage() for r in caplog.records)


def test_a_lock_still_being_written_is_a_job_starting(tmp_path):
    path = tmp_path / ".ds_capture" / "lock"
    path.parent.mkdir(parents=True)
    path.write_text("")  # created with O_EXCL a moment ago, record not yet written
    with pytest.raises(CaptureError, match="another job is starting"):
        OutputLock(tmp_path).acquire()
    assert path.exists()


def _race_for_a_stale_lock(out: str, barrier, wins) -> None:
    lock = OutputLock(Path(out))
    barrier.wait()
    try:
        lock.acquire()
    except CaptureError:
        return
    wins.put(os.getpid())
    time.sleep(1.0)  # hold it while the other job decides
    lock.release()


def test_two_jobs_reclaiming_one_stale_lock_do_not_both_win(tmp_path, monkeypatch):
    """Both find the same dead job's lock; without serialising check and unlink, the slower one
    removes the faster one's new lock and both run. The staleness check is slowed to open the window."""
    import multiprocessing

    real_pid_alive = safety._pid_alive
    monkeypatch.setattr(safety, "_pid_alive", lambda pid: time.sleep(0.3) or real_pid_alive(pid))
    context = multiprocessing.get_context("fork")
    for attempt in range(3):
        out = tmp_path / f"run{attempt}"
        write_lock(out, pid=dead_pid())
        barrier, wins = context.Barrier(2), context.Queue()
        procs = [context.Process(target=_race_for_a_stale_lock, args=(str(out), barrier, wins)) for _ in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=30)
        winners = []
        while not wins.empty():
            winners.append(wins.get())
        assert len(winners) == 1, f"attempt {attempt}: {len(winners)} jobs took the same directory"


def test_the_heartbeat_refreshes_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(safety, "HEARTBEAT_S", 0.05)
    with OutputLock(tmp_path) as lock:
        os.utime(lock.path, (0, 0))
        deadline = time.monotonic() + 5
        while lock.path.stat().st_mtime == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert time.time() - lock.path.stat().st_mtime < 5


# ---------------------------------------------------------------------------------------------- changed inputs


def test_a_changed_dataset_under_the_same_path_is_refused_and_restart_accepts_it(base, tmp_path):
    cfg, out = fresh(base, tmp_path)
    run(cfg)
    data = tmp_path / "data.jsonl"
    rows = data.read_text().splitlines(keepends=True)
    row = json.loads(rows[3])
    row["messages"][0]["content"] = "Edited: " + row["messages"][0]["content"]  # within seq_length
    rows[3] = json.dumps(row) + "\n"
    data.write_text("".join(rows))  # same path, same row count: the manifest's identity cannot tell
    before = digests(out)
    with pytest.raises(CaptureError) as refused:
        run(cfg)
    assert "the dataset's content" in str(refused.value) and "--restart" in str(refused.value)
    assert digests(out) == before  # nothing touched
    summary = run(cfg, restart=True)
    assert (summary.shards_written, summary.shards_skipped) == (NUM_SHARDS, 0)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["inputs"]["train_data_sha256"] == input_fingerprints(
        data, base["target"])["train_data_sha256"]
    assert digests(out)["shard-000000.safetensors"] != before["shard-000000.safetensors"]  # row 3 is in shard 0
    assert run(cfg).shards_written == 0  # and the new inputs are the directory's inputs from now on


def test_input_fingerprints_follow_the_bytes_not_the_names(tmp_path, base):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"messages": []}\n')
    b.write_text('{"messages": []}\n')
    fa, fb = input_fingerprints(a, base["target"]), input_fingerprints(b, base["target"])
    assert fa["tokenizer_sha256"] == fb["tokenizer_sha256"]
    assert fa["train_data_sha256"] != fb["train_data_sha256"]  # the name is hashed with the bytes
    before = fa["train_data_sha256"]
    a.write_text('{"messages": [ ]}\n')
    assert input_fingerprints(a, base["target"])["train_data_sha256"] != before


# ---------------------------------------------------------------------------------------------- NaN policy


def unique_token(reference: Path, sample: int) -> int:
    """A token id that occurs in ``sample``'s content and in no other row of the reference cache."""
    shards = [load_file(str(reference / f"shard-{i:06d}.safetensors")) for i in range(NUM_SHARDS)]
    ids = torch.cat([s["input_ids"] for s in shards])
    pad = int(ids[0, -1]) if bool((ids[:, -1] == ids[0, -1]).all()) else 0
    others = set(ids[torch.arange(len(ids)) != sample].flatten().tolist())
    candidates = [t for t in ids[sample].tolist() if t not in others and t != pad]
    assert candidates, f"sample {sample} has no token of its own"
    return candidates[0]


def poison_token(monkeypatch, token: int) -> None:
    """The embedding output is NaN wherever ``token`` occurs (so only the rows holding it go bad)."""
    build_model = runner.build_model

    def build_poisoned(*args, **kwargs):
        model = build_model(*args, **kwargs)

        def hook(module, inputs, output):
            return output.masked_fill((inputs[0] == token)[..., None], float("nan"))

        model.get_input_embeddings().register_forward_hook(hook)
        return model

    monkeypatch.setattr(runner, "build_model", build_poisoned)


def test_nan_policy_fail_names_the_sample(base, tmp_path, monkeypatch):
    poison_token(monkeypatch, unique_token(base["reference"], NAN_SAMPLE))
    cfg, out = fresh(base, tmp_path, nan_policy="fail")
    with pytest.raises(CaptureError, match=rf"NaN/Inf hidden states for sample\(s\) \[{NAN_SAMPLE}\]"):
        run(cfg)
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
    assert not (out / f"shard-{NAN_SAMPLE // SHARD_SIZE:06d}.safetensors").exists()


def test_nan_policy_record_zeroes_the_sample_and_lists_it(base, tmp_path, monkeypatch):
    poison_token(monkeypatch, unique_token(base["reference"], NAN_SAMPLE))
    cfg, out = fresh(base, tmp_path, nan_policy="record")
    summary = run(cfg)
    assert summary.shards_written == NUM_SHARDS
    assert json.loads((out / ".ds_capture" / "nonfinite_samples.dp0.json").read_text()) == [NAN_SAMPLE]
    shard_index, row = divmod(NAN_SAMPLE, SHARD_SIZE)
    got = load_file(str(out / f"shard-{shard_index:06d}.safetensors"))
    want = load_file(str(base["reference"] / f"shard-{shard_index:06d}.safetensors"))
    assert not got["target_hidden_states"][row].any() and not got["target_last_hidden_states"][row].any()
    assert not got["loss_mask"][row].any() and want["loss_mask"][row].any()
    assert torch.equal(got["input_ids"], want["input_ids"])
    others = [r for r in range(SHARD_SIZE) if r != row]
    for key in ("target_hidden_states", "target_last_hidden_states", "loss_mask"):
        assert torch.equal(got[key][others], want[key][others]), key
    poisoned = f"shard-{shard_index:06d}.safetensors"
    clean = {name: d for name, d in digests(out).items() if name.startswith("shard-") and name != poisoned}
    assert clean == {name: d for name, d in base["digests"].items() if name in clean} and len(clean) == NUM_SHARDS - 1


# ---------------------------------------------------------------------------------------------- read-only / full


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(options) -> mount point``: a real tmpfs, unmounted afterwards; skip where mount is refused."""
    mounted = []

    def mount(options: str) -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_a_read_only_output_dir_gives_a_clear_message(base, tmp_path, tmpfs, capsys):
    point = tmpfs("size=4m")
    out = point / "cache"
    out.mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)
    cfg, _ = fresh(base, tmp_path)
    cfg = write_recipe(cfg, base["target"], tmp_path / "data.jsonl", out)
    assert main(["run", "-c", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot write the cache to" in err and "the filesystem is read-only" in err and "Traceback" not in err
    assert list(out.iterdir()) == []


def fill_disk_mid_run(base: dict, tmp_path: Path, tmpfs) -> tuple[Path, Path, Path, int]:
    """A run into a real tmpfs with room for two shards only: (recipe, output dir, mount point, room)."""
    page = 4096
    sizes = {p.name: -(-p.stat().st_size // page) * page for p in base["reference"].iterdir() if p.is_file()}
    shard = sizes["shard-000000.safetensors"]
    # Room for the weights, the manifest, two shards, their sidecars and logs: the third shard fails.
    room = sizes["target_weights.safetensors"] + sizes["manifest.json"] + 2 * shard + 16 * page + shard // 2
    point = tmpfs(f"size={room}")
    out = point / "cache"
    cfg, _ = fresh(base, tmp_path)
    return write_recipe(cfg, base["target"], tmp_path / "data.jsonl", out), out, point, room


def test_a_full_disk_mid_run_leaves_no_partial_shard_and_resumes(base, tmp_path, tmpfs):
    cfg, out, point, room = fill_disk_mid_run(base, tmp_path, tmpfs)
    with pytest.raises(CaptureError, match="the disk is full"):
        run(cfg)
    shards = sorted(p.name for p in out.glob("shard-*"))
    assert shards == ["shard-000000.safetensors", "shard-000001.safetensors"], shards  # no .tmp, no partial
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
    subprocess.run(["mount", "-o", f"remount,size={room * 4}", str(point)], check=True)
    summary = run(cfg)
    assert (summary.shards_written, summary.shards_skipped) == (NUM_SHARDS - 2, 2)
    assert_same_cache(out, base)


def test_a_full_disk_mid_run_gives_a_clear_message(base, tmp_path, tmpfs, capsys):
    cfg, out, _, _ = fill_disk_mid_run(base, tmp_path, tmpfs)
    code = main(["run", "-c", str(cfg), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "the disk is full" in err and "rerun the same command" in err, err[-2000:]


def test_an_injected_erofs_on_rename_leaves_no_final_file(base, tmp_path, monkeypatch, capsys):
    """Where no tmpfs can be mounted: the rename of the first shard fails with EROFS."""
    import ds_capture.cache.common.files as writer

    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if Path(dst).name.startswith("shard-"):
            raise OSError(errno.EROFS, "Read-only file system", str(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(writer.os, "replace", replace)
    cfg, out = fresh(base, tmp_path)
    assert main(["run", "-c", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the filesystem is read-only" in err and "shard-000000.safetensors" in err
    assert not list(out.glob("shard-*"))
