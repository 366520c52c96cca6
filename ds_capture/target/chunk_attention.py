"""A chunk's causal attention against its prefix on the CPU, in two unmasked kernels instead of one masked one.

In: a chunk's queries ``[B, H, C, D]`` and the prefix-plus-chunk keys and values ``[B, Hkv, T, D]`` (``T > C``) that
Hugging Face's cache hands transformers' ``sdpa`` attention, with the boolean mask transformers built for them. Out:
the attention output, as transformers' ``sdpa_attention_forward`` returns it (``[B, C, H, D]``).

Where the mask is exactly the chunk's causal pattern aligned to the bottom right (query ``i`` sees keys
``0 .. T - C + i``: no padding, no window, no sinks, no soft cap), the CPU's fused (flash) kernel runs twice without
a mask: the chunk's queries over the whole prefix, and over the chunk itself with its causal flag (the two are
square there, so PyTorch's top-left causal alignment is the right one); the two halves are merged by their
log-sum-exps, as flash attention merges its blocks. A masked call takes PyTorch's masked kernel, measured 1.4x
slower on CPU at C = 1,024 against a 3,072-token prefix (whole rows take the unmasked causal kernel: chunks at
S/4 cost 1.6x a whole row's attention with the mask, 1.04x split). The two sums are ordered differently from the
masked kernel's: fp32 outputs differ in the last bits (6e-8 on unit-scale inputs), as chunked and whole rows
already do (``tests/unit/test_chunked_prefill.py``). Anything else, other dtypes than fp32 and other devices
included, takes transformers' own function unchanged.

    with split_chunk_attention():
        model(input_ids=chunk, cache=cache, use_cache=True)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def split_chunk_attention() -> Iterator[None]:
    """Within: every model's ``sdpa`` attention is :class:`_ChunkAttention`'s, and its ``sdpa`` masks are
    transformers' own, those of plain causal attention over a cache built and noted as such (transformers'
    mappings, restored on exit). transformers' modeling modules are imported here, not with this module
    (``ds-capture``'s commands that load no model never import them)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    attention, masks = AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping
    original_attention, original_mask = attention["sdpa"], masks["sdpa"]
    chunked = _ChunkAttention(original_attention)
    attention["sdpa"], masks["sdpa"] = chunked, chunked.noting_masks(original_mask)
    try:
        yield
    finally:
        attention["sdpa"], masks["sdpa"] = original_attention, original_mask


class _ChunkAttention:
    """transformers' ``sdpa`` attention function, with :func:`chunk_attention` where it applies. A mask transformers
    built for plain causal attention with nothing masked but the future (:meth:`noting_masks`) is known without a
    look; any other is checked once, and the verdict kept for the next layers (transformers builds one mask per
    forward and hands it to every layer)."""

    def __init__(self, fallback=None) -> None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.fallback = fallback or sdpa_attention_forward
        self._mask: torch.Tensor | None = None
        self._verdict = False
        self._triangle: torch.Tensor | None = None
        self._noted: torch.Tensor | None = None

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                 **kwargs):
        if self._applies(query, key, value, attention_mask, dropout, kwargs):
            return chunk_attention(query, key, value, getattr(module, "num_key_value_groups", 1), scaling), None
        return self.fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                             is_causal=is_causal, **kwargs)

    def _applies(self, query, key, value, mask, dropout, kwargs) -> bool:
        if (query.device.type != "cpu" or query.dtype != torch.float32 or dropout or mask is None
                or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1
                or key.shape[-1] != value.shape[-1] or query.shape[-1] != key.shape[-1]
                or any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux", "sinks"))):
            return False
        chunk, total = query.shape[2], key.shape[2]
        if total <= chunk or mask.shape[-2:] != (chunk, total):
            return False
        if mask is not self._mask:
            known = self._noted is not None and mask is self._noted
            self._mask, self._verdict = mask, known or self._is_chunk_causal(mask, chunk, total - chunk)
        return self._verdict

    def noting_masks(self, sdpa_mask):
        """transformers' ``sdpa_mask``, except for the chunk's pattern (causal, no window, no overlay, no padding,
        queries at the cache's end: ``q_offset = kv_length - q_length``, ``kv_offset = 0``), whose mask is built here,
        equal to transformers', and noted."""

        from transformers.masking_utils import causal_mask_function

        def build(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                  attention_mask=None, local_size=None, **kwargs):
            if (mask_function is causal_mask_function and local_size is None and kv_offset == 0
                    and isinstance(q_offset, int) and q_offset == kv_length - q_length > 0
                    and (attention_mask is None or bool(attention_mask.all()))):
                # The same mask in one pass (transformers' index comparisons cost 2.7x as much on the CPU: 15 vs
                # 5.6 ms at C = 2,048, T = 8,192), one row's expanded over the batch.
                triangle = torch.ones(q_length, kv_length, dtype=torch.bool, device=kwargs.get("device", "cpu"))
                self._noted = triangle.tril_(q_offset)[None, None].expand(batch_size, 1, q_length, kv_length)
                return self._noted
            return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                             local_size, **kwargs)

        return build

    def _is_chunk_causal(self, mask: torch.Tensor, chunk: int, prefix: int) -> bool:
        """Every query sees the whole prefix, and the chunk's square is lower-triangular (two passes over the mask)."""
        if self._triangle is None or self._triangle.shape[0] != chunk:
            self._triangle = torch.ones(chunk, chunk, dtype=torch.bool).tril()
        return bool(mask[..., :prefix].all()) and bool((mask[..., prefix:] == self._triangle).all())


def chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, groups: int,
                    scaling: float | None) -> torch.Tensor:
    """Causal attention of ``query`` (the last ``C`` positions) over ``key`` / ``value`` (``T`` positions), in
    transformers' output layout ``[B, C, H, D]``; ``groups`` query heads per key/value head."""
    from transformers.integrations.sdpa_attention import repeat_kv

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    batch, heads, chunk, dim = query.shape
    prefix = key.shape[2] - chunk
    # Over the prefix every query sees every key: a key/value head's query heads go as one longer run of queries.
    grouped = query.reshape(batch, heads // groups, groups * chunk, dim)
    out_prefix, lse_prefix = flash(grouped, key[:, :, :prefix], value[:, :, :prefix], 0.0, False, scale=scaling)
    out_prefix, lse_prefix = out_prefix.reshape(query.shape), lse_prefix.reshape(batch, heads, chunk)
    out_chunk, lse_chunk = flash(query, repeat_kv(key[:, :, prefix:], groups), repeat_kv(value[:, :, prefix:], groups),
                                 0.0, True, scale=scaling)
    top = torch.maximum(lse_prefix, lse_chunk)
    w_prefix, w_chunk = (lse_prefix - top).exp_().unsqueeze(-1), (lse_chunk - top).exp_().unsqueeze(-1)
    out = (out_prefix * w_prefix + out_chunk * w_chunk) / (w_prefix + w_chunk)
    return out.transpose(1, 2).contiguous()
