"""Quantized checkpoint tensors: which ones are quantized, and how to read and dequantize a slice of one.

In:  the safetensors headers of a checkpoint (key -> dtype, shape; no tensor data) and ``config.json``'s
     ``quantization_config`` (only for the block / group size and to refuse methods we cannot read).
Out: :func:`read_quant_config` -> the block / group sizes (an unsupported ``quant_method`` is refused);
     :func:`logical_keys` -> the checkpoint's keys as the model sees them (``X.weight`` for compressed-tensors'
     ``X.weight_packed``) and the keys that are parts of a quantized weight (scales, shapes, activation
     scales: never model tensors); :func:`plan_quantized` -> a :class:`QuantTensor` per quantized weight the
     model reads, checked against its scale; :func:`read_dequantized` -> this rank's slice of one weight in
     fp32, reading only the stored bytes and the scale blocks that cover the slice; :func:`read_parts` /
     :func:`dequantize` -> the same as stored / decoded later (:mod:`.resident_experts`).

A tensor is quantized iff its dtype is 1-byte / packed *and* it has a scale sibling (never from the key
name or ``config.json``: an offline-converted bf16 checkpoint often keeps a stale ``quantization_config``).
Schemes (``../shared/CHECKPOINT_FORMATS.md``), all ``W = value * scale[r // block_r, c // block_c]``:

  ==============  ==================================  =======================================  ===========
  scheme          stored                              scale                                    block
  ==============  ==================================  =======================================  ===========
  ``fp8_block``   ``X.weight`` F8_E4M3 [out, in]      ``X.weight_scale_inv`` / ``X.scale``     ``weight_block_size``
                                                      (fp32 / bf16 / e8m0) [ceil(out/b), ceil(in/b)]
                                                      or row-wise [out, ceil(in/b)]            (1 x b row-wise)
  ``fp8_channel`` ``X.weight`` F8_E4M3                ``X.weight_scale`` [out, 1] or [1]       1 x in / out x in
  ``fp4``         ``X.weight`` I8 [out, in/2]         ``X.scale`` F8_E8M0 [out, in/32]         1 x 32
                  (e2m1, low nibble = even column)
  ``int4``        ``X.weight_packed`` I32 [out, in/8] ``X.weight_scale`` [out, in/group]       1 x group
                  (+ ``X.weight_shape``; q = nibble - 8, least significant nibble first)
  ``mxfp4``       ``X.weight_packed`` U8 [out, in/2]  ``X.weight_scale`` U8 [out, in/32]       1 x 32
                  (e2m1 as ``fp4``)                   (e8m0 bytes: ``2^(byte - 127)``)
  ==============  ==================================  =======================================  ===========

``mxfp4`` is compressed-tensors' ``mxfp4-pack-quantized`` (Kimi K3's routed experts): the ``fp4`` values and
scales under compressed-tensors' key names, the scale an e8m0 exponent stored as a plain byte. It is decoded by
reinterpreting the byte as ``float8_e8m0fnu``, which equals NeMo's ``dequantize_mxfp4``
(``ldexp(e2m1, byte - 127)``) for every byte but 255 (NaN here, 2^128 there; no real scale is 255).

The loader (:mod:`.loading`) has no scheme branches: it asks :func:`read_dequantized` for a slice.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import torch

from ds_capture.errors import CaptureError

SUPPORTED = (
    "fp8 (block FP8 with weight_scale_inv / DeepSeek-V4 .scale, FP4 e2m1 experts with e8m0 scales) and "
    "compressed-tensors (pack-quantized symmetric INT4, float-quantized FP8, mxfp4-pack-quantized MXFP4)"
)
_SUPPORTED_METHODS = ("fp8", "compressed-tensors")
_SUPPORTED_CT_FORMATS = ("pack-quantized", "float-quantized", "mxfp4-pack-quantized", "dense")
"""Per group; a top-level ``mixed-precision`` defers to the groups' own formats."""

_FP8 = ("F8_E4M3",)
_PACKED_FP4 = ("I8", "U8")
_PACKED = {"I32": "int4", "U8": "mxfp4"}
"""compressed-tensors' ``X.weight_packed`` dtype -> its scheme."""
_MX_GROUP = 32
"""The OCP MX block: one e8m0 scale per 32 values, fixed by the format."""
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4,
          "I32": 4, "I64": 8, "F64": 8, "I16": 2, "BOOL": 1}


