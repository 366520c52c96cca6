"""families: every registered family's single-process cache equals an independent Hugging Face computation.

Per family, a tiny random-init checkpoint (``ds_capture.demo.TINY_CONFIGS``, sharded safetensors) is captured
by ``run_capture`` (4 demo rows, S=32, ids ``[-1, 0, 1, 2, 3]``) and compared with
``AutoModelForCausalLM.from_pretrained(...)(output_hidden_states=True)`` (Kimi-K2.5, Qwen3.5 MoE, GLM-5.3: the whole
vision-language model through ``AutoModelForImageTextToText``, vision tower included; Llama 4: that wrapper's inner
causal LM) run row by row on the row's content, so the batched capture (right padding) is checked against every
row forwarded alone (linear-attention and DSA families included):
id ``i`` = ``hidden_states[i+1]``, id ``L-1`` = the post-final-norm state; DeepSeek-V4 hyper-connection states
``[B, S, hc, H]`` are reduced here by their mean over hc (the reference does not use the registry's reducer).
Tolerance (fp32, batched vs per-row forwards): ``max|a-b| <= 1e-5 * max(1, max|a|)``.
Also: the manifest's model type / sizes (Gemma 4: outer model_type, text_config sizes), every refusal's text, the
release wrappers' bytes read (text decoder only), gpt-oss's eager-only attention.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from ds_capture.parallel.shard_spec import build_shard_spec  # noqa: E402
from ds_capture.target.shard_spec import Member  # noqa: E402
from ds_capture.errors import CaptureError
from ds_capture.parallel.layout import build_layout, check_family_layout
from ds_capture.recipe.config import load_config
from ds_capture.runner import run_capture
from ds_capture.target.families import FAMILIES, get_family, read_target_info

SINGLE_FAMILIES = ("qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v4", "glm_moe_dsa", "gemma4", "kimi_k25",
                   "glm4_moe", "qwen3_5_moe", "qwen3_next", "deepseek_v32", "minimax_m2", "kimi_linear", "gpt_oss",
                   "glm5_next", "llama4")
# The reference loads what transformers loads: the vision-language class where there is no causal-LM mapping
# (or the release is that wrapper); Llama 4's wrapper cannot run text only, so its inner causal LM is called.
IMAGE_TEXT = {"kimi_k25", "qwen3_5_moe", "glm5_next", "llama4"}


def reference_model(target: Path, model_type: str) -> torch.nn.Module:
    """The target as ``from_pretrained`` loads it (fp32, eval), callable with ``input_ids`` only."""
    reference_class = AutoModelForImageTextToText if model_type in IMAGE_TEXT else AutoModelForCausalLM
    model = reference_class.from_pretrained(str(target), dtype=torch.float32).eval()
    return model.language_model if model_type == "llama4" else model
LAYER_IDS = [-1, 0, 1, 2, 3]


def randomize_hash_routes(target: Path, seed: int = 0) -> None:
    """Give every hash router (``*.gate.tid2eid``, all zeros after random init) a random token -> experts table."""
    generator = torch.Generator().manual_seed(seed)
    for file in sorted(target.glob("*.safetensors")):
        tensors = load_file(file)
        tables = [key for key in tensors if key.endswith("gate.tid2eid")]
        for key in tables:
            vocab, top_k = tensors[key].shape
            num_experts = json.loads((target / "config.json").read_text())["n_routed_experts"]
            # top_k distinct experts per token, as a real table has
            tensors[key] = torch.rand(vocab, num_experts, generator=generator).argsort(-1)[:, :top_k].contiguous()
        if tables:
            save_file(tensors, file, metadata={"format": "pt"})


def to_release_layout(target: Path) -> None:
    """Rename a DeepSeek-V4 or Kimi-K2.5 checkpoint saved by transformers 5.24 to the release layout.

    DeepSeek-V4: transformers saves ``model.norm.weight``, which its own conversion mapping then renames to
    ``model.kv_norm.weight`` (its ``.norm.`` -> ``.kv_norm.`` rule is meant for the compressor), so such a
    checkpoint does not reload exactly; the release stores base-model keys without the ``model.`` prefix.
    Kimi-K2.5: transformers saves the text layers as ``language_model.model.blocks.N`` (its vision
    ``blocks`` -> ``layers`` rule reversed); the release has ``language_model.model.layers.N``.
    """
    model_type = json.loads((target / "config.json").read_text())["model_type"]
    if model_type == "kimi_k25":
        _rename_keys(target, lambda key: key.replace("language_model.model.blocks.", "language_model.model.layers."))
    elif model_type == "deepseek_v4":
        renames = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
                   "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
        _rename_keys(target, lambda key: renames.get(key.removeprefix("model."), key.removeprefix("model.")))


def _rename_keys(target: Path, rename) -> None:
    """Apply ``rename`` to every checkpoint key, in the safetensors files and the index."""
    for file in sorted(target.glob("*.safetensors")):
        save_file({rename(key): tensor for key, tensor in load_file(file).items()}, file, metadata={"format": "pt"})
    index_path = target / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {rename(key): file for key, file in index["weight_map"].items()}
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True))


@pytest.fixture(scope="module")
def family_target(tmp_path_factory):
    """``family_target(model_type) -> checkpoint dir`` (DeepSeek-V4: hash routes randomised), built once."""
    return family_target_builder(tmp_path_factory.mktemp("family_targets"))


def family_target_builder(root: Path):
    """``make(model_type) -> checkpoint dir`` under ``root``, built once per type: a tiny target with
    DeepSeek-V4's hash routes randomised and its checkpoint in the release layout."""
    from ds_capture.demo import build_tiny_target

    built: dict[str, Path] = {}

    def make(model_type: str) -> Path:
        if model_type not in built:
            built[model_type] = build_tiny_target(root / model_type, model_type, seed=0)
            randomize_hash_routes(built[model_type])
            to_release_layout(built[model_type])
        return built[model_type]

    return make


