"""cli: run / verify / inspect through ``main(argv)``, exit codes, messages without tracebacks, ``python -m``."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from safetensors.torch import load_file

from ds_capture.cache.dspark.format import Manifest
from ds_capture.cache.dspark.writer import write_shard
from ds_capture.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def good_cache(tiny_target, tmp_path_factory):
    """A cache written by ``ds-capture run`` (tiny qwen3, 6 demo rows, 2 shards)."""
    root = tmp_path_factory.mktemp("cli_cache")
    recipe = root / "recipe.yaml"
    recipe.write_text(
        "recipe_args:\n"
        f"  target_model_name_or_path: {tiny_target('qwen3')}\n"
        "  train_data_path: demo:conversations\n"
        "  train_split: train[:6]\n"
        f"  cache_output_dir: {root / 'cache'}\n"
        "  seq_length: 32\n"
        "  micro_batch_size: 2\n"
        "  cache_shard_size: 4\n"
        "  cache_dtype: fp32\n"
    )
    # --local_rank is what the deepspeed launcher appends: accepted and ignored.
    assert main(["run", "-c", str(recipe), "--no-progress", "--local_rank=0",
                 "--set", "recipe_args.seq_length=24"]) == 0
    return root / "cache"


def writable_copy(cache: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "copy"
    shutil.copytree(cache, dest)
    for path in [dest, *dest.rglob("*")]:
        path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return dest


def test_run_applies_set_overrides(good_cache):
    manifest = json.loads((good_cache / "manifest.json").read_text())
    assert (manifest["seq_length"], manifest["num_samples"], manifest["complete"]) == (24, 6, True)


def test_verify_good_cache_prints_one_line(good_cache, capsys):
    capsys.readouterr()
    assert main(["verify", str(good_cache)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert out.startswith(f"{good_cache}: OK: 6 samples in 2/2 shards checked, ")
    assert main(["verify", str(good_cache), "--checksums"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(
        ", checksums verified; numerics: compute fp32 on cpu, 1 CPU thread per rank, engine deepspeed")


def test_verify_json_parses(good_cache, capsys):
    capsys.readouterr()
    assert main(["verify", str(good_cache), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["ok"], report["problems"], report["num_samples"], report["num_shards"]) == (True, [], 6, 2)
    assert report["cache_dir"] == str(good_cache)


def test_verify_corrupted_copy_exits_1_and_lists_problems(good_cache, tmp_path, capsys):
    cache = writable_copy(good_cache, tmp_path)
    (cache / "shard-000001.safetensors").unlink()
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["complete"] = False
    (cache / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    capsys.readouterr()
    assert main(["verify", str(cache)]) == 1
    lines = capsys.readouterr().out.splitlines()
    rerun = (f"ds-capture run -c {good_cache.parent / 'recipe.yaml'} --set recipe_args.seq_length=24 "
             f"--set recipe_args.cache_output_dir={cache}")  # the run's recorded command, pointed at the copy
    assert lines[0] == f"{cache}: INVALID cache, 2 problem(s):"
    assert lines[1].startswith("  - manifest.json has complete: false") and lines[1].endswith(f"; repair: {rerun}")
    assert lines[2] == ("  - missing shards: shard-000001.safetensors (expected shard-000000 .. "
                        f"shard-000001.safetensors); repair: {rerun}")
    assert main(["verify", str(cache), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and len(report["problems"]) == 2


def test_verify_flipped_shard_byte_is_caught_by_checksums(good_cache, tmp_path, capsys):
    cache = writable_copy(good_cache, tmp_path)
    shard = cache / "shard-000000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # last byte: inside target_last_hidden_states, keeps the header valid
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(cache), "--checksums"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{cache}: INVALID cache, 2 problem(s):"
    repair = (f"ds-capture run -c {good_cache.parent / 'recipe.yaml'} --set recipe_args.seq_length=24 "
              f"--set recipe_args.cache_output_dir={cache} --verify-checksums")
    # The byte also breaks a value rule; its checksum says it changed after it was written: the same repair.
    assert lines[1] == ("  - shard-000000.safetensors: the last feature slice of target_hidden_states (layer 3, the "
                        f"post-norm output) differs from target_last_hidden_states; repair: {repair}")
    assert re.fullmatch(r"  - shard-000000\.safetensors: xxh3-128-rows [0-9a-f]{32} differs from the recorded "
                        r"[0-9a-f]{32}: the file changed after it was written; repair: (.*)", lines[2]).group(1) == repair

    # verify and run no longer disagree silently: a plain rerun keeps the shard (it checks headers and sizes),
    # the printed repair recomputes it.
    assert main(shlex.split(repair)[1:-1] + ["--no-progress"]) == 0
    assert main(["verify", str(cache), "--checksums"]) == 1
    capsys.readouterr()
    assert main(shlex.split(repair)[1:] + ["--no-progress"]) == 0
    assert f"captured 6 samples into {cache}: 1 shards written, 1 already done" in capsys.readouterr().out
    assert main(["verify", str(cache), "--checksums"]) == 0
    assert (cache / "shard-000000.safetensors").read_bytes() == (good_cache / "shard-000000.safetensors").read_bytes()


def test_verify_names_the_repair_of_each_problem(good_cache, tmp_path, capsys):
    """Each INVALID line ends with the command that repairs it: a plain rerun for a missing or truncated shard,
    the shard deleted first where its values are wrong (a rerun's header check keeps it), --restart for the
    weights file of a complete cache (a rerun keeps it), and a placeholder where no command was recorded."""
    cache = writable_copy(good_cache, tmp_path)
    rerun = (f"ds-capture run -c {good_cache.parent / 'recipe.yaml'} --set recipe_args.seq_length=24 "
             f"--set recipe_args.cache_output_dir={cache}")
    shard0, shard1 = cache / "shard-000000.safetensors", cache / "shard-000001.safetensors"
    shard1.write_bytes(shard1.read_bytes()[:-8])
    tensors = load_file(shard0)
    tensors["loss_mask"][0, 0] = 3
    write_shard(cache, 0, tensors, Manifest.from_json((cache / "manifest.json").read_text(), "manifest.json"))
    (cache / "target_weights.safetensors").unlink()
    capsys.readouterr()
    assert main(["verify", str(cache)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.rpartition("; repair: ")[2] for line in lines[1:]] == [
        f"rm {shard0} && {rerun}", rerun, f"{rerun} --restart"], lines
    assert lines[1].startswith("  - shard-000000.safetensors: loss_mask holds values other than 0/1: [3]")
    assert lines[2].startswith("  - shard-000001.safetensors: unreadable safetensors file (")

    (cache / ".ds_capture" / "run_command.json").unlink()  # a cache of an earlier version, or NeMo's own
    assert main(["verify", str(cache)]) == 1
    assert capsys.readouterr().out.splitlines()[2].endswith("; repair: ds-capture run -c <the recipe that wrote it>")


def test_verify_of_a_non_cache_is_exit_1(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path}: INVALID cache, 1 problem(s):\n  - {tmp_path / 'manifest.json'} does not exist")


def test_inspect_prints_samples_tokens_layers(good_cache, capsys):
    capsys.readouterr()
    assert main(["inspect", "--json", str(good_cache)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["samples"], info["shards"], info["layers"], info["dtype"]) == (6, 2, [1, 2, 3], "fp32")
    assert 0 < info["supervised_tokens"] < info["tokens"] <= 6 * 24
    assert main(["inspect", str(good_cache)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"cache        {good_cache} (complete, format v1)"
    assert lines[1] == "samples      6 in 2/2 shards of 4"
    assert lines[3].startswith(f"tokens       {info['tokens']} non-padding (")
    assert lines[5] == "layers       [1, 2, 3] (fp32)"


def test_inspect_of_a_non_cache_is_a_user_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ds-capture inspect: error: {tmp_path / 'manifest.json'} does not exist")
    assert "Traceback" not in err


def test_run_config_error_is_one_message_exit_2(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("recipe_args:\n  seq_length: 1\n")
    assert main(["run", "-c", str(recipe)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"ds-capture run: error: {recipe}: required keys `recipe_args.target_model_name_or_path`, "
        "`recipe_args.train_data_path`, `recipe_args.cache_output_dir` missing. Add them under `recipe_args:`.\n")
    assert captured.out == ""


def test_run_bad_set_is_exit_2(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("recipe_args: {}\n")
    assert main(["run", "-c", str(recipe), "--set", "nonsense"]) == 2
    assert capsys.readouterr().err == (
        "ds-capture run: error: --set 'nonsense': expected dotted.key=value, e.g. "
        "--set recipe_args.seq_length=512.\n")


def test_missing_config_file_is_exit_2(tmp_path, capsys):
    assert main(["run", "-c", str(tmp_path / "none.yaml")]) == 2
    assert capsys.readouterr().err == (
        f"ds-capture run: error: config file {tmp_path / 'none.yaml'} does not exist. Pass the path of a YAML "
        "recipe, e.g. configs/demo.yaml.\n")


def run_module(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-m", "ds_capture", *args], capture_output=True, text=True,
                          env=environment, cwd=REPO, timeout=120)


def test_python_m_help():
    result = run_module("--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: ds-capture ")
    for command in ("run", "verify", "inspect"):
        assert command in result.stdout


def test_python_m_user_error_has_no_traceback(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("recipe_args:\n  cache_dtype: fp8\n")
    result = run_module("run", "-c", str(recipe), "--local_rank=3")
    assert result.returncode == 2
    assert result.stderr.startswith(f"ds-capture run: error: {recipe}: ")
    assert "Traceback" not in result.stderr


def test_a_run_prints_only_its_own_lines_unless_asked_for_more(tiny_target, tmp_path):
    """Other libraries' import noise (with the nemo extra: torchao's "Failed to load ...", "Detected no triton",
    torch's pytree W-lines) is not printed; a warning about the user's own recipe is; --verbose shows the rest."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "recipe_args:\n"
        f"  target_model_name_or_path: {tiny_target('qwen3')}\n"
        "  train_data_path: demo:conversations\n"
        "  train_split: train[:2]\n"
        f"  cache_output_dir: {tmp_path / 'quiet'}\n"
        "  seq_length: 16\n"
        "  cache_shard_size: 2\n"
        "  target_force_hf: true\n"
    )
    environment = {"DS_CAPTURE_LOG_LEVEL": "", "TRANSFORMERS_VERBOSITY": ""}
    quiet = run_module("run", "-c", str(recipe), "--no-progress", **environment)
    assert quiet.returncode == 0, quiet.stderr
    lines = quiet.stderr.splitlines()
    assert [line for line in lines if not line.startswith("[ds_capture] WARNING ")] == [], quiet.stderr
    assert "Failed to load" not in quiet.stderr and "triton" not in quiet.stderr, quiet.stderr
    assert (f"[ds_capture] WARNING {recipe}: `recipe_args.target_force_hf` is a NeMo backend setting; it does not "
            "apply to ds_capture and is ignored.") in lines
    assert any("train_split 'train[:2]' selects 2 of its 300" in line for line in lines), lines
    assert quiet.stdout.startswith(f"captured 2 samples into {tmp_path / 'quiet'}: 1 shards written")

    verbose = run_module("run", "-c", str(recipe), "--no-progress", "--verbose",
                         "--set", f"recipe_args.cache_output_dir={tmp_path / 'verbose'}", **environment)
    assert verbose.returncode == 0, verbose.stderr
    assert set(lines) <= set(verbose.stderr.splitlines())
    if importlib.util.find_spec("torchao") is not None:  # the nemo extra: the noise this test is about
        assert "[torchao] WARNING Failed to load " in verbose.stderr, verbose.stderr
