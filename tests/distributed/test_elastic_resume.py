"""Elastic resume and rerun repair across real gloo ranks (forked, the launcher's environment; tiny qwen3 whose
MLP reduces over 1,024 columns, engine deepspeed, 24 samples in 6 shards of 4).

- A cache begun at dp 4 and SIGKILLed mid-run continues at dp 1, 2 and 3 (three copies of the one killed
  directory) and ends byte-identical to one uninterrupted dp 2 run at the dp 4 run's CPU thread count: shards,
  checksum sidecars and target weights byte for byte, the manifest too except its ``producer`` bookkeeping, which
  records the layout that finished it. Kept shards keep their inodes; each resume writes only the two missing
  shards. Every run keeps ``capture.cpu_threads: auto``: the dp 4 ranks take ``cores // 4`` threads each, the dp 1
  resume would take every core, and it computes with the recorded count instead (one line says so). The MLP's
  long reduction makes the count show in the bits (MKL splits it over threads: at 1 and 2 threads 75% of the fp32
  states differ), so without that the dp 1 resume differs from the reference on any host of 2 cores or more.
- (slow) The launcher's own default: a real ``torchrun`` dp 2 job (1 thread per rank on 2 cores) killed mid-run,
  finished by one process with the default threads, equals the uninterrupted dp 2 run byte for byte.
- A complete dp 2 cache with a truncated shard (rank 0's range), a flipped byte (rank 1's) and a deleted
  shard (rank 1's) is repaired by ``torchrun ... ds-capture run --verify-checksums`` on 2 ranks: the warning
  names the three, only they are recomputed (summary line, rows forwarded in ``metrics.jsonl``, the other
  shards' inodes), back to the reference bytes.

Six launches in all (the slow torchrun cell adds two): the reference, the repair, the kill, three resumes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import yaml

import ds_capture.parallel.cpu_threads as cpu_threads
from tests.distributed import _kill_helpers as kh
from tests.distributed.launchers import run_launcher

pytestmark = [pytest.mark.distributed]

NUM_SAMPLES, SHARD_SIZE, MICRO_BATCH = 24, 4, 2
NUM_SHARDS = NUM_SAMPLES // SHARD_SIZE  # 6: at dp 4 the ranks hold shards {0, 1}, {2, 3}, {4}, {5}
DATA = Path(__file__).resolve().parents[2] / "ds_capture" / "demo_data" / "conversations.jsonl"
# Killed inside the 3rd forward on every rank: each rank's first shard (forwards 1-2) is in, with its sidecar.
KILL = "forward:3:all"
DONE_AT_KILL = {0, 2, 4, 5}


# The host's cores, which this module's forked ranks are given (tests/conftest.py gives the others one), and the
# per-rank CPU thread count of `capture.cpu_threads: auto` at dp 4 and at dp 2 on this host (what a reference made
# in one go must use to be comparable byte for byte).
CORES = max(1, len(os.sched_getaffinity(0)))
THREADS_DP4, THREADS_DP2 = max(1, CORES // 4), max(1, CORES // 2)
CONTINUING = "continuing {out} with {threads} CPU thread{s} per rank, the count it was begun with"


def write_recipe(path: Path, target: Path, data: Path, out: Path, cpu_threads: int | str = "auto") -> Path:
    recipe = {"engine": "deepspeed", "dist_env": {"timeout_minutes": 2},
              # Synchronous writes and a collective every step: the ranks move in lockstep and a shard is on
              # disk before the next forward, so where a kill lands is the same in every run.
              "capture": {"writer_buffer_mib": 0, "metrics_interval_steps": 1, "cpu_threads": cpu_threads},
              "recipe_args": dict(target_model_name_or_path=str(target), train_data_path=str(data),
                                  cache_output_dir=str(out), seq_length=48, micro_batch_size=MICRO_BATCH,
                                  cache_shard_size=SHARD_SIZE, cache_dtype="fp32")}
    path.write_text(yaml.safe_dump(recipe))
    return path


def cache_files(out: Path) -> dict[str, bytes]:
    """Every file of the cache and its sidecars by relative path, the manifest's producer record aside."""
    files = {name: (out / name).read_bytes() for name in kh.cache_digests(out) if name != "manifest.json"}
    files.update({f"checksums/{p.name}": p.read_bytes() for p in (out / ".ds_capture" / "checksums").iterdir()})
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.pop("producer")
    files["manifest.json (producer aside)"] = json.dumps(manifest, sort_keys=True).encode()
    return files


def rows_forwarded(out: Path) -> int:
    return json.loads((out / ".ds_capture" / "metrics.jsonl").read_text().splitlines()[-1])["samples_done"]


