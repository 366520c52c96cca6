"""capture.cpu_threads: the key's values, ``auto`` over cores and local ranks, the count applied and put back, and a
rerun over a cache: it continues with the recorded count (one line says so), an explicit other count is refused
before anything is written, ``--restart`` takes the new one; verify and inspect show the recorded numerics.

The runs are single-process captures of a tiny qwen3 (6 samples, 2 shards) in this process.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from ds_capture.cache.common.files import read_numerics
from ds_capture.cache.common.identity import continue_numerics
from ds_capture.cache.registry import format_inspect, inspect_cache, verify_cache
from ds_capture.errors import CaptureError
from ds_capture.parallel.cpu_threads import host_cores, resolve_cpu_threads, use_cpu_threads
from ds_capture.recipe.config import load_config
from ds_capture.runner import run_capture

REPO_DATA = Path(__file__).resolve().parents[2] / "ds_capture" / "demo_data" / "conversations.jsonl"


@pytest.mark.parametrize("value, error", [
    (0, "`capture.cpu_threads` must be auto or a number of threads >= 1, got 0."),
    ("four", "`capture.cpu_threads` must be auto or a number of threads >= 1, got 'four'."),
    (True, "`capture.cpu_threads` must be an integer, got True."),
])
def test_bad_values_are_refused_naming_the_key(write_recipe, value, error) -> None:
    path = write_recipe({"recipe_args": {"target_model_name_or_path": "t", "train_data_path": "d",
                                         "cache_output_dir": "o", "seq_length": 8}, "capture": {"cpu_threads": value}})
    with pytest.raises(CaptureError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}: {error}"


def test_auto_is_the_cores_shared_by_the_local_ranks_at_least_one() -> None:
    assert [resolve_cpu_threads("auto", local_size=n, cores=16) for n in (1, 2, 3, 4, 8, 16, 32)] == \
        [16, 8, 5, 4, 2, 1, 1]
    assert resolve_cpu_threads("auto", local_size=1) == host_cores()
    assert resolve_cpu_threads(3, local_size=4, cores=2) == 3  # an explicit count as given


def test_the_count_is_applied_for_the_block_and_the_previous_one_put_back() -> None:
    before = torch.get_num_threads()
    with use_cpu_threads(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    with use_cpu_threads(None):  # a GPU forward: left alone
        assert torch.get_num_threads() == before


CPU = {"compute_dtype": "fp32", "device": "cpu", "engine": "deepspeed", "cpu_threads": 4}


def record(out: Path, numerics: dict) -> Path:
    (out / ".ds_capture").mkdir(parents=True, exist_ok=True)
    (out / ".ds_capture" / "numerics.json").write_text(json.dumps(numerics))
    return out


def test_a_rerun_continues_with_the_recorded_count_and_refuses_an_explicit_other(tmp_path: Path) -> None:
    out = record(tmp_path, {**CPU, "cpu_threads": 1})
    assert continue_numerics(out, CPU, setting="auto", resuming=True) == ({**CPU, "cpu_threads": 1}, True)
    assert continue_numerics(out, {**CPU, "cpu_threads": 1}, setting=1, resuming=True) == (
        {**CPU, "cpu_threads": 1}, True)
    with pytest.raises(CaptureError) as caught:
        continue_numerics(out, CPU, setting=4, resuming=True)
    assert str(caught.value) == (
        f"{out} was begun with 1 CPU thread per rank (.ds_capture/numerics.json), and this run sets "
        "capture.cpu_threads: 4: the thread count changes the order of fp32 sums on CPU, so shards computed with the "
        "two counts differ in their last bits and cannot be mixed in one cache. Set capture.cpu_threads to 1 (or "
        "auto, which continues with the recorded count) to continue this cache, use a new cache_output_dir, or pass "
        "--restart to recompute every shard with the new count.")
    # --restart (not resuming), a GPU forward now or then, a cache without a record: this run's own numerics.
    assert continue_numerics(out, CPU, setting=4, resuming=False) == (CPU, False)
    gpu = {**CPU, "device": "cuda", "cpu_threads": None}
    assert continue_numerics(out, gpu, setting=4, resuming=True) == (gpu, False)
    assert continue_numerics(record(tmp_path / "gpu", gpu), CPU, setting=4, resuming=True) == (CPU, False)
    # Another compute dtype (auto: bf16 on CUDA, fp32 on CPU) is refused, whatever the device.
    bf16 = record(tmp_path / "bf16", {**gpu, "compute_dtype": "bf16"})
    with pytest.raises(CaptureError) as caught:
        continue_numerics(bf16, CPU, setting="auto", resuming=True)
    assert str(caught.value) == (
        f"{bf16} was begun computing in bf16 (.ds_capture/numerics.json), and this run computes in fp32 "
        "(capture.compute_dtype; auto is bf16 on CUDA, fp32 on CPU): shards computed in the two dtypes differ and "
        "cannot be mixed in one cache. Set capture.compute_dtype: bf16 to continue this cache, use a new "
        "cache_output_dir, or pass --restart to recompute every shard in the new dtype.")
    assert continue_numerics(bf16, CPU, setting="auto", resuming=False) == (CPU, False)
    assert continue_numerics(tmp_path / "none", CPU, setting=4, resuming=True) == (CPU, False)


def run(tmp_path: Path, out: Path, *, restart: bool = False, **capture):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"capture": capture, "recipe_args": dict(
        target_model_name_or_path=str(tmp_path / "target"), train_data_path=str(tmp_path / "data.jsonl"),
        cache_output_dir=str(out), seq_length=24, micro_batch_size=1, cache_shard_size=3, cache_dtype="fp32")}))
    return run_capture(load_config(recipe), restart=restart, show_progress=False)


@pytest.fixture
def small_run(tmp_path: Path, tiny_target) -> Path:
    (tmp_path / "target").symlink_to(tiny_target("qwen3"))
    (tmp_path / "data.jsonl").write_text("".join(REPO_DATA.read_text().splitlines(keepends=True)[:6]))
    return tmp_path


def test_a_run_records_its_numerics_and_a_rerun_over_the_cache_continues_with_them(small_run: Path, caplog) -> None:
    out = small_run / "cache"
    before = torch.get_num_threads()
    run(small_run, out, cpu_threads=1)
    assert torch.get_num_threads() == before  # the process's own count is back after the run
    assert read_numerics(out) == {"compute_dtype": "fp32", "device": "cpu", "engine": "deepspeed", "cpu_threads": 1,
                                  "chunk_tokens": None}
    shard = out / "shard-000001.safetensors"
    first = shard.read_bytes()

    # An explicit other count: refused before anything is written (the manifest still says complete).
    shard.unlink()
    manifest = (out / "manifest.json").read_bytes()
    with pytest.raises(CaptureError, match=r"was begun with 1 CPU thread per rank .* capture.cpu_threads: 2: "):
        run(small_run, out, cpu_threads=2)
    assert (out / "manifest.json").read_bytes() == manifest and not shard.exists()

    # auto continues with the recorded count, says so in one line, and writes the same bytes.
    with caplog.at_level(logging.INFO, logger="ds_capture"):
        summary = run(small_run, out)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("continuing ")]
    assert lines == [f"continuing {out} with 1 CPU thread per rank, the count it was begun with "
                     f"(.ds_capture/numerics.json; here capture.cpu_threads: auto gives {host_cores()}): its new "
                     "shards match the earlier ones byte for byte"]
    assert (summary.shards_written, summary.shards_skipped) == (1, 1)
    assert shard.read_bytes() == first and read_numerics(out)["cpu_threads"] == 1

    # verify and inspect show them.
    assert verify_cache(out).summary().endswith(
        "; numerics: compute fp32 on cpu, 1 CPU thread per rank, engine deepspeed")
    info = inspect_cache(out)
    assert info["numerics"] == read_numerics(out)
    assert "\nnumerics     compute fp32 on cpu, 1 CPU thread per rank, engine deepspeed\n" in format_inspect(info)

    # compare shows both caches' numerics beside the verdict (here a copy that says it was computed with 3 threads).
    import shutil

    from ds_capture.cache.registry import compare_caches

    other = small_run / "other"
    shutil.copytree(out, other)
    record(other, {**read_numerics(out), "cpu_threads": 3})
    lines = compare_caches(out, other, atol=0, rtol=0).format().splitlines()
    assert "  numerics: A {'compute_dtype': 'fp32', 'device': 'cpu', 'engine': 'deepspeed', 'cpu_threads': 1, " \
           "'chunk_tokens': None} | B {'compute_dtype': 'fp32', 'device': 'cpu', 'engine': 'deepspeed', " \
           "'cpu_threads': 3, 'chunk_tokens': None}" in lines
    assert lines[-1] == "verdict: EQUAL within tolerance"

    # --restart recomputes every shard with this run's count, and records it (here over a cache begun with 3;
    # computed with 1: this process runs no multi-threaded region, so the tests' forks stay safe).
    (out / ".ds_capture" / "numerics.json").write_text(json.dumps({**read_numerics(out), "cpu_threads": 3}))
    with pytest.raises(CaptureError, match=r"was begun with 3 CPU threads per rank"):
        run(small_run, out, cpu_threads=1)
    summary = run(small_run, out, restart=True, cpu_threads=1)
    assert summary.shards_written == 2 and read_numerics(out)["cpu_threads"] == 1


def test_verify_and_inspect_of_a_cache_without_the_record(nemo_fixtures: Path) -> None:
    cache = nemo_fixtures / "cache_fp32"
    assert "numerics" not in verify_cache(cache).summary()
    assert ("\nnumerics     not recorded (no .ds_capture/numerics.json: a cache of an earlier version, or NeMo's "
            "own)\n") in format_inspect(inspect_cache(cache))
