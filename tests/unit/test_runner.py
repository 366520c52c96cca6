"""runner: end-to-end single-process captures: NeMo conformance, idempotent reruns, determinism,
identity refusals, continuation after a crash, and bad data rows refused before anything is written."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import ds_capture.runner as runner
from ds_capture.cache.dspark.format import Manifest
from ds_capture.cache.dspark.writer import write_manifest
from ds_capture.cache.registry import verify_cache
from ds_capture.cli import main
from ds_capture.errors import CaptureError
from ds_capture.recipe.config import load_config
from ds_capture.runner import run_capture

FIXTURE_CACHES = ("cache_fp32", "cache_bf16_plain_masked")
PATH_FIELDS = ("target_model", "train_data_path")
REPO_DATA = Path(__file__).resolve().parents[2] / "ds_capture" / "demo_data" / "conversations.jsonl"


def hash_tree(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``root``, bookkeeping included."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def hash_cache(root: Path) -> dict[str, str]:
    """``hash_tree`` of the cache itself: the contract's files and the shard checksum sidecars.

    Leaves out the run's own logs under ``.ds_capture/`` (timings, metrics), which differ per run.
    """
    return {name: digest for name, digest in hash_tree(root).items()
            if not name.startswith(".ds_capture/") or name.startswith(".ds_capture/checksums/")}


_REAL_FINISH: dict = {}


def patch_finish_shard(monkeypatch, replacement) -> None:
    """Replace ``DSparkShards.finish`` (where the capture loop publishes each shard): ``replacement(self, index,
    shard, real_finish)``."""
    from ds_capture.cache.dspark.writer import DSparkShards

    # A second patch in one test wraps the real method, not the first patch.
    real_finish = _REAL_FINISH.setdefault("finish", DSparkShards.finish)
    monkeypatch.setattr(DSparkShards, "finish", lambda self, index, shard: replacement(self, index, shard, real_finish))


def capture(tmp_dir: Path, name: str = "recipe.yaml", **recipe_args):
    """Write a YAML recipe with ``recipe_args`` into ``tmp_dir``, load it and run it."""
    path = tmp_dir / name
    path.write_text(yaml.safe_dump({"recipe_args": recipe_args}))
    return run_capture(load_config(path), show_progress=False)


def content_mask(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """True before each row's trailing run of ``pad_id`` (the tokens the target attends to)."""
    trailing = (input_ids.flip(1) != pad_id).cumsum(1).flip(1) == 0
    return ~trailing


# ---------------------------------------------------------------------------------------------- NeMo conformance


def nemo_settings(fixtures: Path, name: str) -> dict:
    """The recipe_args matching the producer arguments recorded in ``<name>.nemo_args.json``."""
    argv = json.loads((fixtures / f"{name}.nemo_args.json").read_text())["argv"]
    flags = {argv[i]: argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else True
             for i in range(len(argv)) if argv[i].startswith("--")}
    settings = dict(
        target_model_name_or_path=str(fixtures / flags["--target-model"]),
        train_data_path=str(fixtures / flags["--input-data"]),
        seq_length=int(flags["--seq-length"]),
        micro_batch_size=int(flags["--batch-size"]),
        cache_shard_size=int(flags["--shard-size"]),
        cache_dtype=flags["--dtype"],
        mask_generation_prompt="--mask-generation-prompt" in flags,
        mask_reasoning_content="--mask-reasoning-content" in flags,
    )
    if "--chat-template" in flags:
        settings["chat_template"] = flags["--chat-template"]
    return settings


def test_nemo_settings_read_the_recorded_arguments(nemo_fixtures):
    plain = nemo_settings(nemo_fixtures, "cache_fp32")
    masked = nemo_settings(nemo_fixtures, "cache_bf16_plain_masked")
    assert (plain["seq_length"], plain["micro_batch_size"], plain["cache_shard_size"], plain["cache_dtype"]) == (
        48, 2, 4, "fp32")
    assert (plain["mask_generation_prompt"], plain["mask_reasoning_content"], "chat_template" in plain) == (
        False, False, False)
    assert (masked["cache_dtype"], masked["mask_generation_prompt"], masked["mask_reasoning_content"]) == (
        "bf16", True, True)
    assert "{%- generation %}" not in masked["chat_template"] and "<|im_start|>" in masked["chat_template"]