@pytest.fixture(scope="module", autouse=True)
def host_cores():
    """``auto`` of this module's forked ranks sees the host's cores, as a launcher's ranks do."""
    given = cpu_threads.host_cores
    cpu_threads.host_cores = lambda: CORES
    yield
    cpu_threads.host_cores = given


@pytest.fixture(scope="module")
def setup(host_cores, tiny_target, tmp_path_factory) -> dict:
    """Target, data and one uninterrupted dp 2 reference cache at the dp 4 runs' thread count."""
    import ds_capture.cli  # noqa: F401 - imported once here, so each forked rank starts at once

    kh.disable_shm_op()
    root = tmp_path_factory.mktemp("elastic")
    target = tiny_target("qwen3", intermediate_size=1024)
    data = root / "data.jsonl"
    data.write_text("".join(DATA.read_text().splitlines(keepends=True)[:NUM_SAMPLES]))
    setup = {"root": root, "target": target, "data": data, "references": {}}
    setup["reference"] = reference(setup, THREADS_DP4)
    return setup


def reference(setup: dict, threads: int) -> Path:
    """An uninterrupted dp 2 cache computed with ``threads`` CPU threads per rank (built on first use)."""
    if threads not in setup["references"]:
        root = setup["root"]
        out = root / f"reference-{threads}"
        cfg = write_recipe(root / f"reference-{threads}.yaml", setup["target"], setup["data"], out, threads)
        result = kh.run_forked_ranks(2, cfg, log_path=root / f"reference-{threads}.log", timeout_s=200)
        assert result["codes"] == [0, 0], (root / f"reference-{threads}.log").read_text()[-3000:]
        assert kh.manifest_complete(out) is True and len(kh.shard_files(out)) == NUM_SHARDS
        setup["references"][threads] = out
    return setup["references"][threads]


def resume(world_size: int, cfg: Path, log_path: Path) -> tuple[dict, str]:
    """``ds-capture run -c cfg`` on ``world_size`` forked ranks (one: a plain process); its result and log."""
    result = kh.run_forked_ranks(world_size, None, log_path=log_path, timeout_s=200,
                                 cli_argv=["run", "-c", str(cfg), "--no-progress"], own_logging=True)
    log = log_path.read_text()
    assert result["codes"] == [0] * world_size, log[-3000:]
    return result, log


def continuing_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "continuing " in line]


