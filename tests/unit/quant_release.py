"""Tiny quantized checkpoints in the release layouts, and the same weights dequantized by independent references.

``build_release_pair(root, model_type, scheme) -> (quantized_dir, reference_dir)``:

- a tiny random-init target (``ds_capture.demo``) with ragged dims > 128 (hidden 160, dense MLP 144), its
  checkpoint in the release key layout (``test_families.to_release_layout``: DeepSeek-V4's own names,
  Kimi-K2.5 under ``language_model.``);
- ``quantized_dir``: the release's quantized tensors (below) with ``quantization_config`` in ``config.json``;
  the scales of odd layers sit in their own shard file (``model-scales.safetensors``) and a quantized
  multi-token-prediction block (a copy of the last layer as ``<layers>.<L>`` / V4 ``mtp.0``) in
  ``model-mtp.safetensors``;
- ``reference_dir``: the same keys as the bf16/fp32 release, every quantized tensor replaced by its
  dequantisation with a reference that shares no code with ``ds_capture`` (transformers' ``Fp8Dequantize``
  for block-aligned FP8 and FP4, the ``compressed-tensors`` package for INT4, the loops of
  :func:`reference_fp8_block` for ragged FP8), fp32, and the same (now stale) ``quantization_config``.

Schemes (``../shared/CHECKPOINT_FORMATS.md``): ``fp8`` block FP8 [128, 128] with ``weight_scale_inv``
(fp32 scales; Qwen3: bf16), DeepSeek-V4 ``fp8_fp4`` (``.scale`` e8m0 scales, routed experts FP4 e2m1 +
e8m0 1x32), Kimi ``int4`` (compressed-tensors pack-quantized group 32, routed experts only), ``fp8_channel``
(compressed-tensors float-quantized, per-row ``weight_scale``); :func:`quantize_mxfp4` (Kimi K3's
``mxfp4-pack-quantized`` experts) for one weight at a time.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from test_families import randomize_hash_routes, to_release_layout  # noqa: E402

BLOCK = 128
MTP_FILE, SCALES_FILE = "model-mtp.safetensors", "model-scales.safetensors"
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])

_RAGGED = dict(hidden_size=160, intermediate_size=144)


def _overrides(model_type: str) -> dict:
    from ds_capture.demo import TINY_CONFIGS

    if model_type == "kimi_k25":  # INT4 groups of 32: the experts' input dims are multiples of 32
        return {"text_config": {**TINY_CONFIGS["kimi_k25"]["text_config"], **_RAGGED, "moe_intermediate_size": 64}}
    if model_type == "deepseek_v4":
        return dict(hidden_size=160, moe_intermediate_size=64)
    if model_type == "qwen3_moe":
        return dict(_RAGGED, moe_intermediate_size=48)
    return dict(_RAGGED, moe_intermediate_size=48)


# What each release quantizes (the rest stays as it is: embeddings, lm_head, norms, routers, biases, V4's
# compressors / hc_* / attn_sink, indexer weights_proj, tid2eid).
_KEEP = re.compile(r"(norm|embed|lm_head|head\.weight|\.gate\.weight|weights_proj|indexers_proj|compressor|"
                   r"vision_tower|mm_projector)")
_ROUTED = re.compile(r"\.experts\.\d+\.")


def scheme_of(model_type: str, scheme: str, key: str, tensor: torch.Tensor) -> str | None:
    """The on-disk format of one release tensor: ``fp8`` / ``fp4`` / ``int4`` / ``fp8_channel`` / None."""
    if tensor.dim() != 2 or not key.endswith(".weight") or _KEEP.search(key) or "layers." not in key:
        return None
    if scheme == "int4":
        return "int4" if _ROUTED.search(key) else None
    if scheme == "fp8_fp4":
        return "fp4" if _ROUTED.search(key) else "fp8"
    return scheme


# ------------------------------------------------------------------------------------------ quantizers


def quantize_fp8_block(w: torch.Tensor, scale_dtype: torch.dtype, e8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    grid = (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    scale = torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            amax = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].abs().max().clamp(min=1e-4)
            scale[i, j] = 2.0 ** math.ceil(math.log2(amax / 448.0)) if e8m0 else amax / 448.0
    scale = scale.to(scale_dtype)
    expanded = scale.float().repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return (w / expanded).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest e2m1 code per value, e8m0 scale per 1x32 group, two codes per byte (even column = low nibble)."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-4) / 6.0))
    scale = torch.pow(2.0, exponent)
    values = (groups / scale[..., None]).reshape(rows, cols)
    codes = (values[..., None] - E2M1).abs().argmin(-1).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def quantize_mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors ``mxfp4-pack-quantized`` (Kimi K3's experts): :func:`quantize_fp4`'s codes and scales as
    ``weight_packed`` / ``weight_scale`` U8 (the scale an e8m0 byte, ``2^(byte - 127)``)."""
    packed, scale = quantize_fp4(w)
    return {"weight_packed": packed.view(torch.uint8), "weight_scale": scale.view(torch.uint8)}


