"""Elastic resume and rerun repair across real gloo ranks (forked, the launcher's environment; tiny qwen3,
engine deepspeed, 24 samples in 6 shards of 4).

- A cache begun at dp 4 and SIGKILLed mid-run continues at dp 1, 2 and 3 (three copies of the one killed
  directory) and ends byte-identical to one uninterrupted dp 2 run: shards, checksum sidecars and target
  weights byte for byte, the manifest too except its ``producer`` bookkeeping, which records the layout
  that finished it. Kept shards keep their inodes; each resume writes only the two missing shards.
- A complete dp 2 cache with a truncated shard (rank 0's range), a flipped byte (rank 1's) and a deleted
  shard (rank 1's) is repaired by ``torchrun ... ds-capture run --verify-checksums`` on 2 ranks: the warning
  names the three, only they are recomputed (summary line, rows forwarded in ``metrics.jsonl``, the other
  shards' inodes), back to the reference bytes.

Six launches in all: the reference, the repair, the kill, three resumes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import yaml

from tests.distributed import _kill_helpers as kh
from tests.distributed.launchers import run_launcher

pytestmark = [pytest.mark.distributed]

NUM_SAMPLES, SHARD_SIZE, MICRO_BATCH = 24, 4, 2
NUM_SHARDS = NUM_SAMPLES // SHARD_SIZE  # 6: at dp 4 the ranks hold shards {0, 1}, {2, 3}, {4}, {5}
DATA = Path(__file__).resolve().parents[2] / "ds_capture" / "demo_data" / "conversations.jsonl"
# Killed inside the 3rd forward on every rank: each rank's first shard (forwards 1-2) is in, with its sidecar.
KILL = "forward:3:all"
DONE_AT_KILL = {0, 2, 4, 5}


def write_recipe(path: Path, target: Path, data: Path, out: Path) -> Path:
    recipe = {"engine": "deepspeed", "dist_env": {"timeout_minutes": 2},
              # Synchronous writes and a collective every step: the ranks move in lockstep and a shard is on
              # disk before the next forward, so where a kill lands is the same in every run.
              "capture": {"writer_buffer_mib": 0, "metrics_interval_steps": 1},
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


@pytest.fixture(scope="module")
def setup(tiny_target, tmp_path_factory) -> dict:
    """Target, data and one uninterrupted dp 2 reference cache."""
    import ds_capture.runner  # noqa: F401 - imported once here, so each forked rank starts at once

    kh.disable_shm_op()
    root = tmp_path_factory.mktemp("elastic")
    target = tiny_target("qwen3")
    data = root / "data.jsonl"
    data.write_text("".join(DATA.read_text().splitlines(keepends=True)[:NUM_SAMPLES]))
    reference = root / "reference"
    result = kh.run_forked_ranks(2, write_recipe(root / "reference.yaml", target, data, reference),
                                 log_path=root / "reference.log", timeout_s=200)
    assert result["codes"] == [0, 0], (root / "reference.log").read_text()[-3000:]
    assert kh.manifest_complete(reference) is True and len(kh.shard_files(reference)) == NUM_SHARDS
    return {"root": root, "target": target, "data": data, "reference": reference}


@pytest.mark.timeout(600)
def test_a_dp4_cache_killed_mid_run_continues_at_dp_1_2_3_byte_identical(setup, tmp_path: Path) -> None:
    killed = tmp_path / "killed"
    cfg = write_recipe(tmp_path / "killed.yaml", setup["target"], setup["data"], killed)
    result = kh.run_forked_ranks(4, cfg, kill=KILL, log_path=tmp_path / "killed.log", timeout_s=200)
    log = (tmp_path / "killed.log").read_text()
    assert signal.SIGKILL in result["signals"] and not result["timed_out"], (result, log[-3000:])
    assert kh.manifest_complete(killed) is False and kh.finished_shards(killed) == DONE_AT_KILL, log[-3000:]
    assert json.loads((killed / "manifest.json").read_text())["producer"]["dp_size"] == 4

    expected = cache_files(setup["reference"])
    for dp_size in (1, 2, 3):
        out = tmp_path / f"dp{dp_size}"
        shutil.copytree(killed, out)
        kept = {name: ino for name, ino in kh.shard_inodes(out).items() if int(name[6:12]) in DONE_AT_KILL}
        cfg = write_recipe(tmp_path / f"dp{dp_size}.yaml", setup["target"], setup["data"], out)
        log_path = tmp_path / f"dp{dp_size}.log"
        rerun = kh.run_forked_ranks(dp_size, cfg, log_path=log_path, timeout_s=200)
        assert rerun["codes"] == [0] * dp_size, log_path.read_text()[-3000:]
        summary = rerun["summary"]
        assert (summary["shards_written"], summary["shards_skipped"]) == (2, 4), (dp_size, summary)
        assert rows_forwarded(out) == 2 * SHARD_SIZE
        assert {name: ino for name, ino in kh.shard_inodes(out).items() if name in kept} == kept
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["complete"] is True and manifest["producer"]["dp_size"] == dp_size
        assert cache_files(out) == expected, f"resumed at dp {dp_size}"
        if dp_size == 2:  # the reference's own layout: the manifest too, byte for byte
            assert kh.cache_digests(out) == kh.cache_digests(setup["reference"])
        assert not list(out.glob("*.tmp")) and not (out / ".ds_capture" / "lock").exists()
        print(f"dp4 killed, kept {sorted(DONE_AT_KILL)}; resumed at dp {dp_size}: wrote {summary['shards_written']} "
              f"in {rerun['seconds']:.1f} s")


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