@pytest.fixture(scope="module")
def conformance_runs(nemo_fixtures, tmp_path_factory):
    """Our cache for each reference cache's settings, with the real engine (compute in the cache dtype)."""
    root = tmp_path_factory.mktemp("conformance")
    out = {}
    for name in FIXTURE_CACHES:
        settings = nemo_settings(nemo_fixtures, name)
        summary = capture(root, f"{name}.yaml", cache_output_dir=str(root / name), **settings)
        assert summary.shards_written == 3
        out[name] = root / name
    return out


def pad_id_of_fixture(nemo_fixtures: Path) -> int:
    from transformers import AutoTokenizer

    pad_id = AutoTokenizer.from_pretrained(str(nemo_fixtures / "target")).pad_token_id
    assert pad_id == 363  # <|endoftext|>, not the eos: every trailing pad is padding
    return pad_id


def assert_matches_reference_exactly(ours: Path, reference: Path) -> None:
    """input_ids, loss_mask, target_weights bit-equal; manifest equal except the two paths and bookkeeping."""
    assert verify_cache(ours).ok, verify_cache(ours).problems
    ours_manifest = json.loads((ours / "manifest.json").read_text())
    ref_manifest = json.loads((reference / "manifest.json").read_text())
    for field in PATH_FIELDS:
        ours_manifest.pop(field), ref_manifest.pop(field)
    assert "producer" in set(ours_manifest) - set(ref_manifest)  # bookkeeping: extra fields readers allow
    assert {k: ours_manifest[k] for k in ref_manifest} == ref_manifest
    assert sorted(p.name for p in ours.glob("*.safetensors")) == sorted(p.name for p in reference.glob("*.safetensors"))
    ours_weights, ref_weights = load_file(ours / "target_weights.safetensors"), load_file(
        reference / "target_weights.safetensors")
    assert ours_weights.keys() == ref_weights.keys()
    for key in ref_weights:
        assert ours_weights[key].dtype == ref_weights[key].dtype and torch.equal(ours_weights[key], ref_weights[key])
    for index in range(3):
        a, b = (load_file(d / f"shard-{index:06d}.safetensors") for d in (ours, reference))
        assert a.keys() == b.keys()
        for key in ("input_ids", "loss_mask"):
            assert a[key].dtype == torch.int64 and torch.equal(a[key], b[key]), (index, key)
        for key in ("target_hidden_states", "target_last_hidden_states"):
            assert (a[key].shape, a[key].dtype) == (b[key].shape, b[key].dtype)