def _capture(target: Path, out: Path) -> Path:
    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text(yaml.safe_dump({"recipe_args": dict(
        target_model_name_or_path=str(target), train_data_path="demo:conversations", train_split="train[:4]",
        cache_output_dir=str(out), seq_length=32, micro_batch_size=2, cache_shard_size=4, cache_dtype="fp32",
        target_layer_ids=LAYER_IDS)}))
    run_capture(load_config(recipe), show_progress=False)
    return out


def _reference_row(model, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per id in LAYER_IDS, the [n, H] reference feature of one unpadded row, and the post-norm state."""
    with torch.no_grad():
        out = model(input_ids=input_ids[None], output_hidden_states=True, use_cache=False)
    states = out.hidden_states
    num_layers = len(states) - 1
    last = states[num_layers][0]
    assert last.dim() == 2, "the post-final-norm state is [S, H]"

    def feature(layer_id: int) -> torch.Tensor:
        if layer_id == num_layers - 1:
            return last
        hidden = states[layer_id + 1][0]
        return hidden.mean(dim=-2) if hidden.dim() == 3 else hidden  # [S, hc, H]: mean over the streams

    return [feature(i) for i in LAYER_IDS], last


@pytest.mark.parametrize("model_type", SINGLE_FAMILIES)
def test_single_process_cache_equals_hf_hidden_states(family_target, tmp_path, model_type):
    target = family_target(model_type)
    cache = _capture(target, tmp_path / "cache")
    manifest = json.loads((cache / "manifest.json").read_text())
    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config", config)
    assert manifest["target_model_type"] == config["model_type"] == model_type  # the outer one for Gemma 4
    assert (manifest["hidden_size"], manifest["num_hidden_layers"], manifest["target_vocab_size"]) == (
        text["hidden_size"], text["num_hidden_layers"], text["vocab_size"])
    assert manifest["complete"] is True and manifest["target_layer_ids"] == LAYER_IDS

    shard = load_file(cache / "shard-000000.safetensors")
    hidden_size = text["hidden_size"]
    model = reference_model(target, model_type)
    pad_id = config["pad_token_id"] if "pad_token_id" in config else text["pad_token_id"]
    for row, input_ids in enumerate(shard["input_ids"]):
        length = int((input_ids != pad_id).nonzero().max()) + 1  # content = all but the trailing pad run
        features, last = _reference_row(model, input_ids[:length])
        ours = shard["target_hidden_states"][row, :length].split(hidden_size, dim=-1)
        for layer_id, a, b in zip(LAYER_IDS, ours, features):
            tolerance = 1e-5 * max(1.0, a.abs().max().item())
            assert (a - b).abs().max().item() <= tolerance, (model_type, row, layer_id, (a - b).abs().max())
        ours_last = shard["target_last_hidden_states"][row, :length]
        assert (ours_last - last).abs().max().item() <= 1e-5 * max(1.0, ours_last.abs().max().item())
        assert torch.equal(ours[-1], ours_last)


def test_deepseek_v4_hash_routes_are_random_and_used(family_target):
    """The hash layer routes by token id: distinct experts per token, not the all-zero init table."""
    model = AutoModelForCausalLM.from_pretrained(str(family_target("deepseek_v4")), dtype=torch.float32)
    gate = model.model.layers[0].mlp.gate
    assert type(gate).__name__ == "DeepseekV4HashRouter"
    assert len(set(gate.tid2eid[:64].flatten().tolist())) == 8
    assert (gate.tid2eid[:, 0] != gate.tid2eid[:, 1]).all()


def test_gemma4_sizes_come_from_text_config(family_target):
    info = read_target_info(family_target("gemma4"))
    assert (info.model_type, info.hidden_size, info.num_hidden_layers, info.vocab_size) == ("gemma4", 64, 4, 2048)
    assert info.num_experts is None and info.family.text_config_attr == "text_config"


def test_kimi_k25_loads_its_text_decoder_only(family_target):
    """Kimi-K2.5: sizes from text_config; release keys (`language_model.model.layers...`); the vision tower and
    projector are dropped and their weights never read; the sharded loader fills exactly what HF loads."""
    from ds_capture.parallel.single import build_single_model
    from ds_capture.target.loading import build_meta_model, load_owned_parameters

    target = family_target("kimi_k25")
    info = read_target_info(target)
    assert (info.hidden_size, info.num_hidden_layers, info.num_experts, info.vocab_size) == (64, 4, 8, 2048)
    weight_map = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight" in weight_map
    assert not any(key.startswith("language_model.model.blocks.") for key in weight_map)

    single = build_single_model(info, dtype=torch.float32, attn_implementation=None)
    assert single.model.vision_tower is None and single.model.mm_projector is None
    meta = build_meta_model(info, dtype=torch.float32, attn_implementation=None)
    stats = load_owned_parameters(meta, info, build_shard_spec(meta, Member()))
    expected, loaded = single.state_dict(), meta.state_dict()
    assert sorted(expected) == sorted(loaded)
    assert all(torch.equal(expected[name], loaded[name]) for name in expected)
    text_bytes = sum(t.numel() * t.element_size() for name, t in loaded.items() if "rotary" not in name)
    assert stats.bytes_read == text_bytes  # nothing of the vision tower / projector was read
    full = AutoModelForImageTextToText.from_pretrained(str(target), dtype=torch.float32)
    assert sum(p.numel() for p in full.parameters()) > sum(p.numel() for p in meta.parameters())


# ---------------------------------------------------------------------------------------------- refusals


def test_multimodal_only_targets_are_refused():
    with pytest.raises(CaptureError) as caught:
        get_family("minimax_m3_vl")
    assert str(caught.value) == (
        "config.json: model_type 'minimax_m3_vl' is a multimodal-only target: its cache would not be text-only, "
        "which the DSpark cache format (v1) cannot represent. Use a text-only target checkpoint.")


def test_unknown_family_lists_the_supported_ones():
    with pytest.raises(CaptureError) as caught:
        get_family("bloom")
    supported = sorted(name for name, family in FAMILIES.items() if not family.refusal)
    assert str(caught.value) == (f"config.json: model_type 'bloom' is not a supported target family. "
                                 f"Supported: {', '.join(supported)}.")
    assert {"deepseek_v4", "glm_moe_dsa", "gemma4", "mixtral", "qwen3", "deepseek_v3"} <= set(supported)


def _autotp_refusal(what: str, model_type: str) -> str:
    return (f"tp_size 2: DeepSpeed AutoTP mis-shards {what} of model_type '{model_type}' (the sharded forward dies "
            "with shape errors), so this family has no tensor-parallel layout. Keep tp_size 1 and shard the routed "
            "experts with ep_size instead (data parallel x expert parallel).")


@pytest.mark.parametrize("model_type, tp_size, ep_size, message", [
    ("deepseek_v4", 2, 1, None),  # our own plan (AutoTP mis-shards its compressor); its one KV head stays whole
    ("deepseek_v4", 2, 2, None),
    ("glm_moe_dsa", 2, 2, None),  # our own head-parallel MLA plan (AutoTP mis-shards its DSA indexer)
    ("gemma4", 2, 1, None),  # our own head-parallel plan (AutoTP mis-shards its per-layer input gate)
    ("deepseek_v4", 1, 2, None),
    ("glm_moe_dsa", 1, 2, None),
    ("mixtral", 2, 2, None),
    ("gemma4", 1, 1, None),
    ("minimax_m2", 2, 1, _autotp_refusal("the all-head q/k norms (self_attn.q_norm, self_attn.k_norm)", "minimax_m2")),
    ("llama4", 1, 2, "ep_size 2: Llama 4's experts (feed_forward.experts) take every token pre-weighted by its "
                     "router score through all experts densely (no (hidden, top_k_index, top_k_weights) call), "
                     "which the expert-parallel layer cannot split exactly. Keep ep_size 1 (use data parallelism, "
                     "or engine: fsdp2)."),
    ("llama4", 2, 1, "tp_size 2: DeepSpeed AutoTP replaces the router (feed_forward.router, a linear layer returning "
                     "(scores, logits)) of model_type 'llama4' with a plain linear layer, so the sharded forward dies "
                     "unpacking it and this family has no tensor-parallel layout. Keep tp_size 1 and scale with data "
                     "parallelism, or shard every parameter over the ranks with engine: fsdp2."),
    ("qwen3_next", 2, 1, "tp_size 2: DeepSpeed AutoTP column-splits the shared-expert gate (mlp.shared_expert_gate) "
                         "of model_type 'qwen3_next', a linear layer with a single output, which leaves a rank an "
                         "empty shard, so this family has no tensor-parallel layout. Keep tp_size 1 and shard the "
                         "routed experts with ep_size instead (data parallel x expert parallel)."),
    ("gpt_oss", 2, 2, None),  # our own plan: GQA heads with their per-head sinks (AutoTP mis-shards the sinks)
    ("glm5_next", 2, 1, _autotp_refusal("the KDA forget gate (self_attn.forget_gate.f_a_proj, f_b_proj)", "glm5_next")),
    ("glm4_moe", 2, 2, None),
    ("glm5_next", 1, 2, None),
    ("llama4", 1, 1, None),
])
def test_layout_refusals_before_loading(family_target, model_type, tp_size, ep_size, message):
    # The family check runs before the plan's head-count checks (DeepSeek-V4 has one KV head).
    target = read_target_info(family_target(model_type))
    if message is None:
        check_family_layout(target.family, tp_size, ep_size)
        return
    with pytest.raises(CaptureError) as caught:
        check_family_layout(target.family, tp_size, ep_size)
    assert str(caught.value) == message


def test_gemma4_expert_parallel_is_refused_as_dense(family_target):
    target = read_target_info(family_target("gemma4"))
    with pytest.raises(CaptureError) as caught:
        build_layout(world_size=2, rank=0, tp_size=1, ep_size=2, num_experts=target.num_experts,
                   num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads)
    assert str(caught.value) == ("ep_size 2 on a dense target: the model has no routed experts to shard. "
                                 "Set distributed.ep_size to 1.")
    assert get_family("gemma4").ep_refusal == (
        "model_type 'gemma4' is registered as a dense family here: it has no routed experts to shard. Keep ep_size "
        "1 (use tp_size or data parallelism). Gemma 4's MoE variant keeps its experts on the decoder layer itself, "
        "which the expert-parallel layer does not handle.")


@pytest.mark.parametrize("model_type, where, method", [("deepseek_v3", "", "awq"), ("kimi_k25", "text_config.", "gptq"),
                                                      ("qwen3_moe", "", "bitsandbytes"), ("qwen3_moe", "", "mxfp4")])
def test_unsupported_quantization_is_refused_before_loading(family_target, tmp_path, model_type, where, method):
    """Only methods the loader dequantizes (engine/quant.py) pass; the others are named with what is supported."""
    target = tmp_path / model_type
    target.mkdir()
    config = json.loads((family_target(model_type) / "config.json").read_text())
    section = config["text_config"] if where else config
    section["quantization_config"] = {"quant_method": method, "bits": 4}
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CaptureError) as caught:
        read_target_info(target)
    assert str(caught.value) == (
        f"{target / 'config.json'}: {where}quantization_config has quant_method {method!r}, which ds_capture cannot "
        "dequantize. Supported: fp8 (block FP8 with weight_scale_inv / DeepSeek-V4 .scale, FP4 e2m1 experts with "
        "e8m0 scales) and compressed-tensors (pack-quantized symmetric INT4, float-quantized FP8, mxfp4-pack-quantized "
        "MXFP4). Use a release in "
        "one of those formats or a bf16 / fp16 / fp32 checkpoint (if the tensors already are bf16, drop "
        "quantization_config from config.json).")


# ------------------------------------------------------------------------------------ today's drafter targets


@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "glm5_next", "llama4"])
def test_release_wrapper_loads_its_text_decoder_only(family_target, model_type):
    """Released as vision-language wrappers: the sliced loader fills exactly what from_pretrained loads for the
    text decoder, and reads none of the vision tower's bytes (Llama 4: its text model built from text_config,
    the `language_model.` keys stripped, the vision tower and projector keys skipped)."""
    from ds_capture.target.loading import build_meta_model, load_owned_parameters

    target = family_target(model_type)
    info = read_target_info(target)
    weight_map = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    vision = {"qwen3_5_moe": "model.visual.", "glm5_next": "model.visual.", "llama4": "vision_model."}[model_type]
    assert any(key.startswith(vision) for key in weight_map)
    meta = build_meta_model(info, dtype=torch.float32, attn_implementation=None)
    stats = load_owned_parameters(meta, info, build_shard_spec(meta, Member()))
    loaded = meta.state_dict()
    assert not any(name.startswith(vision) or ".visual." in name for name in loaded)
    expected = reference_model(target, model_type).state_dict()
    assert set(loaded) <= set(expected)
    assert all(torch.equal(expected[name], loaded[name]) for name in loaded), model_type
    persistent = {name for name, _ in meta.named_parameters()} | {
        name for module_name, module in meta.named_modules() for name in (
            f"{module_name}.{leaf}" if module_name else leaf for leaf in module._buffers
            if leaf not in module._non_persistent_buffers_set)}
    assert stats.bytes_read == sum(loaded[name].numel() * loaded[name].element_size() for name in persistent)


def test_gpt_oss_computes_eager_attention_only(family_target):
    family = get_family("gpt_oss")
    assert family.resolve_attn_implementation(None) == "eager"
    assert family.resolve_attn_implementation("eager") == "eager"
    with pytest.raises(CaptureError) as caught:
        family.resolve_attn_implementation("sdpa", source="run.yaml")
    assert str(caught.value) == (
        "run.yaml: `recipe_args.target_attn_implementation` 'sdpa': model_type 'gpt_oss' computes attention with "
        "'eager' only (its attention sinks are in transformers' eager attention; sdpa does not support them). Set "
        "it to 'eager' or leave it unset.")
    assert get_family("qwen3").resolve_attn_implementation("sdpa") == "sdpa"  # any, where the family allows any
    from ds_capture.target.loading import build_meta_model

    model = build_meta_model(read_target_info(family_target("gpt_oss")), dtype=torch.float32, attn_implementation=None)
    assert model.config._attn_implementation == "eager"


def test_gpt_oss_sdpa_is_refused_before_loading(family_target, tmp_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text(yaml.safe_dump({"recipe_args": dict(
        target_model_name_or_path=str(family_target("gpt_oss")), train_data_path="demo:conversations",
        train_split="train[:2]", cache_output_dir=str(tmp_path / "cache"), seq_length=16, micro_batch_size=2,
        cache_shard_size=2, target_attn_implementation="sdpa")}))
    with pytest.raises(CaptureError, match=r"run.yaml: `recipe_args.target_attn_implementation` 'sdpa': model_type "
                                           r"'gpt_oss' computes attention with 'eager' only"):
        run_capture(load_config(recipe), show_progress=False)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("raw, expected", [
    ({"model_type": "kimi_linear", "attn_res_block_size": 12}, "kimi_k3"),  # K3's text config alone
    ({"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"]}, "kimi_linear"),  # Kimi-Linear
    ({"model_type": "kimi_k3"}, "kimi_k3"),
    ({"model_type": "deepseek_v41"}, "deepseek_v41"),
])
def test_nemo_built_families_are_registry_entries_dispatched_from_config_json(raw, expected):
    """NeMo's classes build V4.1 and K3 (the nemo extra); K3's text config claims Kimi-Linear's model_type, so its
    K3-only fields decide (transformers' Kimi-Linear otherwise)."""
    from ds_capture.target.families import resolve_model_type

    assert resolve_model_type(raw) == expected
    family = FAMILIES[expected]
    assert family.is_nemo == (expected != "kimi_linear") and not family.refusal
    if family.is_nemo:
        assert not family.supports_tp and family.tp_refusal.startswith(f"model_type {expected!r} is built by NeMo")