def reference_mxfp4(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own ``MXFP4PackedCompressor.decompress``, in fp32."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="float", symmetric=True, strategy="group", group_size=32, scale_dtype=torch.uint8))
    return MXFP4PackedCompressor.decompress(dict(parts), scheme)["weight"].to(torch.float32)


def _ct_scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))


def quantize_int4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' own compressor: ``weight_packed`` int32, ``weight_scale`` bf16, ``weight_shape``."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    rows, cols = w.shape
    scale = (w.reshape(rows, cols // 32, 32).abs().amax(-1).clamp(min=1e-4) / 7.0).to(torch.bfloat16)
    out = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale,
                                                 "weight_zero_point": torch.zeros_like(scale, dtype=torch.int8)},
                                                _ct_scheme())
    return {"weight_packed": out["weight_packed"], "weight_scale": out["weight_scale"],
            "weight_shape": out["weight_shape"].to(torch.int64)}


def quantize_fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(1, keepdim=True).clamp(min=1e-4) / 448.0).to(torch.bfloat16)
    return (w / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn), scale


# ----------------------------------------------------------------------------- independent references


def reference_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """Block by block, ``q[block] * scale[i, j]`` in fp32 (the last block of a dim may be partial)."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = q[rows, cols].to(torch.float32) * scale[i, j].to(torch.float32)
    return out


def transformers_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """transformers 5.24's ``FineGrainedFP8Config(dequantize=True)`` op (block-aligned FP8, FP4 + e8m0)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(q, scale, output_dtype=torch.float32)


