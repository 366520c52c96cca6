"""Kimi K3's release read one logical tensor at a time (ds_capture/target/nemo_k3.py) equals NeMo's whole-dict load.

The release is ``tests/nemo_k3_release.py``'s tiny NeMo K3 (VL wrapper, MXFP4 experts, padded A_log). NeMo's side
is what its checkpoint loader does for the text model: read the keys ``to_hf(model.state_dict(), quantization=...)``
names (so never the vision tower), then ``KimiK3StateDictAdapter.from_hf``; ds_capture's side reads each logical
key through :func:`k3_placement` and :func:`ds_capture.target.quant.read_dequantized` and :func:`place` s it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("nemo_automodel")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from ds_capture.errors import CaptureError  # noqa: E402
from ds_capture.target import quant  # noqa: E402
from ds_capture.target.nemo_k3 import is_kimi_k3, k3_placement, read_k3_layout  # noqa: E402
from ds_capture.target.nemo_release import place  # noqa: E402
from tests.nemo_k3_release import NUM_EXPERTS, NUM_LAYERS, VISION_TENSORS, build_nemo_k3, write_tiny_k3_release  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures/release_configs"
# moonshotai/Kimi-Linear-48B-A3B-Instruct's published config.json (auto_map left out): transformers' Kimi-Linear.
KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"], "bos_token_id": 163584, "dtype": "bfloat16", "eos_token_id": 163586,
    "first_k_dense_replace": 1, "head_dim": 72, "hidden_act": "silu", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "num_heads": 32, "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "model_type": "kimi_linear", "moe_intermediate_size": 1024,
    "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 32,
    "num_expert_group": 1, "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27,
    "num_key_value_heads": 32, "num_nextn_predict_layers": 0, "num_shared_experts": 1, "pad_token_id": 163839,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "transformers_version": "4.57.1", "use_cache": True, "use_grouped_topk": True, "v_head_dim": 128,
    "vocab_size": 163840}


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("k3")
    return {quantized: write_tiny_k3_release(root / f"q{int(quantized)}", seed=3, quantized=quantized,
                                             extra_layer=True)
            for quantized in (True, False)}


def _logical(release: Path):
    path = release / "model.safetensors"
    headers = quant.read_headers([path])
    index = {key: path for key in headers}
    logical, _ = quant.logical_keys(index, headers)
    config = quant.load_quant_config(release)
    return logical, quant.plan_quantized(index, headers, config, logical)


def read_ours(release: Path, model, experts: range | None = None) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """(the model's tensors filled from the release, logical keys read, keys skipped); ``experts``: the experts this
    rank owns (its expert tensors then hold only those, first on dim 0)."""
    raw = json.loads((release / "config.json").read_text())
    targets = {k: v.detach() for k, v in model.state_dict().items()}
    layout = read_k3_layout(raw, targets)
    if experts is not None:
        targets = {k: v[experts.start : experts.stop].clone() if ".experts." in k else v for k, v in targets.items()}
    logical, quantized = _logical(release)
    read, skipped = [], []
    with safe_open(release / "model.safetensors", framework="pt") as handle:
        for key in sorted(logical):
            placement = k3_placement(key, layout)
            if placement is None:
                skipped.append(key)
                continue
            if experts is not None and placement.expert is not None and placement.expert not in experts:
                continue
            read.append(key)
            if key in quantized:
                qt = quantized[key]
                value, _ = quant.read_dequantized(qt, quant.region_of(qt, None, 0, 0))
            else:
                value = handle.get_tensor(key)
            place(targets[placement.native], placement, value, first_expert=experts.start if experts else 0)
    return targets, read, skipped


def read_nemo(release: Path, model) -> dict[str, torch.Tensor]:
    """NeMo's load of the text model: the keys its ``to_hf`` asks for, then ``from_hf`` (a fresh adapter, so its
    MXFP4 decode returns tensors instead of writing through views into the model)."""
    from nemo_automodel.components.models.kimi_k3.state_dict_adapter import KimiK3StateDictAdapter

    raw = json.loads((release / "config.json").read_text())
    quantized = "quantization_config" in raw["text_config"]
    dtype = model.state_dict_adapter.dtype
    fresh = lambda: KimiK3StateDictAdapter(model.config, model.model.moe_config, model.backend, dtype=dtype)  # noqa: E731
    wanted = fresh().to_hf(model.state_dict(), quantization=quantized)
    stored = load_file(release / "model.safetensors")
    return fresh().from_hf({key: stored[key] for key in wanted})


@pytest.mark.parametrize("quantized", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["mxfp4", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_tensor_at_a_time_equals_nemo_from_hf_bitwise(releases, quantized, dtype):
    release = releases[quantized]
    raw = json.loads((release / "config.json").read_text())
    model = build_nemo_k3(raw, dtype=dtype, device="meta").to_empty(device="cpu")
    ours, read, skipped = read_ours(release, model)
    nemo = read_nemo(release, model)
    assert sorted(ours) == sorted(nemo)
    for key, tensor in ours.items():
        # load_state_dict copies NeMo's tensors into the model's: compare in the model's dtype.
        assert torch.equal(tensor, nemo[key].to(tensor.dtype)), key
    holders = [k for k, v in ours.items() if "_fp32_params" in k or "e_score_correction_bias" in k]
    assert holders and all(ours[k].dtype == torch.float32 for k in holders)
    assert all(v.dtype == dtype for k, v in ours.items() if k not in holders)
    deep = f"language_model.model.layers.{NUM_LAYERS}."
    assert sorted(skipped) == sorted([*VISION_TENSORS, *(k for k in _logical(release)[0] if k.startswith(deep))])
    assert any(k.startswith(deep) for k in skipped)


def test_an_expert_subset_reads_only_its_experts(releases):
    release = releases[True]
    raw = json.loads((release / "config.json").read_text())
    model = build_nemo_k3(raw, dtype=torch.bfloat16, device="meta").to_empty(device="cpu")
    full, read_all, _ = read_ours(release, model)
    part, read, _ = read_ours(release, model, experts=range(2, NUM_EXPERTS))
    expert_keys = [k for k in read_all if ".experts." in k]
    assert len(expert_keys) == 3 * NUM_EXPERTS * (NUM_LAYERS - 1)
    assert sorted(read) == sorted(k for k in read_all if ".experts." not in k
                                  or int(k.split(".experts.")[1].split(".")[0]) in (2, 3))
    for key, tensor in part.items():
        assert torch.equal(tensor, full[key][2:4] if ".experts." in key else full[key]), key


def test_an_unknown_key_is_named():
    raw = json.loads((FIXTURES / "kimi_k3/config.json").read_text())
    layout = read_k3_layout(raw, {"model.layers.0.mlp.gate_proj.weight", "lm_head.weight"})
    assert k3_placement("language_model.lm_head.weight", layout).native == "lm_head.weight"
    assert k3_placement("language_model.model.layers.93.mlp.gate_proj.weight", layout) is None
    with pytest.raises(CaptureError) as caught:
        k3_placement("language_model.model.layers.0.mlp.gate_projj.weight", layout)
    assert str(caught.value) == (
        "language_model.model.layers.0.mlp.gate_projj.weight: not a tensor of Kimi K3's release (no "
        "'model.layers.0.mlp.gate_projj.weight' in NeMo's KimiK3ForCausalLM with 93 layers and 896 experts). "
        "Expected language_model.model.* / language_model.lm_head.* and the never-read vision_tower.* / "
        "mm_projector.*: check that the checkpoint is the one config.json describes (num_hidden_layers, num_experts).")
    with pytest.raises(CaptureError, match=r"^model\.norm\.weight: not a tensor of Kimi K3's release \(no "
                                           r"'model\.norm\.weight' in"):
        k3_placement("model.norm.weight", layout)  # the text prefix missing


def test_is_kimi_k3_decides_from_the_raw_config():
    k3 = json.loads((FIXTURES / "kimi_k3/config.json").read_text())
    assert is_kimi_k3(k3)
    assert is_kimi_k3(k3["text_config"])  # the release's own text_config: kimi_linear with K3's fields
    assert not is_kimi_k3(KIMI_LINEAR_48B)
    assert is_kimi_k3({**KIMI_LINEAR_48B, "attn_res_block_size": None})  # a K3 export with residuals off
    assert not is_kimi_k3(json.loads((FIXTURES / "kimi_k2/config.json").read_text()))


def test_a_model_built_on_meta_and_filled_this_way_gives_nemos_logits(releases):
    release = releases[True]
    raw = json.loads((release / "config.json").read_text())
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    for dtype in (torch.float32, torch.bfloat16):
        reference = build_nemo_k3(raw, dtype=dtype)
        reference.load_state_dict(read_nemo(release, reference), strict=True)
        ours = build_nemo_k3(raw, dtype=dtype, device="meta").to_empty(device="cpu")
        read_ours(release, ours)
        with torch.no_grad():
            expected, got = reference.eval()(ids).logits, ours.eval()(ids).logits
        assert expected.abs().max() > 0
        assert torch.equal(got, expected), dtype