@dataclass(frozen=True)
class QuantConfig:
    """What ``config.json`` says that the tensors cannot: the FP8 block and the INT4 group size."""

    method: str | None = None
    block: tuple[int, int] = (128, 128)
    group_size: int = 32


@dataclass(frozen=True)
class QuantTensor:
    """One quantized weight: where its parts are and how one scale entry maps onto it."""

    scheme: str
    """``fp8_block`` | ``fp8_channel`` | ``fp4`` | ``int4`` | ``mxfp4``."""
    key: str
    """The checkpoint key of the stored values (``X.weight`` / ``X.weight_packed``)."""
    scale_key: str
    shape: tuple[int, int]
    """The logical (dequantized) ``[out, in]``."""
    block: tuple[int, int]
    """Logical rows x columns one scale entry covers (the last block of a dim may be partial)."""
    pack: int
    """Logical columns per stored element (1 FP8, 2 FP4, 8 INT4)."""
    file: Path
    scale_file: Path
    """The files holding ``key`` and ``scale_key`` (they may differ: resolved through ``weight_map``)."""
    shape_key: str | None = None
    """compressed-tensors' ``weight_shape`` (int64 ``[out, in]``), read with the values; until then ``shape``
    is the packed width (8 columns per int32 word)."""
    shape_file: Path | None = None


# --------------------------------------------------------------------------------------------- config.json


def quantization_sections(raw: dict) -> list[tuple[str, Any]]:
    """``(where, quantization_config)`` of ``config.json`` and of its ``text_config`` (VL wrappers)."""
    found = []
    for where, section in (("", raw), ("text_config.", raw.get("text_config") or {})):
        quantization = section.get("quantization_config") if isinstance(section, dict) else None
        if quantization:
            found.append((where, quantization))
    return found


def read_quant_config(raw: dict, config_path: Path | str) -> QuantConfig:
    """The block / group sizes of ``raw``'s ``quantization_config``; an unsupported method is a ``CaptureError``.

    Only refuses what cannot be read: whether a tensor is quantized is decided per tensor at load.
    """
    config = QuantConfig()
    for where, quantization in quantization_sections(raw):
        method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else quantization
        if method not in _SUPPORTED_METHODS:
            raise CaptureError(
                f"{config_path}: {where}quantization_config has quant_method {method!r}, which ds_capture cannot "
                f"dequantize. Supported: {SUPPORTED}. Use a release in one of those formats or a bf16 / fp16 / "
                "fp32 checkpoint (if the tensors already are bf16, drop quantization_config from config.json)."
            )
        if method == "compressed-tensors":
            config = _compressed_tensors_config(quantization, f"{config_path}: {where}quantization_config")
        else:
            block = quantization.get("weight_block_size") or (128, 128)
            if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
                raise CaptureError(f"{config_path}: {where}quantization_config.weight_block_size {block!r} is not "
                                   "two positive integers (e.g. [128, 128]).")
            config = QuantConfig(method=method, block=(int(block[0]), int(block[1])))
    return config


