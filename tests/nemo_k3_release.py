"""A tiny random Kimi K3 checkpoint written the way moonshotai/Kimi-K3 is released, from NeMo AutoModel's own classes.

``write_tiny_k3_release(out_dir, seed=...) -> out_dir`` writes

- ``config.json``: the vision-language wrapper (``model_type: kimi_k3``, ``text_config`` of type ``kimi_linear``
  with the release's ``quantization_config``: compressed-tensors ``mxfp4-pack-quantized``, routed experts only);
- ``model.safetensors``: NeMo's ``KimiK3StateDictAdapter.to_hf`` of a random ``KimiK3ForCausalLM`` (4 layers:
  KDA, KDA, KDA, MLA; a dense first layer, then latent MoE with 4 experts; attention residuals in blocks of 2),
  so text keys sit under ``language_model.``, ``A_log`` is zero-padded to 128 heads, KDA's holders are fp32;
  the routed experts MXFP4 (``weight_packed`` / ``weight_scale`` U8, encoded by ``quant_release.quantize_mxfp4``);
  a few ``vision_tower.*`` / ``mm_projector.*`` tensors; with ``extra_layer`` a copy of the last layer as layer
  ``L`` (where a multi-token-prediction block would sit), which a model of ``L`` layers never reads.

No tokenizer: K3's model reads none (unlike DeepSeek-V4.1's Engram). Every tensor is stored in bf16 except the
fp32 ones NeMo keeps fp32 (KDA holders, ``e_score_correction_bias``) and the U8 expert parts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent / "unit"))
import quant_release  # noqa: E402

NUM_LAYERS = 4
NUM_EXPERTS = 4
VISION_TENSORS = {"vision_tower.patch_embed.proj.weight": (32, 3, 14, 14),
                  "vision_tower.encoder.blocks.0.wqkv.weight": (96, 32),
                  "mm_projector.proj.0.weight": (64, 128)}


def tiny_text_config(*, attn_res: bool = True, vocab_size: int = 128, scale: int = 1) -> dict:
    """The text_config: every K3 feature at tiny sizes (experts' in-dims 64: two MXFP4 groups per row). ``scale``
    multiplies every width (hidden, dense / shared / routed expert sizes, MLA's LoRA ranks), so the parameter
    count grows about ``scale**2`` in the same layout; head counts and sizes, layers and experts stay."""
    return dict(
        model_type="kimi_linear", architectures=["KimiK3ForCausalLM"], vocab_size=vocab_size, hidden_size=64 * scale,
        intermediate_size=96 * scale, num_hidden_layers=NUM_LAYERS, num_attention_heads=2,
        moe_intermediate_size=64 * scale, num_experts=NUM_EXPERTS, num_experts_per_token=2, num_shared_experts=1,
        routed_expert_hidden_size=64 * scale, first_k_dense_replace=1, q_lora_rank=32 * scale,
        kv_lora_rank=16 * scale, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
        attn_res_block_size=2 if attn_res else None, latent_moe_use_norm=True, mla_use_output_gate=True,
        linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 3],
                            "full_attn_layers": [4], "use_full_rank_gate": True, "gate_lower_bound": -5.0},
        torch_dtype="bfloat16")


def release_config(text_config: dict, *, quantized: bool) -> dict:
    """The vision-language wrapper around ``text_config``, the release's MXFP4 ``quantization_config`` inside it."""
    fixture = Path(__file__).parent / "fixtures/release_configs/kimi_k3/config.json"
    released = json.loads(fixture.read_text())
    text = dict(text_config)
    if quantized:
        text["quantization_config"] = released["text_config"]["quantization_config"]
    vision = {**released["vision_config"], "vt_hidden_size": 32, "vt_num_hidden_layers": 1,
              "vt_num_attention_heads": 2, "vt_intermediate_size": 64, "mm_hidden_size": 32,
              "text_hidden_size": text["hidden_size"]}
    return {**released, "text_config": text, "vision_config": vision}


def cpu_backend():
    from nemo_automodel.components.models.common import BackendConfig

    return BackendConfig(attn="sdpa", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch",
                         rope="torch", rope_fusion=False, gate_precision="float32")


def build_nemo_k3(raw_config: dict, *, dtype: torch.dtype, device: str = "cpu"):
    """NeMo's ``KimiK3ForCausalLM`` for ``raw_config`` (the wrapper dict) in ``dtype`` (the text config's dtype)."""
    from ds_capture.target.nemo_fla import install_cpu_fla

    install_cpu_fla()
    from nemo_automodel.components.models.kimi_k3.config import KimiK3Config
    from nemo_automodel.components.models.kimi_k3.model import KimiK3ForCausalLM

    text = {k: v for k, v in raw_config["text_config"].items() if k != "model_type"}
    config = KimiK3Config(text_config={**text, "torch_dtype": str(dtype).removeprefix("torch.")},
                          vision_config={k: v for k, v in raw_config["vision_config"].items() if k != "model_type"})
    with torch.device(device):
        return KimiK3ForCausalLM(config, backend=cpu_backend())


def write_tiny_k3_release(out_dir: Path, *, seed: int, quantized: bool = True, attn_res: bool = True,
                          extra_layer: bool = False, tokenizer=None, scale: int = 1) -> Path:
    """Write the tiny release into ``out_dir`` (see the module docstring) and return ``out_dir``. ``tokenizer``:
    saved with it (the vocabulary padded to a multiple of 64), e.g. the demo's ChatML one to capture chat data.
    ``scale``: every width times ``scale`` (:func:`tiny_text_config`), e.g. 16 for a ~300 MB fp32 model whose
    parameter bytes outweigh a process's fixed build cost (benchmarks/nemo_layout_memory.py)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = 128 if tokenizer is None else max(128, 64 * -(-len(tokenizer) // 64))
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    raw = release_config(tiny_text_config(attn_res=attn_res, vocab_size=vocab_size, scale=scale),
                         quantized=quantized)
    torch.manual_seed(seed)
    model = build_nemo_k3(raw, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    released = {}
    for key, tensor in model.state_dict_adapter.to_hf(model.state_dict()).items():
        if quantized and ".block_sparse_moe.experts." in key:
            base = key.removesuffix(".weight")
            for part, stored in quant_release.quantize_mxfp4(tensor.float()).items():
                released[f"{base}.{part}"] = stored
        else:
            released[key] = tensor.contiguous()
    if extra_layer:
        last = f"language_model.model.layers.{NUM_LAYERS - 1}."
        released.update({key.replace(last, f"language_model.model.layers.{NUM_LAYERS}."): tensor.clone()
                         for key, tensor in released.items() if key.startswith(last)})
    for key, shape in VISION_TENSORS.items():
        released[key] = (torch.randn(shape, generator=generator) * 0.2).to(torch.bfloat16)
    save_file(released, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out_dir


def nemo_reference(path: Path, dtype: torch.dtype):
    """NeMo's own load of the release: ``KimiK3ForCausalLM`` on CPU in ``dtype``, the keys its ``to_hf`` asks for,
    ``from_hf`` (a fresh adapter: its MXFP4 decode would otherwise write through views into the model),
    ``load_state_dict``."""
    from nemo_automodel.components.models.kimi_k3.state_dict_adapter import KimiK3StateDictAdapter
    from safetensors.torch import load_file

    raw = json.loads((Path(path) / "config.json").read_text())
    model = build_nemo_k3(raw, dtype=dtype)

    def fresh():
        return KimiK3StateDictAdapter(model.config, model.model.moe_config, model.backend,
                                      dtype=model.state_dict_adapter.dtype)

    wanted = fresh().to_hf(model.state_dict(), quantization="quantization_config" in raw["text_config"])
    stored = load_file(Path(path) / "model.safetensors")
    model.load_state_dict(fresh().from_hf({key: stored[key] for key in wanted}), strict=True)
    return model.eval()