def test_fp32_cache_conforms_to_nemo(nemo_fixtures, conformance_runs):
    ours, reference = conformance_runs["cache_fp32"], nemo_fixtures / "cache_fp32"
    assert_matches_reference_exactly(ours, reference)
    pad_id = pad_id_of_fixture(nemo_fixtures)
    for index in range(3):
        a, b = (load_file(d / f"shard-{index:06d}.safetensors") for d in (ours, reference))
        content = content_mask(b["input_ids"], pad_id)
        assert content.sum() > 0 and (~content).sum() > 0  # both kinds of position exist
        for key in ("target_hidden_states", "target_last_hidden_states"):
            # 1e-5 relative to each token's feature scale: the residual stream reaches |28| here (one fp32
            # ulp: 1.9e-6) and single elements near 0 are sums of large terms; NeMo ran transformers 5.18,
            # whose kernels sum in another order. Seen: max |diff| / max |value| per token = 1.6e-6.
            x = a[key][content].unflatten(-1, (-1, 64))
            y = b[key][content].unflatten(-1, (-1, 64))
            scaled = (x - y).abs().amax(dim=-1) / y.abs().amax(dim=-1)
            assert scaled.max() < 1e-5, (index, key, scaled.max())


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 significant bits)."""
    x = x.float().abs().clamp_min(2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(x)) - 7)


def test_bf16_cache_conforms_to_nemo(nemo_fixtures, conformance_runs):
    ours, reference = conformance_runs["cache_bf16_plain_masked"], nemo_fixtures / "cache_bf16_plain_masked"
    assert_matches_reference_exactly(ours, reference)
    pad_id = pad_id_of_fixture(nemo_fixtures)
    for index in range(3):
        a, b = (load_file(d / f"shard-{index:06d}.safetensors") for d in (ours, reference))
        content = content_mask(b["input_ids"], pad_id)
        for key in ("target_hidden_states", "target_last_hidden_states"):
            # NeMo's reference ran the target in fp32 and cast the states to bf16; we run it in bf16, so
            # each of the 4 layers adds bf16 rounding (eps 2^-8 = 0.4%). Measured: per-token relative error
            # <= 4.1%; a wrong layer or a wrong position is off by 30-140%. Bound: 8%, ~20 bf16 eps.
            x = a[key][content].float().unflatten(-1, (-1, 64))
            y = b[key][content].float().unflatten(-1, (-1, 64))
            relative = (x - y).norm(dim=-1) / y.norm(dim=-1)
            assert relative.max() < 0.08, (index, key, relative.max())


def test_bf16_cast_of_an_fp32_forward_matches_nemo_to_one_ulp(nemo_fixtures, tmp_path, monkeypatch):
    """Run the target in fp32 as NeMo's reference producer did: the bf16 cast then differs by <= 1 ulp."""
    build_model = runner.build_model

    def build_fp32(*args, dtype, **kwargs):
        return build_model(*args, dtype=torch.float32, **kwargs)

    monkeypatch.setattr(runner, "build_model", build_fp32)
    settings = nemo_settings(nemo_fixtures, "cache_bf16_plain_masked")
    capture(tmp_path, cache_output_dir=str(tmp_path / "out"), **settings)
    reference = nemo_fixtures / "cache_bf16_plain_masked"
    assert_matches_reference_exactly(tmp_path / "out", reference)
    pad_id = pad_id_of_fixture(nemo_fixtures)
    for index in range(3):
        a, b = (load_file(d / f"shard-{index:06d}.safetensors") for d in (tmp_path / "out", reference))
        content = content_mask(b["input_ids"], pad_id)
        for key in ("target_hidden_states", "target_last_hidden_states"):
            x, y = a[key][content].float(), b[key][content].float()
            # fp32 values within ~1e-5 of each other round to the same bf16 value or a neighbour.
            assert ((x - y).abs() <= torch.maximum(bf16_ulp(x), bf16_ulp(y))).all(), (index, key)


# ---------------------------------------------------------------------------------------------- tiny targets


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_tiny_target_cache_passes_verify(tiny_target, tmp_path, model_type):
    target = tiny_target(model_type)
    summary = capture(tmp_path, target_model_name_or_path=str(target), train_data_path="demo:conversations",
                      train_split="train[:10]", cache_output_dir=str(tmp_path / "out"), seq_length=32,
                      micro_batch_size=2, cache_shard_size=4, cache_dtype="fp32")
    report = verify_cache(tmp_path / "out", checksums=True)
    assert report.ok, report.problems
    assert (report.num_samples, report.num_shards, report.num_shards_checked) == (10, 3, 3)
    assert (summary.num_samples, summary.num_shards, summary.shards_written, summary.shards_skipped) == (10, 3, 3, 0)
    assert summary.num_tokens == report.num_tokens
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["target_model_type"] == model_type and manifest["complete"] is True
    assert (manifest["target_layer_ids"], manifest["target_hidden_dim"]) == ([1, 2, 3], 3 * 64)
    assert (manifest["train_data_path"], manifest["train_split"]) == ("demo:conversations", "train[:10]")
    shard = load_file(tmp_path / "out" / "shard-000000.safetensors")
    assert torch.equal(shard["target_hidden_states"][..., -64:], shard["target_last_hidden_states"])