def _compressed_tensors_config(quantization: dict, where: str) -> QuantConfig:
    """compressed-tensors: the format may be top-level or per config group (``mixed-precision``)."""
    groups = quantization.get("config_groups") or {}
    top = quantization.get("format")
    formats = {name: (group or {}).get("format") or top for name, group in groups.items()} or {"": top}
    group_size, block = 32, (128, 128)
    for name, fmt in formats.items():
        if fmt not in _SUPPORTED_CT_FORMATS:
            label = f"{where}.config_groups.{name}" if name else where
            raise CaptureError(f"{label}: compressed-tensors format {fmt!r} is not supported. Supported: {SUPPORTED}.")
        weights = ((groups.get(name) or {}).get("weights") or {}) if name else {}
        if fmt == "pack-quantized":
            if weights.get("num_bits") != 4 or weights.get("type", "int") != "int" or not weights.get("symmetric", True):
                raise CaptureError(
                    f"{where}.config_groups.{name}: pack-quantized {weights.get('num_bits')}-bit "
                    f"{weights.get('type')} symmetric={weights.get('symmetric')} is not supported. Supported: {SUPPORTED}."
                )
            group_size = int(weights.get("group_size") or 32)
        if fmt == "mxfp4-pack-quantized" and (weights.get("num_bits", 4), weights.get("type", "float"),
                                              weights.get("group_size", _MX_GROUP)) != (4, "float", _MX_GROUP):
            raise CaptureError(
                f"{where}.config_groups.{name}: mxfp4-pack-quantized with {weights.get('num_bits')}-bit "
                f"{weights.get('type')} weights in groups of {weights.get('group_size')} is not MXFP4 (4-bit float, "
                f"groups of {_MX_GROUP}). Supported: {SUPPORTED}."
            )
        if weights.get("block_structure"):  # float-quantized with strategy block
            block = tuple(int(b) for b in weights["block_structure"])
    return QuantConfig(method="compressed-tensors", block=block, group_size=group_size)


def load_quant_config(checkpoint: Path) -> QuantConfig:
    path = Path(checkpoint) / "config.json"
    return read_quant_config(json.loads(path.read_text()), path)


# ------------------------------------------------------------------------------------------------ planning


