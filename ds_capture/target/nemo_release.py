"""Where one release tensor goes in a NeMo-built model, and reading one release tensor: shared by NeMo's families.

In:  a release checkpoint's logical key (``X.weight`` stands for its stored values and scale: :mod:`.quant`), the
     family's mapping (``nemo_v41.v41_placement``) and, to read, the checkpoint's key -> file index.
Out: :class:`Placement` -> the native (NeMo state-dict) name, the expert slot and the region the tensor fills;
     :func:`transform` / :func:`place` -> the release tensor narrowed / transposed and copied into its region;
     :func:`read_release_tensor` -> one release tensor read whole or only some rows of dim 0 (dequantized in fp32,
     then cast to the model dtype, as NeMo's adapters do; an unquantized tensor as stored).

NeMo's state-dict adapters convert a whole release state dict at once (``from_hf``); a sliced loader converts
one tensor at a time with these pieces and never holds the whole dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ds_capture.target import quant
from ds_capture.target.quant import QuantTensor


@dataclass(frozen=True)
class Placement:
    """Where one release tensor goes in the NeMo model's state dict."""

    native: str
    """The NeMo model's state-dict name."""
    expert: int | None = None
    """The global expert index j when the release tensor is one expert's piece of a stacked ``[E, ...]`` tensor
    (it fills ``native[j - first local expert]``); None for every other tensor."""
    index: tuple[slice, ...] = ()
    """Where the transformed tensor goes inside ``native[expert]`` (or ``native``): ``()`` is all of it."""
    transpose: bool = False
    """The release tensor is transposed (a 2-D ``[out, in]`` -> ``[in, out]``) before it is placed."""
    narrow: tuple[int, int, int] | None = None
    """``(dim, start, length)`` of the release tensor kept before the transpose (Kimi K3's zero-padded ``A_log``);
    None keeps all of it."""


def transform(placement: Placement, tensor: torch.Tensor) -> torch.Tensor:
    """In: one release tensor. Out: what ``placement``'s region receives (narrowed, then transposed; a view)."""
    if placement.narrow is not None:
        tensor = tensor.narrow(*placement.narrow)
    return tensor.transpose(0, 1) if placement.transpose else tensor


def place(destination: torch.Tensor, placement: Placement, tensor: torch.Tensor, *, first_expert: int = 0) -> None:
    """Copy one release tensor into ``destination`` (the tensor named ``placement.native``), casting to its dtype.

    ``first_expert`` is the global index of ``destination``'s first expert (an expert-parallel rank holds
    ``[first_expert, first_expert + E_local)``). A shape mismatch is an ``AssertionError``: the mapping is wrong,
    not the user's checkpoint (the loader checks shapes against the headers before reading).
    """
    if placement.expert is not None:
        destination = destination[placement.expert - first_expert]
    region = destination[placement.index]
    value = transform(placement, tensor)
    assert region.shape == value.shape, (placement, tuple(region.shape), tuple(value.shape))
    region.copy_(value)


def read_release_tensor(key: str, index: dict[str, Path], quantized: dict[str, QuantTensor],
                        dtype: torch.dtype, *, rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, int]:
    """One logical release tensor (or its rows ``[start, start + count)`` of dim 0), and the bytes read.

    In:  ``key`` a logical key (:func:`.quant.logical_keys`), ``index`` logical key -> file, ``quantized`` the
         :func:`.quant.plan_quantized` entries, ``dtype`` the model dtype, ``rows`` ``(start, count)`` or None (all).
    Out: a quantized weight dequantized in fp32 and cast to ``dtype`` (NeMo's ``dequantize_checkpoint_weight``
         computes the same fp32 products and stores them in the adapter's dtype); any other tensor as stored.
         Only the stored bytes (and scale blocks) of ``rows`` are read: each element is dequantized alone, so
         the rows equal the whole tensor's rows bit for bit.
    """
    if key in quantized:
        qt = quantized[key]
        region = quant.region_of(qt, None, 0, 0) if rows is None else quant.region_of(qt, 0, *rows)
        tensor, num_bytes = quant.read_dequantized(qt, region)
        return tensor.to(dtype), num_bytes
    from safetensors import safe_open

    with safe_open(index[key], framework="pt") as handle:
        if rows is None:
            tensor = handle.get_tensor(key)
        else:
            tensor = handle.get_slice(key)[rows[0]:rows[0] + rows[1]]
    return tensor, tensor.numel() * tensor.element_size()
