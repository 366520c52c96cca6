"""``recipe_args.target_num_hidden_layers: N`` (NeMo's reduced-depth diagnostic): only the first N decoder layers
are built and read, single-process and in an expert-parallel layout; the cache equals one captured from a
checkpoint truncated to N layers by hand, and says it is a reduced-depth diagnostic."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from ds_capture.parallel.shard_spec import build_shard_spec  # noqa: E402
from ds_capture.target.shard_spec import Member  # noqa: E402
from ds_capture.cli import main
from ds_capture.errors import CaptureError
from ds_capture.parallel.expert_parallel import apply_expert_parallel
from ds_capture.parallel.single import load_with_from_pretrained
from ds_capture.recipe.config import load_config
from ds_capture.runner import run_capture
from ds_capture.target.families import read_target_info
from ds_capture.target.loading import build_meta_model, load_owned_parameters


def _on_disk(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _layer(key: str) -> int | None:
    parts = key.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else None


def truncated_copy(target: Path, out: Path, n: int) -> Path:
    """An independent reference: the checkpoint with layers >= n deleted and config.json saying n layers."""
    out.mkdir(parents=True)
    kept = {k: v for k, v in _on_disk(target).items() if _layer(k) is None or _layer(k) < n}
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = n
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:n]
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (target / name).is_file():
            shutil.copy(target / name, out / name)
    return out


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_reduced_build_equals_the_truncated_checkpoint_and_reads_only_kept_layers(tiny_target, tmp_path, model_type):
    path = tiny_target(model_type)
    full = read_target_info(path)
    target = full.with_depth(2, source="recipe.yaml")
    assert (target.num_hidden_layers, target.checkpoint_num_hidden_layers) == (2, full.num_hidden_layers) == (2, 4)
    model = build_meta_model(target, dtype=torch.float32, attn_implementation=None)
    assert len(model.model.layers) == 2
    stats = load_owned_parameters(model, target, build_shard_spec(model, Member()))

    on_disk = _on_disk(path)
    kept = {k: t for k, t in on_disk.items() if _layer(k) is None or _layer(k) < 2}
    assert stats.bytes_read == sum(t.numel() * t.element_size() for t in kept.values())
    assert stats.bytes_read < sum(t.numel() * t.element_size() for t in on_disk.values())

    reference = load_with_from_pretrained(read_target_info(truncated_copy(path, tmp_path / "ref", 2)),
                                          dtype=torch.float32, attn_implementation=None)
    ids = torch.randint(0, target.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_expert_parallel_ranks_read_their_experts_of_the_kept_layers_only(tiny_target):
    path = tiny_target("qwen3_moe")
    target = read_target_info(path).with_depth(1, source="recipe.yaml")
    kept = {k: t for k, t in _on_disk(path).items() if _layer(k) is None or _layer(k) < 1}
    expert_bytes = sum(t.numel() * t.element_size() for k, t in kept.items() if ".mlp.experts." in k)
    kept_bytes = sum(t.numel() * t.element_size() for t in kept.values())
    for ep_rank in range(2):
        model = build_meta_model(target, dtype=torch.float32, attn_implementation=None)
        apply_expert_parallel(model, target.family, ep_group=None, ep_size=2, ep_rank=ep_rank)
        stats = load_owned_parameters(model, target, build_shard_spec(model, Member(ep_rank=ep_rank)))
        assert stats.bytes_read == kept_bytes - expert_bytes // 2


@pytest.mark.parametrize("n, message", [
    (0, "recipe_args.target_num_hidden_layers=0 must be in [1, 4]"),
    (5, "recipe_args.target_num_hidden_layers=5 must be in [1, 4]"),
])
def test_depth_out_of_range_is_refused(tiny_target, n, message):
    path = tiny_target("qwen3")
    with pytest.raises(CaptureError) as err:
        read_target_info(path).with_depth(n, source="recipe.yaml")
    assert str(err.value) == f"recipe.yaml: {message} (the checkpoint's depth, {path / 'config.json'})."


def _recipe(tmp_path: Path, target: Path, data: Path, out: Path, **extra) -> Path:
    recipe = tmp_path / f"{out.name}.yaml"
    recipe.write_text(yaml.safe_dump({"recipe_args": dict(
        target_model_name_or_path=str(target), train_data_path=str(data), cache_output_dir=str(out), seq_length=32,
        micro_batch_size=2, cache_shard_size=4, cache_dtype="fp32", **extra)}))
    return recipe


def _data(tmp_path: Path) -> Path:
    data = tmp_path / "data.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def test_reduced_cache_equals_a_capture_of_the_truncated_checkpoint(tiny_target, tmp_path, caplog):
    path, data = tiny_target("qwen3"), _data(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ds_capture"):
        run_capture(load_config(_recipe(tmp_path, path, data, tmp_path / "reduced", target_num_hidden_layers=2)),
                    show_progress=False)
    assert "Reducing the target from 4 to 2 layers (target_num_hidden_layers): diagnostic/CI only, not a usable " \
           "cache." in caplog.text
    truncated = truncated_copy(path, tmp_path / "truncated", 2)
    run_capture(load_config(_recipe(tmp_path, truncated, data, tmp_path / "reference")), show_progress=False)

    ours = json.loads((tmp_path / "reduced" / "manifest.json").read_text())
    ref = json.loads((tmp_path / "reference" / "manifest.json").read_text())
    # NeMo records the reduced depth in num_hidden_layers (its config is mutated); the default ids follow it.
    assert ours["num_hidden_layers"] == 2 and ours["target_layer_ids"] == ref["target_layer_ids"] == [1]
    assert ours["reduced_depth"] == {"target_num_hidden_layers": 2, "checkpoint_num_hidden_layers": 4,
                                     "note": "diagnostic only: the target ran its first layers alone; not a "
                                             "usable cache"}
    assert "reduced_depth" not in ref
    for name in sorted(p.name for p in (tmp_path / "reference").glob("*.safetensors")):
        a, b = (load_file(str(tmp_path / d / name)) for d in ("reduced", "reference"))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_layer_ids_are_checked_against_the_reduced_depth(tiny_target, tmp_path, write_recipe, capsys):
    path, data = tiny_target("qwen3"), _data(tmp_path)
    recipe = _recipe(tmp_path, path, data, tmp_path / "out", target_num_hidden_layers=2, target_layer_ids=[1, 3])
    assert main(["run", "-c", str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == (f"ds-capture run: error: {recipe}: `recipe_args.target_layer_ids` [1, 3] has ids outside -1..1 (3); "
                   "the target has 2 decoder layers (-1 = embeddings, 1 = post-final-norm output).\n")
    assert not (tmp_path / "out").exists()