def read_headers(files: Iterable[Path]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Checkpoint key -> (safetensors dtype, shape), from the files' JSON headers (no tensor data)."""
    headers = {}
    for path in sorted(set(files)):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for key, entry in header.items():
            if key != "__metadata__":
                headers[key] = (entry["dtype"], tuple(entry["shape"]))
    return headers


def logical_keys(index: dict[str, Path], headers: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[dict[str, Path], frozenset[str]]:
    """(logical key -> the file of its stored values, the keys that are parts of a quantized weight).

    Names and dtypes only, no data and no checks (see :func:`plan_quantized`): ``X.weight_packed`` becomes
    ``X.weight``; a 1-byte ``X.weight``'s scale, compressed-tensors' ``weight_shape`` and activation
    ``input_scale`` are parts, never model tensors. A tensor with no scale keeps its key.
    """
    logical: dict[str, Path] = {}
    parts: set[str] = set()
    for key, path in index.items():
        dtype = headers[key][0]
        if key.endswith(".weight_packed") and dtype in _PACKED:
            base = key[: -len(".weight_packed")]
            logical[f"{base}.weight"] = path
            parts.update(k for k in (key, f"{base}.weight_scale", f"{base}.weight_shape") if k in index)
        elif key.endswith(".weight") and (dtype in _FP8 or dtype in _PACKED_FP4):
            scale_key = _scale_key(index, key)
            parts.update((scale_key,) if scale_key else ())
            logical[key] = path
        elif key.endswith(".input_scale") and f"{key[: -len('.input_scale')]}.weight" in index:
            parts.add(key)  # activation scale of a static-activation FP8 linear: not needed to dequantize
    for key, path in index.items():
        if key not in parts and key not in logical:
            logical[key] = path
    return logical, frozenset(parts)


def has_scale(index: dict[str, Path], headers: dict[str, tuple[str, tuple[int, ...]]], key: str) -> bool:
    """``key`` is a quantized weight that has its scale sibling (1-byte ``X.weight`` or packed ``X.weight_packed``)."""
    if key.endswith(".weight_packed") and headers[key][0] in _PACKED:
        return f"{key[: -len('.weight_packed')]}.weight_scale" in index
    return key.endswith(".weight") and _scale_key(index, key) is not None


def _scale_key(index: dict[str, Path], key: str) -> str | None:
    base = key[: -len(".weight")]
    return next((k for k in (f"{base}.weight_scale_inv", f"{base}.scale", f"{base}.weight_scale") if k in index), None)


def plan_quantized(index: dict[str, Path], headers: dict[str, tuple[str, tuple[int, ...]]], config: QuantConfig,
                   keys: Iterable[str]) -> dict[str, QuantTensor]:
    """The :class:`QuantTensor` of every quantized one of the logical ``keys`` (the ones the model reads), from
    the headers alone (no tensor data is read).

    A 1-byte / packed weight without its scale, or a scale whose shape is not the one the block size gives,
    is a ``CaptureError`` naming the key and its file.
    """
    tensors: dict[str, QuantTensor] = {}
    for logical in sorted(keys):
        packed = logical[: -len(".weight")] + ".weight_packed" if logical.endswith(".weight") else None
        if packed in index and headers[packed][0] == "U8":
            tensors[logical] = _plan_mxfp4(index, headers, packed)
            continue
        if packed in index and headers[packed][0] == "I32":
            base = logical[: -len(".weight")]
            scale_key, shape_key = f"{base}.weight_scale", f"{base}.weight_shape"
            _require(index, packed, scale_key, "compressed-tensors pack-quantized")
            _require(index, packed, shape_key, "compressed-tensors pack-quantized")
            if f"{base}.weight_zero_point" in index:
                raise CaptureError(f"{packed} ({index[packed].name}): asymmetric INT4 (weight_zero_point) is not "
                                   f"supported. Supported: {SUPPORTED}.")
            out, words = headers[packed][1]
            # The logical width is weight_shape[1] (read with the values, at most 7 columns less than packed).
            qt = QuantTensor("int4", packed, scale_key, (out, 8 * words), (1, config.group_size), 8,
                             index[packed], index[scale_key], shape_key, index[shape_key])
            _check_scale(qt, headers[scale_key][1])
            tensors[logical] = qt
            continue
        if logical not in index:
            continue
        dtype, shape = headers[logical]
        if dtype not in _FP8 and dtype not in _PACKED_FP4:
            continue
        scale_key = _scale_key(index, logical)
        if scale_key is None:
            base = logical[: -len(".weight")]
            raise CaptureError(
                f"{logical} ({index[logical].name}): a {dtype} tensor without a scale sibling "
                f"({base}.weight_scale_inv, {base}.scale or {base}.weight_scale). Casting it without its scale "
                "would be silently wrong: the checkpoint is incomplete (check model.safetensors.index.json)."
            )
        tensors[logical] = _classify(logical, dtype, shape, scale_key, headers[scale_key], config, index)
    return tensors


def _plan_mxfp4(index: dict[str, Path], headers: dict[str, tuple[str, tuple[int, ...]]], packed: str) -> QuantTensor:
    """compressed-tensors ``mxfp4-pack-quantized``: two e2m1 codes per byte, one e8m0 byte per 32 columns."""
    scale_key = packed[: -len("_packed")] + "_scale"
    _require(index, packed, scale_key, "compressed-tensors mxfp4-pack-quantized")
    if headers[scale_key][0] != "U8":
        raise CaptureError(f"{scale_key} ({index[scale_key].name}): the scale of the MXFP4 weight {packed} is "
                           f"{headers[scale_key][0]}; mxfp4-pack-quantized stores its e8m0 scales as U8 bytes.")
    out, stored_cols = headers[packed][1]
    qt = QuantTensor("mxfp4", packed, scale_key, (out, 2 * stored_cols), (1, _MX_GROUP), 2, index[packed],
                     index[scale_key])
    _check_scale(qt, headers[scale_key][1])
    return qt


def _classify(key: str, dtype: str, shape: tuple[int, ...], scale_key: str, scale_header: tuple[str, tuple[int, ...]],
              config: QuantConfig, index: dict[str, Path]) -> QuantTensor:
    scale_dtype, scale_shape = scale_header
    if len(shape) != 2:
        raise CaptureError(f"{key} ({index[key].name}): a quantized tensor of shape {list(shape)}; only 2-D "
                           "[out, in] weights are supported.")
    out, stored_cols = shape
    files = (index[key], index[scale_key])
    if dtype in _PACKED_FP4:
        qt = QuantTensor("fp4", key, scale_key, (out, 2 * stored_cols), (1, 32), 2, *files)
        if scale_dtype != "F8_E8M0":
            raise CaptureError(f"{scale_key} ({index[scale_key].name}): the scale of the packed FP4 weight {key} is "
                               f"{scale_dtype}; FP4 e2m1 experts carry float8_e8m0 1x32 scales.")
    elif scale_key.endswith(".weight_scale") and math.prod(scale_shape) in (1, out) and (
            len(scale_shape) < 2 or scale_shape[-1] == 1):
        per_tensor = math.prod(scale_shape) == 1 and out != 1
        qt = QuantTensor("fp8_channel", key, scale_key, (out, stored_cols), (out if per_tensor else 1, stored_cols), 1,
                         *files)
    else:
        qt = QuantTensor("fp8_block", key, scale_key, (out, stored_cols), _fp8_block(config.block, shape, scale_shape),
                         1, *files)
    _check_scale(qt, scale_shape)
    return qt


def _fp8_block(block: tuple[int, int], shape: tuple[int, int], scale_shape: tuple[int, ...]) -> tuple[int, int]:
    """``weight_block_size``, or ``1 x block_c`` where the scale has one row per weight row and the configured
    column blocks (DeepSeek-V4.1's Engram tables: ``[rows, cols / 32]`` scales beside ``weight_block_size
    [32, 32]``). Never ``shape // scale_shape``: that misplaces the scales of ragged dims."""
    out, cols = shape
    grid, rowwise = (-(-out // block[0]), -(-cols // block[1])), (out, -(-cols // block[1]))
    return (1, block[1]) if tuple(scale_shape) == rowwise != grid else block


def scale_grid(qt: QuantTensor) -> tuple[int, int]:
    """The scale shape ``qt``'s block gives: ``[ceil(out / block_r), ceil(in / block_c)]``."""
    return -(-qt.shape[0] // qt.block[0]), -(-qt.shape[1] // qt.block[1])


def _check_scale(qt: QuantTensor, scale_shape: tuple[int, ...]) -> None:
    grid = scale_grid(qt)
    if tuple(scale_shape) != grid and not (qt.scheme == "fp8_channel" and math.prod(scale_shape) == math.prod(grid)):
        what = {"fp8_block": "weight_block_size", "fp4": "the FP4 1x32 group", "int4": "the INT4 group size",
                "fp8_channel": "a per-channel scale", "mxfp4": "the MXFP4 1x32 group"}[qt.scheme]
        raise CaptureError(
            f"{qt.scale_key} ({qt.scale_file.name}): scale shape {list(scale_shape)} does not match "
            f"{what} {list(qt.block)} for the {list(qt.shape)} weight {qt.key} (expected {list(grid)}). Check "
            "quantization_config in config.json against the checkpoint."
        )


def _require(index: dict[str, Path], key: str, sibling: str, scheme: str) -> None:
    if sibling not in index:
        raise CaptureError(f"{key} ({index[key].name}): {scheme} weight without its {sibling}; the checkpoint is "
                           "incomplete (check model.safetensors.index.json).")


# ------------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Region:
    """A logical ``[rows, cols]`` window of a weight: ``start`` / ``stop`` per dim."""

    rows: tuple[int, int]
    cols: tuple[int, int]


def region_of(qt: QuantTensor, dim: int | None, start: int, length: int) -> Region:
    rows, cols = (0, qt.shape[0]), (0, qt.shape[1])
    if dim == 0:
        rows = (start, start + length)
    elif dim == 1:
        cols = (start, start + length)
    elif dim is not None:
        raise CaptureError(f"{qt.key}: a slice on dim {dim} of a 2-D quantized weight.")
    return Region(rows, cols)


def read_dequantized(qt: QuantTensor, region: Region) -> tuple[torch.Tensor, int]:
    """``region`` of ``qt`` dequantized to fp32, and the bytes read (stored values + covering scale blocks).

    Reads the stored elements that cover the region (a packed byte / word holds 2 / 8 columns) and the scale
    blocks that cover it, dequantizes that window and cuts the region out of it.
    """
    qt, num_bytes = resolve_shape(qt)
    if region.cols[1] > qt.shape[1]:  # a whole-width region planned on the packed width
        region = Region(region.rows, (region.cols[0], qt.shape[1]))
    stored, scale, origin, scale_origin = read_parts(qt, region)
    num_bytes += stored.numel() * stored.element_size() + scale.numel() * scale.element_size()
    window = dequantize(qt, stored, scale, origin, scale_origin)
    r0, c0 = region.rows[0] - origin[0], region.cols[0] - origin[1]
    return window[r0 : r0 + region.rows[1] - region.rows[0], c0 : c0 + region.cols[1] - region.cols[0]], num_bytes


def resolve_shape(qt: QuantTensor) -> tuple[QuantTensor, int]:
    """``qt`` with its logical width read from compressed-tensors' ``weight_shape`` (unchanged for the other
    schemes), and the bytes that read."""
    if qt.shape_key is None:
        return qt, 0
    from safetensors import safe_open

    with safe_open(qt.shape_file, framework="pt") as handle:
        shape = handle.get_tensor(qt.shape_key)
    if shape.numel() != 2 or int(shape[0]) != qt.shape[0] or not qt.shape[1] - 8 < int(shape[1]) <= qt.shape[1]:
        raise CaptureError(f"{qt.shape_key} ({qt.shape_file.name}): weight_shape {shape.tolist()} does not fit the "
                           f"packed {qt.key} [{qt.shape[0]}, {qt.shape[1] // 8}].")
    return replace(qt, shape=(qt.shape[0], int(shape[1])), shape_key=None, shape_file=None), \
        shape.numel() * shape.element_size()


def read_parts(qt: QuantTensor, region: Region
               ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int], tuple[int, int]]:
    """The stored elements and scale entries covering ``region``, with the logical origin of each."""
    from safetensors import safe_open

    c_lo, c_hi = region.cols[0] // qt.pack, -(-region.cols[1] // qt.pack)
    with safe_open(qt.file, framework="pt") as handle:
        stored = handle.get_slice(qt.key)[region.rows[0] : region.rows[1], c_lo:c_hi].clone()
    (br, bc) = qt.block
    s_rows = (region.rows[0] // br, -(-region.rows[1] // br))
    s_cols = (region.cols[0] // bc, -(-region.cols[1] // bc))
    with safe_open(qt.scale_file, framework="pt") as handle:
        view = handle.get_slice(qt.scale_key)
        if len(view.get_shape()) == 2:
            scale = view[s_rows[0] : s_rows[1], s_cols[0] : s_cols[1]].clone()
        else:  # a per-tensor [1] / [] or per-channel [out] scale
            scale = handle.get_tensor(qt.scale_key).reshape(scale_grid(qt))[s_rows[0] : s_rows[1], s_cols[0] : s_cols[1]]
            scale = scale.clone()
    return stored, scale, (region.rows[0], c_lo * qt.pack), (s_rows[0], s_cols[0])


def dequantize(qt: QuantTensor, stored: torch.Tensor, scale: torch.Tensor, origin: tuple[int, int] = (0, 0),
               scale_origin: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """fp32 ``value * scale`` of a window of ``qt`` whose first stored element sits at logical ``origin`` and
    whose first scale entry is block ``scale_origin`` (columns past the logical width are cropped)."""
    values = decode(qt.scheme, stored)
    values = values[:, : qt.shape[1] - origin[1]]
    rows = (torch.arange(values.shape[0], device=values.device) + origin[0]) // qt.block[0] - scale_origin[0]
    cols = (torch.arange(values.shape[1], device=values.device) + origin[1]) // qt.block[1] - scale_origin[1]
    if qt.scheme == "mxfp4":  # e8m0 exponents stored as plain bytes
        scale = scale.view(torch.float8_e8m0fnu)
    return values * scale.to(torch.float32)[rows][:, cols]


def decode(scheme: str, stored: torch.Tensor) -> torch.Tensor:
    """The fp32 values of stored elements (FP4 / INT4 unpacked along the last dim, least significant first)."""
    if scheme in ("fp8_block", "fp8_channel"):
        return stored.to(torch.float32)
    if scheme in ("fp4", "mxfp4"):
        nibbles = stored.view(torch.uint8)
        codes = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).flatten(-2).long()
        return torch.tensor(_E2M1, dtype=torch.float32, device=stored.device)[codes]
    if scheme == "int4":
        shifts = torch.arange(0, 32, 4, device=stored.device, dtype=torch.int32)
        codes = (stored.unsqueeze(-1) >> shifts) & 0xF
        return (codes.flatten(-2) - 8).to(torch.float32)
    raise AssertionError(scheme)