def reference_int4(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own decompressor (fp32 scale: the exact products, as the loader's fp32 math)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    state = {"weight_packed": parts["weight_packed"], "weight_scale": parts["weight_scale"].to(torch.float32),
             "weight_shape": parts["weight_shape"]}
    return PackedQuantizationCompressor.decompress(state, _ct_scheme())["weight"]


def reference_fp8_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * scale.to(torch.float32).reshape(-1, 1)


def _aligned(shape) -> bool:
    return all(n % BLOCK == 0 for n in shape)


def quantize(kind: str, w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(on-disk parts by key suffix, the reference dequantisation) of one weight."""
    if kind == "fp8":
        q, scale = quantize_fp8_block(w, scale_dtype, e8m0=scale_dtype == torch.float8_e8m0fnu)
        ref = transformers_dequantize(q, scale) if _aligned(w.shape) else reference_fp8_block(q, scale)
        return {"weight": q, "scale": scale}, ref
    if kind == "fp4":
        q, scale = quantize_fp4(w)
        return {"weight": q, "scale": scale}, transformers_dequantize(q, scale)
    if kind == "int4":
        parts = quantize_int4(w)
        return parts, reference_int4(parts)
    if kind == "mxfp4":
        parts = quantize_mxfp4(w)
        return parts, reference_mxfp4(parts)
    if kind == "fp8_channel":
        q, scale = quantize_fp8_channel(w)
        return {"weight": q, "weight_scale": scale}, reference_fp8_channel(q, scale)
    raise AssertionError(kind)


QUANT_CONFIGS = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "fp8_fp4": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "scale_fmt": "ue8m0"},
    "int4": {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
             "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"]},
    "fp8_channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}}}},
}


def _scale_suffix(model_type: str, scheme: str) -> str:
    return "scale" if model_type == "deepseek_v4" else "weight_scale_inv"


def _scale_dtype(model_type: str, scheme: str) -> torch.dtype:
    if model_type == "deepseek_v4":
        return torch.float8_e8m0fnu
    return torch.bfloat16 if model_type == "qwen3_moe" else torch.float32


_MTP = {"deepseek_v4": ("layers.3.", "mtp.0."), "kimi_k25": ("language_model.model.layers.3.",
                                                            "language_model.model.layers.4.")}


def build_release_pair(root: Path, model_type: str, scheme: str, **sizes) -> tuple[Path, Path]:
    """``sizes``: config overrides on top of the ragged tiny sizes (benchmarks build bigger targets)."""
    from ds_capture.demo import build_tiny_target

    overrides = _overrides(model_type)
    if "text_config" in overrides:  # Kimi-K2.5: the sizes are the text decoder's
        overrides["text_config"] = {**overrides["text_config"], **sizes}
    else:
        overrides.update(sizes)
    source = build_tiny_target(root / "source", model_type, seed=0, **overrides)
    randomize_hash_routes(source)
    to_release_layout(source)
    quantized, reference = root / "quantized", root / "reference"
    for out in (quantized, reference):
        shutil.copytree(source, out)
        for file in out.glob("model*.safetensors*"):
            file.unlink()
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = QUANT_CONFIGS[scheme]
    if scheme == "fp8_fp4":
        config["expert_dtype"] = "fp4"
    for out in (quantized, reference):
        (out / "config.json").write_text(json.dumps(config, indent=2))

    index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    last, mtp = _MTP.get(model_type, ("model.layers.3.", "model.layers.4."))
    q_files: dict[str, dict[str, torch.Tensor]] = {}
    r_files: dict[str, dict[str, torch.Tensor]] = {}
    for file in sorted(set(index.values())):
        for key, tensor in load_file(source / file).items():
            kind = scheme_of(model_type, scheme, key, tensor)
            copies = [(key, file)] + ([(mtp + key[len(last):], MTP_FILE)] if key.startswith(last) else [])
            for target_key, target_file in copies:
                r_files.setdefault(target_file, {})
                if kind is None:
                    q_files.setdefault(target_file, {})[target_key] = tensor
                    r_files[target_file][target_key] = tensor
                    continue
                parts, ref = quantize(kind, tensor, _scale_dtype(model_type, scheme))
                r_files[target_file][target_key] = ref.contiguous()
                base = target_key[: -len(".weight")]
                layer = re.search(r"layers\.(\d+)\.", target_key)
                scale_file = SCALES_FILE if target_file != MTP_FILE and layer and int(layer[1]) % 2 else target_file
                for suffix, part in parts.items():
                    name = f"{base}.{_scale_suffix(model_type, scheme) if suffix == 'scale' else suffix}"
                    dest = scale_file if "scale" in suffix else target_file
                    q_files.setdefault(dest, {})[name] = part.contiguous()
    r_files.pop(MTP_FILE, None)  # the reference has no MTP block: the quantized one's is never read
    for out, files in ((quantized, q_files), (reference, r_files)):
        weight_map = {}
        for file, tensors in files.items():
            save_file(tensors, out / file, metadata={"format": "pt"})
            weight_map.update({key: file for key in tensors})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                     indent=2, sort_keys=True))
    return quantized, reference


def checkpoint_bytes(path: Path, keep=lambda key: True) -> int:
    """Bytes of the tensors of ``path``'s checkpoint whose key passes ``keep``."""
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    return sum(t.numel() * t.element_size() for file in sorted(set(weight_map.values()))
               for key, t in load_file(path / file).items() if keep(key))
