"""Meta build + slice loading (what every engine, the world of one included, loads with) equals ``from_pretrained``
exactly; EP ownership reads only this rank's experts.

No process group: expert parallelism is applied with ``ep_group=None`` (the layout only; no forward).
"""

from __future__ import annotations

import pytest
import torch

from ds_capture.parallel.shard_spec import build_shard_spec  # noqa: E402
from ds_capture.target.shard_spec import Member  # noqa: E402
from ds_capture.errors import CaptureError
from ds_capture.parallel.expert_parallel import apply_expert_parallel
from ds_capture.parallel.single import build_single_model, load_with_from_pretrained
from ds_capture.target.families import read_target_info
from ds_capture.target.loading import build_meta_model, load_owned_parameters

FAMILIES = ["qwen3", "qwen3_moe", "deepseek_v3", "mixtral"]
# Built through test_families' builder (release key layouts): their buffers include per-layer-type rotary
# tables (DeepSeek-V4, Gemma 4) and Gemma 4's embedding scale, all computed at load by _init_weights.
# Llama 4 (its text model from text_config, complex rotary table), the other release wrappers, gpt-oss (eager
# attention) and Kimi-Linear (KDA's q/k/v convolutions concatenated at load) as well.
RELEASE_LAYOUT_FAMILIES = ["deepseek_v4", "glm_moe_dsa", "gemma4", "kimi_k25", "llama4", "qwen3_5_moe", "glm5_next",
                           "gpt_oss", "kimi_linear"]


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_meta_build_and_full_load_equal_from_pretrained(tiny_target, model_type, dtype):
    target = read_target_info(tiny_target(model_type, num_hidden_layers=2))
    reference = load_with_from_pretrained(target, dtype=dtype, attn_implementation=None)
    model = build_meta_model(target, dtype=dtype, attn_implementation=None)
    stats = load_owned_parameters(model, target, build_shard_spec(model, Member()))

    _assert_same_model(model, reference, target.vocab_size)
    assert stats.bytes_read == sum(
        t.numel() * t.element_size() for t in _checkpoint_tensors(target.path).values()
    )


@pytest.fixture(scope="module")
def release_target(tmp_path_factory):
    from test_families import family_target_builder

    return family_target_builder(tmp_path_factory.mktemp("release_targets"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", RELEASE_LAYOUT_FAMILIES)
def test_meta_build_fills_config_computed_buffers_as_from_pretrained(release_target, model_type, dtype):
    target = read_target_info(release_target(model_type))
    model = build_meta_model(target, dtype=dtype, attn_implementation=None)
    assert all(t.is_meta for t in model.buffers())
    load_owned_parameters(model, target, build_shard_spec(model, Member()))
    _assert_same_model(model, load_with_from_pretrained(target, dtype=dtype, attn_implementation=None),
                       target.vocab_size)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_tied_embeddings_load_as_from_pretrained(tiny_target, model_type):
    """A tied target (small Qwen3s) stores only the embedding; the lm_head is filled from it."""
    target = read_target_info(tiny_target(model_type, num_hidden_layers=2, tie_word_embeddings=True))
    assert target.tie_word_embeddings
    assert "lm_head.weight" not in _checkpoint_tensors(target.path)
    model = build_single_model(target, dtype=torch.float32, attn_implementation=None)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one tensor after to_empty
    _assert_same_model(model, load_with_from_pretrained(target, dtype=torch.float32, attn_implementation=None),
                       target.vocab_size)


def _assert_same_model(model: torch.nn.Module, reference: torch.nn.Module, vocab_size: int) -> None:
    """Same parameter / buffer names, dtypes and values (none left on meta), and the same logits."""
    expected, actual = _tensors(reference), _tensors(model)
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert not actual[name].is_meta, name
        assert torch.equal(actual[name], tensor), name
    ids = torch.randint(0, vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def _checkpoint_tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for file in sorted(path.glob("*.safetensors")) for k, v in load_file(file).items()}


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_expert_parallel_layout_reads_only_its_experts(tiny_target, model_type):
    target = read_target_info(tiny_target(model_type, num_hidden_layers=2))
    reference = build_single_model(target, dtype=torch.float32, attn_implementation=None)
    on_disk = _checkpoint_tensors(target.path)
    expert_bytes = sum(t.numel() * t.element_size() for k, t in on_disk.items() if ".mlp.experts." in k)
    total_bytes = sum(t.numel() * t.element_size() for t in on_disk.values())

    for ep_rank in range(2):
        model = build_meta_model(target, dtype=torch.float32, attn_implementation=None)
        apply_expert_parallel(model, target.family, ep_group=None, ep_size=2, ep_rank=ep_rank)
        stats = load_owned_parameters(model, target, build_shard_spec(model, Member(ep_rank=ep_rank)))
        read_experts = sum(n for name, n in stats.bytes_by_param.items() if ".mlp.experts." in name)
        assert read_experts == expert_bytes // 2
        assert stats.bytes_read == total_bytes - expert_bytes // 2
        half = target.num_experts // 2
        for name, param in reference.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                mine = model.get_parameter(name)
                assert torch.equal(mine, param[ep_rank * half : (ep_rank + 1) * half]), name
            else:
                assert torch.equal(model.get_parameter(name), param), name


def test_expert_parallel_refuses_a_degree_that_does_not_divide_the_experts(tiny_target):
    target = read_target_info(tiny_target("qwen3_moe", num_hidden_layers=2))
    model = build_meta_model(target, dtype=torch.float32, attn_implementation=None)
    with pytest.raises(CaptureError, match=r"ep_size \(3\) must divide .* \(8\)"):
        apply_expert_parallel(model, target.family, ep_group=None, ep_size=3, ep_rank=0)


def test_a_checkpoint_missing_a_tensor_is_named(tiny_target, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source = tiny_target("qwen3", num_hidden_layers=2)
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    files = sorted(broken.glob("*.safetensors"))
    tensors = load_file(files[0])
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, files[0], metadata={"format": "pt"})
    index_file = broken / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    del index["weight_map"][dropped]
    index_file.write_text(json.dumps(index))
    target = read_target_info(broken)
    model = build_meta_model(target, dtype=torch.float32, attn_implementation=None)
    with pytest.raises(CaptureError, match="missing: " + dropped.replace(".", r"\.")):
        load_owned_parameters(model, target, build_shard_spec(model, Member()))