@pytest.mark.timeout(600)
def test_a_dp4_cache_killed_mid_run_continues_at_dp_1_2_3_byte_identical(setup, tmp_path: Path) -> None:
    killed = tmp_path / "killed"
    cfg = write_recipe(tmp_path / "killed.yaml", setup["target"], setup["data"], killed)
    result = kh.run_forked_ranks(4, cfg, kill=KILL, log_path=tmp_path / "killed.log", timeout_s=200)
    log = (tmp_path / "killed.log").read_text()
    assert signal.SIGKILL in result["signals"] and not result["timed_out"], (result, log[-3000:])
    assert kh.manifest_complete(killed) is False and kh.finished_shards(killed) == DONE_AT_KILL, log[-3000:]
    assert json.loads((killed / "manifest.json").read_text())["producer"]["dp_size"] == 4
    assert json.loads((killed / ".ds_capture" / "numerics.json").read_text())["cpu_threads"] == THREADS_DP4

    expected = cache_files(setup["reference"])
    for dp_size in (1, 2, 3):
        out = tmp_path / f"dp{dp_size}"
        shutil.copytree(killed, out)
        kept = {name: ino for name, ino in kh.shard_inodes(out).items() if int(name[6:12]) in DONE_AT_KILL}
        cfg = write_recipe(tmp_path / f"dp{dp_size}.yaml", setup["target"], setup["data"], out)
        rerun, log = resume(dp_size, cfg, tmp_path / f"dp{dp_size}.log")
        assert kh.summary_counts(log) == (2, 4), (dp_size, log[-3000:])
        assert rows_forwarded(out) == 2 * SHARD_SIZE
        assert {name: ino for name, ino in kh.shard_inodes(out).items() if name in kept} == kept
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["complete"] is True and manifest["producer"]["dp_size"] == dp_size
        assert cache_files(out) == expected, f"resumed at dp {dp_size}"
        # One line (rank 0's) says which count the resume computes with, and why; auto's own count here beside it.
        auto_here = max(1, CORES // dp_size)
        assert continuing_lines(log) == [
            "[ds_capture] INFO " + CONTINUING.format(out=out, threads=THREADS_DP4, s="s" * (THREADS_DP4 != 1))
            + f" (.ds_capture/numerics.json; here capture.cpu_threads: auto gives {auto_here}): its new shards match "
            "the earlier ones byte for byte"], log[-3000:]
        if dp_size == 2:  # the reference's own layout: the manifest too, byte for byte
            assert kh.cache_digests(out) == kh.cache_digests(setup["reference"])
        assert not list(out.glob("*.tmp")) and not (out / ".ds_capture" / "lock").exists()
        print(f"dp4 killed ({THREADS_DP4} threads per rank), kept {sorted(DONE_AT_KILL)}; resumed at dp {dp_size} "
              f"(auto: {auto_here}): wrote 2 in {rerun['seconds']:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_torchrun_dp2_cache_killed_mid_run_is_finished_by_one_process_byte_identical(setup, tmp_path: Path) -> None:
    """The launchers' own defaults: torchrun exports OMP_NUM_THREADS=1 to each of its ranks (auto: cores // 2), a
    plain process takes every core; the one-process rerun computes with the torchrun job's recorded count."""
    out = tmp_path / "cache"
    cfg = write_recipe(tmp_path / "run.yaml", setup["target"], setup["data"], out)
    argv = [str(Path(kh.__file__).resolve()), "run", "-c", str(cfg), "--no-progress"]
    killed = run_launcher("torchrun", 2, argv, {kh.NO_SHM_ENV: "1", kh.KILL_ENV: KILL}, timeout_s=200)
    assert killed.returncode != 0 and kh.manifest_complete(out) is False, killed.stdout[-3000:]
    done = kh.finished_shards(out)
    assert 0 < len(done) < NUM_SHARDS, (done, killed.stdout[-3000:])
    assert json.loads((out / ".ds_capture" / "numerics.json").read_text())["cpu_threads"] == THREADS_DP2

    _result, log = resume(1, cfg, tmp_path / "rerun.log")
    assert continuing_lines(log) == [
        "[ds_capture] INFO " + CONTINUING.format(out=out, threads=THREADS_DP2, s="s" * (THREADS_DP2 != 1))
        + f" (.ds_capture/numerics.json; here capture.cpu_threads: auto gives {CORES}): its new shards match "
        "the earlier ones byte for byte"], log[-3000:]
    assert kh.summary_counts(log) == (NUM_SHARDS - len(done), len(done))
    assert cache_files(out) == cache_files(reference(setup, THREADS_DP2))


@pytest.mark.timeout(300)
def test_a_damaged_complete_dp2_cache_is_repaired_by_a_dp2_rerun(setup, tmp_path: Path) -> None:
    out = tmp_path / "cache"
    shutil.copytree(setup["reference"], out)
    size = (out / "shard-000001.safetensors").stat().st_size
    os.truncate(out / "shard-000001.safetensors", size - 8)  # rank 0's range (shards 0-2)
    with open(out / "shard-000003.safetensors", "r+b") as handle:  # rank 1's range (shards 3-5)
        handle.seek(size // 2)
        byte = handle.read(1)
        handle.seek(size // 2)
        handle.write(bytes([byte[0] ^ 0x01]))
    (out / "shard-000004.safetensors").unlink()
    kept = {name: ino for name, ino in kh.shard_inodes(out).items() if name[6:12] in ("000000", "000002", "000005")}

    cfg = write_recipe(tmp_path / "run.yaml", setup["target"], setup["data"], out)
    # The real CLI under torchrun (forked ranks would log into pytest's handlers, not the job's output).
    argv = [str(Path(kh.__file__).resolve()), "run", "-c", str(cfg), "--no-progress", "--verify-checksums"]
    result = run_launcher("torchrun", 2, argv, {kh.NO_SHM_ENV: "1"}, timeout_s=200)
    log = result.stdout
    assert result.returncode == 0 and result.leftover_shm == [], log[-3000:]
    found = [line for line in log.splitlines() if "is marked complete, but" in line]
    assert found == [
        f"[ds_capture] WARNING {out} is marked complete, but shard-000001.safetensors: size {size - 8} != {size} from "
        "its header; shard-000003.safetensors: its xxh3-128-rows checksum differs from its sidecar (the file changed "
        "after it was written); shard-000004.safetensors: missing: recomputing 3 of 6 shards; its manifest says "
        "complete: false until they are written"], log[-3000:]
    assert kh.summary_counts(log) == (3, 3)  # written, kept
    assert rows_forwarded(out) == 3 * SHARD_SIZE
    assert {name: ino for name, ino in kh.shard_inodes(out).items() if name in kept} == kept
    assert kh.cache_digests(out) == kh.cache_digests(setup["reference"])
    assert cache_files(out) == cache_files(setup["reference"])