@pytest.fixture(scope="module")
def base_run(tiny_target, tmp_path_factory):
    """One uninterrupted capture (tiny qwen3, 10 demo rows, 3 shards) and its recipe args."""
    root = tmp_path_factory.mktemp("base_run")
    args = dict(target_model_name_or_path=str(tiny_target("qwen3")), train_data_path="demo:conversations",
                train_split="train[:10]", cache_output_dir=str(root / "cache"), seq_length=32, micro_batch_size=2,
                cache_shard_size=4, cache_dtype="fp32")
    capture(root, **args)
    return root / "cache", args


def test_rerun_into_the_same_dir_changes_no_byte(base_run, tmp_path, monkeypatch):
    cache, args = base_run
    work = tmp_path / "cache"
    shutil.copytree(cache, work)
    before = hash_cache(work)
    assert "manifest.json" in before and len(before) == 8  # manifest, weights, 3 shards, 3 checksum sidecars
    builds = []
    real_build = runner.build_model
    monkeypatch.setattr(runner, "build_model", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    summary = capture(tmp_path, **{**args, "cache_output_dir": str(work)})
    assert (summary.shards_written, summary.shards_skipped) == (0, 3)
    assert hash_cache(work) == before
    assert builds == []  # nothing to compute: the model is never loaded


def test_rerun_over_a_partial_cache_loads_the_model(base_run, tmp_path, monkeypatch):
    cache, args = base_run
    work = tmp_path / "cache"
    shutil.copytree(cache, work)
    # As a run killed before its last shard leaves it: complete=false, a shard (and its sidecar) missing.
    manifest = json.loads((work / "manifest.json").read_text())
    (work / "manifest.json").write_text(json.dumps({**manifest, "complete": False}, indent=2, sort_keys=True))
    for path in work.glob("shard-000001.*"):
        path.unlink()
    builds = []
    real_build = runner.build_model
    monkeypatch.setattr(runner, "build_model", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    summary = capture(tmp_path, **{**args, "cache_output_dir": str(work)})
    assert (summary.shards_written, summary.shards_skipped, len(builds)) == (1, 2, 1)
    assert verify_cache(work, checksums=True).ok


def test_a_fresh_dir_gets_byte_identical_files(base_run, tmp_path):
    cache, args = base_run
    capture(tmp_path, **{**args, "cache_output_dir": str(tmp_path / "again")})
    assert hash_cache(tmp_path / "again") == hash_cache(cache)


IDENTITY_CHANGES = [
    # (recipe_args changes, fields named by the refusal)
    ({"seq_length": 48}, ["seq_length"]),
    ({"cache_dtype": "bf16"}, ["dtype"]),
    ({"cache_shard_size": 8}, ["shard_size"]),
    ({"train_split": "train[:6]"}, ["num_samples", "train_split"]),
    ({"target_layer_ids": [0, 1, 3]}, ["target_layer_ids"]),
    ({"target_layer_ids": [1, 3]}, ["target_hidden_dim", "target_layer_ids"]),
    ({"shuffle_seed": 7}, ["shuffle_seed"]),
    ({"mask_reasoning_content": True}, ["mask_reasoning_content"]),
    ({"mask_generation_prompt": True}, ["mask_generation_prompt"]),
    ({"draft_num_hidden_layers": 2}, ["target_hidden_dim", "target_layer_ids"]),
    ({"chat_template": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"},
     ["chat_template_sha256"]),
]


def refused_fields(message: str) -> list[str]:
    details = message.split(" holds a different cache: ", 1)[1].split(". Use a new cache_output_dir", 1)[0]
    return sorted(part.split(" is ", 1)[0] for part in details.split("; "))


@pytest.mark.parametrize("changes, fields", IDENTITY_CHANGES, ids=lambda v: ",".join(v) if isinstance(v, list) else None)
def test_each_identity_field_is_refused_without_touching_the_dir(base_run, tmp_path, changes, fields):
    cache, args = base_run
    work = tmp_path / "cache"
    shutil.copytree(cache, work)
    before = hash_tree(work)
    with pytest.raises(CaptureError) as caught:
        capture(tmp_path, **{**args, "cache_output_dir": str(work), **changes})
    message = str(caught.value)
    assert message.startswith(f"{work} holds a different cache: ")
    assert message.endswith(
        f". Use a new cache_output_dir or delete {work} to recompute it (nothing in it was changed).")
    assert refused_fields(message) == sorted(fields)
    assert hash_tree(work) == before


def test_identity_refusal_message_shows_both_values(base_run, tmp_path):
    cache, args = base_run
    work = tmp_path / "cache"
    shutil.copytree(cache, work)
    with pytest.raises(CaptureError) as caught:
        capture(tmp_path, **{**args, "cache_output_dir": str(work), "seq_length": 48})
    assert str(caught.value) == (
        f"{work} holds a different cache: seq_length is 32 there, 48 in this run. Use a new cache_output_dir or "
        f"delete {work} to recompute it (nothing in it was changed).")


@pytest.mark.parametrize("kind", ["target_model", "train_data_path"])
def test_paths_are_identity_too(base_run, tmp_path, kind):
    cache, args = base_run
    work = tmp_path / "cache"
    shutil.copytree(cache, work)
    before = hash_tree(work)
    if kind == "target_model":
        (tmp_path / "same_target").symlink_to(args["target_model_name_or_path"])
        changes = {"target_model_name_or_path": str(tmp_path / "same_target")}
    else:
        from ds_capture.demo import demo_data_path

        shutil.copy(demo_data_path(), tmp_path / "same.jsonl")
        changes = {"train_data_path": str(tmp_path / "same.jsonl")}
    with pytest.raises(CaptureError) as caught:
        capture(tmp_path, **{**args, "cache_output_dir": str(work), **changes})
    assert refused_fields(str(caught.value)) == [kind]
    assert hash_tree(work) == before


def test_a_crashed_run_is_continued_to_the_same_bytes(base_run, tmp_path, monkeypatch):
    cache, args = base_run
    work = tmp_path / "cache"
    written = []

    def write_one_then_crash(self, index, shard, real_finish):
        if written:
            raise RuntimeError("simulated crash")
        written.append(index)
        return real_finish(self, index, shard)

    patch_finish_shard(monkeypatch, write_one_then_crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        capture(tmp_path, **{**args, "cache_output_dir": str(work)})
    assert json.loads((work / "manifest.json").read_text())["complete"] is False
    assert sorted(p.name for p in work.glob("shard-*")) == ["shard-000000.safetensors"]
    assert not verify_cache(work).ok

    calls = []
    patch_finish_shard(monkeypatch, lambda self, index, shard, real: calls.append(index) or real(self, index, shard))
    summary = capture(tmp_path, **{**args, "cache_output_dir": str(work)})
    assert calls == [1, 2]
    assert (summary.shards_written, summary.shards_skipped) == (2, 1)
    assert hash_cache(work) == hash_cache(cache)


def test_a_deleted_shard_of_an_incomplete_cache_is_recomputed(base_run, tmp_path, monkeypatch):
    cache, args = base_run
    work = tmp_path / "cache"
    shutil.copytree(cache, work)
    (work / "shard-000001.safetensors").unlink()
    manifest = Manifest.from_json((work / "manifest.json").read_text(), "manifest.json")
    write_manifest(work, manifest.with_complete(False))
    calls = []
    patch_finish_shard(monkeypatch, lambda self, index, shard, real: calls.append(index) or real(self, index, shard))
    summary = capture(tmp_path, **{**args, "cache_output_dir": str(work)})
    assert calls == [1]
    assert (summary.shards_written, summary.shards_skipped) == (1, 2)
    assert hash_cache(work) == hash_cache(cache)


# ---------------------------------------------------------------------------------------------- bad rows

GOOD_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize("lines, expected", [
    ([json.dumps(GOOD_ROW), '{"messages": [}'],
     "{data} line 2: not valid JSON (Expecting value at column 15). Each line of a JSONL file must be one JSON "
     "object; fix or delete this line."),
    ([json.dumps({"text": "hi"})],
     "{data} line 1: row has neither a `messages` list (OpenAI format) nor a `conversations` list (ShareGPT "
     "format). Add one of them, or remove the row."),
    ([json.dumps(GOOD_ROW), json.dumps({"messages": [{"role": "robot", "content": "x"}]})],
     "{data} line 2: message 1 has unknown role 'robot'. Valid roles: system, user, assistant, tool."),
    ([json.dumps({"messages": [{"role": "system", "content": "a"}, {"role": "system", "content": "b"},
                               {"role": "user", "content": "c"}]})],
     "{data} line 1: message 2 is a second system message. NeMo AutoModel supports one system message per "
     "conversation; merge the system messages into one."),
    ([json.dumps(GOOD_ROW), json.dumps(GOOD_ROW), json.dumps({"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]})],
     "{data} line 3: message 2 (assistant): `tool_calls[0].function.arguments` is required (use \"{{}}\" for a "
     "call without arguments)."),
    ([],
     "{data}: the dataset has no rows. Add rows to the dataset or widen the split."),
], ids=["malformed_json", "no_messages", "unknown_role", "two_system", "tool_call_without_arguments", "empty"])
def test_bad_rows_exit_2_and_write_nothing(tiny_target, write_recipe, tmp_path, capsys, lines, expected):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(line + "\n" for line in lines))
    out = tmp_path / "out"
    recipe = write_recipe({"recipe_args": dict(
        target_model_name_or_path=str(tiny_target("qwen3")), train_data_path=str(data), cache_output_dir=str(out),
        seq_length=32, micro_batch_size=2, cache_shard_size=4, cache_dtype="fp32")})
    capsys.readouterr()
    assert main(["run", "-c", str(recipe), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "ds-capture run: error: " + expected.format(data=data) + "\n"
    assert "Traceback" not in captured.err + captured.out
    assert not out.exists()


def test_bad_row_leaves_an_existing_cache_unchanged(base_run, tmp_path, write_recipe, capsys):
    cache, args = base_run
    work = tmp_path / "cache"
    shutil.copytree(cache, work)
    before = hash_tree(work)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    recipe = write_recipe({"recipe_args": {**args, "cache_output_dir": str(work), "train_data_path": str(data),
                                           "train_split": None}})
    assert main(["run", "-c", str(recipe), "--no-progress"]) == 2
    assert "line 1: message 1 has unknown role 'robot'" in capsys.readouterr().err
    assert hash_tree(work) == before


# ------------------------------------------------------------------------------- capture.invalid_rows: skip

BAD_LINES = {  # line number -> (the line's bytes, the refusal it gives)
    2: (b'{"messages": [}', "{data} line 2: not valid JSON (Expecting value at column 15). Each line of a JSONL "
                            "file must be one JSON object; fix or delete this line."),
    4: (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(),
        "{data} line 4: message 1 has unknown role 'robot'. Valid roles: system, user, assistant, tool."),
    7: (b'{"messages": "caf\xe9"}', "{data} line 7: not valid UTF-8 (byte 0xe9 at byte {offset} of the file). "
                                    "Datasets must be UTF-8 text; re-encode the file (e.g. iconv -f <encoding> -t "
                                    "utf-8) or delete the line."),
}


def test_invalid_rows_skip_captures_the_valid_rows_and_lists_the_others(tiny_target, write_recipe, tmp_path, capsys):
    """``capture.invalid_rows: skip``: the cache holds exactly what a run over the valid rows alone writes (NeMo
    reads it, num_samples the valid count), the summary counts the skipped rows, skipped_rows.json lists each with
    the refusal's own words (``refuse`` gives the first of them), and the setting is part of the cache's identity."""
    good = [line.encode() for line in (REPO_DATA.read_text().splitlines()[:7])]
    lines, clean, bad_offsets = [], [], {}
    for number in range(1, 11):
        if number in BAD_LINES:
            bad_offsets[number] = sum(len(line) + 1 for line in lines)
            lines.append(BAD_LINES[number][0])
        else:
            lines.append(good[len(clean)])
            clean.append(lines[-1])
    data, clean_data = tmp_path / "data.jsonl", tmp_path / "clean.jsonl"
    data.write_bytes(b"".join(line + b"\n" for line in lines))
    clean_data.write_bytes(b"".join(line + b"\n" for line in clean))
    reasons = [BAD_LINES[n][1].format(data=data, offset=bad_offsets[n] + 17) for n in sorted(BAD_LINES)]
    args = dict(target_model_name_or_path=str(tiny_target("qwen3")), seq_length=32, micro_batch_size=2,
                cache_shard_size=4, cache_dtype="fp32")
    out, reference = tmp_path / "skip", tmp_path / "reference"
    recipe = write_recipe({"recipe_args": {**args, "train_data_path": str(data), "cache_output_dir": str(out)}})

    capsys.readouterr()
    assert main(["run", "-c", str(recipe), "--no-progress"]) == 2  # refuse (the default) names the first bad row
    assert capsys.readouterr().err == f"ds-capture run: error: {reasons[0]}\n"
    assert main(["run", "-c", str(recipe), "--no-progress", "--set", "capture.invalid_rows=skip"]) == 0
    summary = capsys.readouterr().out
    assert summary.startswith(f"captured 7 samples into {out}: 2 shards written")
    assert summary.endswith("; 3 invalid rows skipped (listed in .ds_capture/skipped_rows.json)\n")
    assert json.loads((out / ".ds_capture" / "skipped_rows.json").read_text()) == {"num_rows_skipped": 3, "rows": [
        {"line": n, "where": f"{data} line {n}", "reason": reason} for n, reason in zip(sorted(BAD_LINES), reasons)]}

    clean_recipe = write_recipe({"recipe_args": {**args, "train_data_path": str(clean_data),
                                                 "cache_output_dir": str(reference)}}, name="clean.yaml")
    assert main(["run", "-c", str(clean_recipe), "--no-progress"]) == 0
    shards = sorted(p.name for p in out.glob("shard-*"))
    assert shards == sorted(p.name for p in reference.glob("shard-*")) and len(shards) == 2
    for name in shards:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    assert json.loads((out / "manifest.json").read_text())["num_samples"] == 7
    assert verify_cache(out).ok
    try:
        from nemo_automodel.components.datasets.llm.dspark_cache import CachedDSparkDataset
    except ImportError:
        CachedDSparkDataset = None  # the nemo extra is absent: the byte equality above stands for it
    if CachedDSparkDataset is not None:
        assert len(CachedDSparkDataset(str(out))) == 7

    # Identity: an unfinished cache started under one setting refuses the other (nothing touched).
    manifest_path = reference / "manifest.json"
    write_manifest(reference, Manifest.from_json(manifest_path.read_text(), str(manifest_path)).with_complete(False))
    before = hash_tree(reference)
    capsys.readouterr()
    assert main(["run", "-c", str(clean_recipe), "--no-progress", "--set", "capture.invalid_rows=skip"]) == 2
    assert capsys.readouterr().err == (
        f"ds-capture run: error: {reference} was started with capture.invalid_rows: refuse, and this run has "
        "capture.invalid_rows: skip: the two settings choose different rows of the dataset, so their shards cannot "
        "be mixed. Set capture.invalid_rows back to refuse to continue this cache, use a new cache_output_dir, or "
        "pass --restart to recompute every shard with the new setting.\n")
    assert hash_tree(reference) == before
