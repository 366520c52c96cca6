"""Checkpoint tensors that are not part of the model (multi-token-prediction layers) are never read.

Per family that ships them, a tiny release-layout checkpoint gets an MTP block in its own shard file, in the
release's naming: DeepSeek-V3 / GLM ``model.layers.<num_hidden_layers>.*`` (a full decoder block plus
``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head``), DeepSeek-V4 ``mtp.0.*``, Kimi-K2.5 under
``language_model.``; GLM-4.x and DeepSeek-V3.2 as DeepSeek-V3, Qwen3-Next / Qwen3.5 ``mtp.*``. The sharded loader fills exactly what it fills without them, reads exactly the bytes
of the other tensors, and never opens the MTP file.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from test_families import family_target_builder  # noqa: E402

from ds_capture.parallel.shard_spec import build_shard_spec  # noqa: E402
from ds_capture.target.shard_spec import Member  # noqa: E402
from ds_capture.target.families import read_target_info  # noqa: E402
from ds_capture.target.loading import build_meta_model, load_owned_parameters  # noqa: E402

MTP_FILE = "model-mtp.safetensors"


@pytest.fixture(scope="module")
def release_target(tmp_path_factory):
    return family_target_builder(tmp_path_factory.mktemp("mtp_release_targets"))


def add_mtp_layer(target: Path, mtp_prefix: str, last_layer_prefix: str, extra_prefix: str = "") -> list[str]:
    """Write a copy of the last decoder layer as the MTP block ``mtp_prefix`` (+ its MTP-only tensors) into
    ``MTP_FILE`` and list it in the index; returns the added keys."""
    index_path = target / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    tensors = {}
    for file in sorted(target.glob("model-*.safetensors")):
        for key, tensor in load_file(file).items():
            if key.startswith(last_layer_prefix):
                tensors[mtp_prefix + key[len(last_layer_prefix):]] = tensor.clone()
    hidden = next(t for k, t in tensors.items() if k.endswith("norm.weight")).shape[0]
    tensors.update({
        f"{mtp_prefix}enorm.weight": torch.ones(hidden), f"{mtp_prefix}hnorm.weight": torch.ones(hidden),
        f"{mtp_prefix}eh_proj.weight": torch.randn(hidden, 2 * hidden),
        f"{mtp_prefix}shared_head.norm.weight": torch.ones(hidden),
        f"{mtp_prefix}shared_head.head.weight": torch.randn(2048, hidden),
    })
    save_file(tensors, target / MTP_FILE, metadata={"format": "pt"})
    index["weight_map"].update({key: MTP_FILE for key in tensors})
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True))
    return sorted(tensors)


MTP_LAYOUTS = {  # model_type -> (MTP block prefix, the last decoder layer's prefix) in the release's names
    "deepseek_v3": ("model.layers.4.", "model.layers.3."),
    "glm_moe_dsa": ("model.layers.4.", "model.layers.3."),
    "deepseek_v4": ("mtp.0.", "layers.3."),
    "kimi_k25": ("language_model.model.layers.4.", "language_model.model.layers.3."),
    "glm4_moe": ("model.layers.4.", "model.layers.3."),  # GLM-4.5 / 4.6: layer 92 (GLM-4.5-Air: 46)
    "deepseek_v32": ("model.layers.4.", "model.layers.3."),
    "qwen3_next": ("mtp.layers.0.", "model.layers.3."),
    "qwen3_5_moe": ("mtp.layers.0.", "model.language_model.layers.3."),
}


@pytest.mark.parametrize("model_type", sorted(MTP_LAYOUTS))
def test_mtp_tensors_are_never_read(release_target, tmp_path, monkeypatch, model_type):
    source = release_target(model_type)
    target = tmp_path / model_type
    shutil.copytree(source, target)
    added = add_mtp_layer(target, *MTP_LAYOUTS[model_type])
    assert len(added) > 10

    opened: list[str] = []
    real_open = safetensors.safe_open

    def spy(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", spy)
    info = read_target_info(target)
    model = build_meta_model(info, dtype=torch.float32, attn_implementation=None)
    stats = load_owned_parameters(model, info, build_shard_spec(model, Member()))
    assert opened and MTP_FILE not in opened  # the MTP shard was never even opened
    expected = sum(t.numel() * t.element_size() for file in source.glob("model-*.safetensors")
                   for key, t in load_file(file).items()
                   if not re.match(r"(language_model\.)?(model\.)?(vision_tower|mm_projector|visual)", key))
    assert stats.bytes_read == expected

    reference = build_meta_model(read_target_info(source), dtype=torch.float32, attn_implementation=None)
    load_owned_parameters(reference, read_target_info(source), build_shard_spec(reference, Member()))
    ours, theirs = model.state_dict(), reference.state_dict()
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_an_unknown_extra_tensor_still_fails_the_load(release_target, tmp_path):
    """Only the MTP layouts are ignored: any other key the model has no place for is named."""
    from ds_capture.errors import CaptureError

    target = tmp_path / "deepseek_v3"
    shutil.copytree(release_target("deepseek_v3"), target)
    index_path = target / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    save_file({"model.layers.2.mlp.extra_proj.weight": torch.zeros(2, 2)}, target / "model-extra.safetensors")
    index["weight_map"]["model.layers.2.mlp.extra_proj.weight"] = "model-extra.safetensors"
    index_path.write_text(json.dumps(index))
    info = read_target_info(target)
    model = build_meta_model(info, dtype=torch.float32, attn_implementation=None)
    with pytest.raises(CaptureError, match=r"unexpected: model\.layers\.2\.mlp\.extra_proj\.weight"):
        load_owned_parameters(model, info, build_shard_spec(model, Member()))
