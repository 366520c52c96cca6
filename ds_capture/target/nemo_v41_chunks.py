"""Chunked prefill of NeMo-built DeepSeek-V4.1 (CSA2 attention, Engram): one carrier per layer kind, around NeMo's
own modules.

In:  a NeMo AutoModel 0.7.0 ``DeepseekV41Attention`` or ``DeepseekV41NgramHash`` module (``nemo_automodel.components.
     models.deepseek_v41``), the row's length and the row's chunks, in order (every chunk but the last a multiple of
     each layer's compress ratio: ``Family.chunk_multiple``). Out: :class:`CsaCarrier` and
     :class:`EngramContextCarrier`: ``forward`` replaces the module's forward for one row's chunks (installed and
     removed by :func:`ds_capture.capture.chunked.carried_state`) and computes the chunk against the state the chunks
     before left; ``state_bytes`` is what it carries at S (``ds-capture plan``).

NeMo's classes take no cache, so nothing in NeMo is patched: the carriers call NeMo's own submodules (projections,
norms, compressor, indexer projections, rotary embedding, sink, grouped output projection) and functions (its cache
quantizers, RoPE, candidate-block selection), in the order NeMo's non-CP, non-TileLang forward calls them. What each
kind carries from the chunks before:

- every CSA2 layer: its sliding window's tail, the last ``window - 1`` rotated, FP8-rounded window keys / values
  (one shared KV head);
- a KV source layer (``compressor``): the prefix's compressed KV (rotated, NVFP4-rounded; ``S / ratio`` groups). The
  layers that reuse it read it from the chunk's CSA2 state, as in NeMo;
- a key-owning indexer: the prefix's index keys (rotated, MXFP4-rounded). Each query's top-k (and the candidate
  source's block selection) is taken over the row's whole compressed width, ``row_tokens / ratio`` columns, the
  columns no chunk has reached yet masked as the whole row masks them (causally): ``torch.topk`` keeps exactly tied
  scores by position within the computed width, so the chunk computes the width the row computes
  (``Family.full_width``) and breaks ties as the whole row does;
- the Engram n-gram hash: the prefix's last ``max_ngram_size - 1`` token ids (the n-grams that cross the chunk's
  start).

Everything else in a V4.1 block is per token (mHC mixes, Engram lookups given the hashes, MoE, norms). Chunks are
forwarded without a mask (right-padded rows: content never sees padding), as whole rows are in ``run``.

Legend: B = rows, C = chunk tokens, P = prefix tokens, T = window tail (<= window - 1), W = compressed groups so
far, R = the row's compressed width (row tokens / ratio), H / Hi = attention / indexer heads, D / Di = their dims.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Any

import torch

from ds_capture.errors import CaptureError

NEMO_V41_ATTENTION = "nemo_automodel.components.models.deepseek_v41.attention"


def _nemo() -> Any:
    return importlib.import_module(NEMO_V41_ATTENTION)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _append(prefix: torch.Tensor | None, chunk: torch.Tensor) -> torch.Tensor:
    return chunk if prefix is None else torch.cat((prefix, chunk), dim=1)


class CsaCarrier:
    """A ``DeepseekV41Attention`` layer over one row's chunks: window tail, compressed KV, index keys."""

    def __init__(self, module: torch.nn.Module, row_tokens: int) -> None:
        self.module = module
        self.row_tokens = row_tokens
        self.offset = 0  # P: the tokens of the chunks before
        self.window_kv: torch.Tensor | None = None  # [B, T, D]
        self.compressed_kv: torch.Tensor | None = None  # [B, W, D] (KV source layers)
        self.index_keys: torch.Tensor | None = None  # [B, W, Di] (key-owning indexers)

    @staticmethod
    def state_bytes(module: torch.nn.Module, batch: int, seq_length: int, dtype: torch.dtype) -> int:
        """What one layer carries for ``batch`` rows of ``seq_length`` tokens after the row's last chunk."""
        tail = min(module.window_size - 1, seq_length) * module.head_dim
        groups = seq_length // module.compress_ratio if module.compress_ratio else 0
        compressed = groups * module.head_dim if module.compressor is not None else 0
        indexer = module.indexer
        keys = groups * indexer.head_dim if indexer is not None and indexer.owns_keys else 0
        return batch * (tail + compressed + keys) * _size(dtype)

    @staticmethod
    def expansion_bytes(module: torch.nn.Module, batch: int, seq_length: int, dtype: torch.dtype) -> int:
        """The last chunk's keys of a compressed layer: the window's and the row's compressed KV, concatenated
        (``ds-capture plan``'s transient of that layer's attention)."""
        groups = seq_length // module.compress_ratio if module.compress_ratio else 0
        return batch * groups * module.head_dim * _size(dtype)

    def forward(self, hidden_states: torch.Tensor, *, position_ids: torch.Tensor, state: Any,
                attention_mask: torch.Tensor | None = None, cp_group: Any = None,
                packed_seq_ids: torch.Tensor | None = None) -> Any:
        """NeMo's dense (SDPA / eager) CSA2 forward for one chunk ``[B, C, hidden]`` against the carried state."""
        del position_ids  # the chunk's own 0..C-1 (NeMo's model makes them): its global ones are offset + those
        module, nemo = self.module, _nemo()
        if attention_mask is not None or packed_seq_ids is not None or (cp_group or module.cp_group) is not None:
            raise AssertionError("DeepSeek-V4.1's carrier forwards plain unmasked rows (got a mask, packed or CP inputs)")
        if module.backend.attn not in ("sdpa", "eager"):
            raise AssertionError(f"DeepSeek-V4.1's carrier computes NeMo's dense path, not {module.backend.attn!r}")
        batch, length, _ = hidden_states.shape
        ratio = module.compress_ratio
        if ratio and self.offset % ratio:
            # Family.chunk_multiple covers the release's ratios (1, 2); a config with larger ones needs larger chunks.
            raise CaptureError(
                f"capture.chunked_prefill: the row's chunks so far end at token {self.offset}, inside a compression "
                f"group of layer {module.layer_idx} (compress_ratio {ratio}), whose compressed key would be pooled "
                f"from two chunks. Use a chunk that is a multiple of {ratio}, or off.")
        positions = torch.arange(self.offset, self.offset + length, device=hidden_states.device)  # [C], global
        angles = module.rotary_emb(positions.expand(batch, -1))
        query_latent = module.q_norm(module.wq_a(hidden_states))
        query = nemo._apply_rope(module.wq_b(query_latent).unflatten(-1, (module.num_heads, module.head_dim)), angles)
        kv = nemo.quantize_cache(nemo._apply_rope(module.kv_norm(module.wkv(hidden_states)), angles),
                                 format="fp8", block_size=32)
        window_kv = _append(self.window_kv, kv)  # [B, T + C, D]
        self.window_kv = window_kv[:, max(0, window_kv.shape[1] - (module.window_size - 1)):].clone()
        next_state = state
        if ratio:
            next_state = self._compressed_state(hidden_states, query_latent, angles, positions, state)
        attended = self._attend(query, window_kv, positions, next_state)
        self.offset += length
        valid = torch.ones(batch, length, dtype=torch.bool, device=hidden_states.device)
        return nemo.DeepseekV41AttentionOutput(module._project_output(attended, angles, valid), next_state)

    def _compressed_state(self, hidden_states: torch.Tensor, query_latent: torch.Tensor, angles: torch.Tensor,
                          positions: torch.Tensor, state: Any) -> Any:
        """The chunk's CSA2 state: the prefix's and the chunk's compressed KV (a source layer appends the chunk's
        complete groups to what it carries; a consumer reads its source's), then the indexer's selection."""
        module, nemo = self.module, _nemo()
        batch, length, _ = hidden_states.shape
        ratio = module.compress_ratio
        compressed_angles = module.rotary_emb(positions[: length // ratio * ratio: ratio].expand(batch, -1))
        latent = None
        if module.compressor is not None:
            latent = module.compressor(hidden_states)  # [B, C / ratio, D], complete groups only
            fresh = nemo.quantize_cache(nemo._apply_rope(latent, compressed_angles), format="nvfp4", block_size=16)
            self.compressed_kv = _append(self.compressed_kv, fresh)
            width = self.compressed_kv.shape[1]
            state = nemo.DeepseekV41AttentionState(
                compressed_kv=self.compressed_kv, compression_ratio=ratio,
                compressed_valid=torch.ones(batch, width, dtype=torch.bool, device=hidden_states.device))
        elif state.compressed_kv is None or state.compression_ratio != ratio:
            raise ValueError("A CSA2 consumer requires a preceding Full layer with the same compression ratio")
        if module.indexer is not None:
            state = self._select(hidden_states, query_latent, latent, angles, compressed_angles, positions, state)
        if state.topk_indices is None or state.topk_indices.shape[:2] != (batch, length):
            raise ValueError("A Reuse CSA2 layer requires compressed KV and indices from its source")
        return state

    def _select(self, hidden_states: torch.Tensor, query_latent: torch.Tensor, latent: torch.Tensor | None,
                angles: torch.Tensor, compressed_angles: torch.Tensor, positions: torch.Tensor, state: Any) -> Any:
        """NeMo's ``_Indexer.forward`` for the chunk's queries: keys of the prefix and the chunk, scores over the
        row's whole compressed width R (the columns past the chunk masked, as the whole row masks them)."""
        indexer, nemo = self.module.indexer, _nemo()
        batch = hidden_states.shape[0]
        keys = state.index_keys
        if indexer.owns_keys:
            fresh = nemo.quantize_cache(nemo._apply_rope(indexer.k_norm(indexer.wk(latent)), compressed_angles),
                                        format="mxfp4", block_size=32)
            self.index_keys = keys = _append(self.index_keys, fresh)
        if keys is None:
            raise ValueError("A Reindex CSA2 layer requires index keys from a preceding Full layer")
        row_width = self.row_tokens // state.compression_ratio
        queries = indexer.wq_b(query_latent).unflatten(-1, (indexer.num_heads, indexer.head_dim))
        queries = nemo.quantize_cache(nemo._apply_rope(queries, angles), format="mxfp4", block_size=32)
        weights = indexer.weights_proj(hidden_states) * (indexer.head_dim ** -0.5 * indexer.num_heads ** -0.5)
        visible_lengths = ((positions + 1) // state.compression_ratio).view(1, -1, 1).expand(batch, -1, -1)
        allowed = torch.arange(row_width, device=hidden_states.device) < visible_lengths  # [B, C, R]
        # NeMo's BF16 matmul and reduction boundaries, on the W keys there are; then the row's width R.
        scores = torch.einsum("bshd,btd->bsht", queries, keys)  # [B, C, Hi, W]
        scores = (scores.relu() * weights.unsqueeze(-1)).sum(dim=2)
        scores = torch.nn.functional.pad(scores, (0, row_width - keys.shape[1])).masked_fill(~allowed, -torch.inf)
        candidates = state.candidates
        if indexer.is_candidate_source:
            candidates = nemo._select_candidate_blocks(
                scores, visible_lengths, topk_blocks=indexer.candidate_topk_blocks,
                block_size=indexer.candidate_block_size) & allowed
        elif indexer.uses_candidates:
            if candidates is None or candidates.shape != scores.shape:
                raise ValueError("A hierarchical Reindex layer requires candidates from its source layer")
            scores = scores.masked_fill(~candidates, -torch.inf)
        selected = scores.topk(min(indexer.topk, row_width), dim=-1, sorted=False)
        indices = selected.indices.sort(dim=-1).values
        indices = torch.where(torch.isfinite(scores.gather(-1, indices)), indices, -1)  # [B, C, topk]
        return replace(state, index_keys=keys, topk_indices=indices, candidates=candidates)

    def _attend(self, query: torch.Tensor, window_kv: torch.Tensor, positions: torch.Tensor, state: Any
                ) -> torch.Tensor:
        """NeMo's dense attention of the chunk's queries ``[B, C, H, D]`` over the window's keys (tail and chunk),
        the selected compressed keys and the sink: ``[B, C, H, D]``. The bias is the chunk's ``[B, H, C, T + C + W
        + 1]``, not the row's ``[B, H, S, S + R + 1]``."""
        module = self.module
        batch, length = query.shape[:2]
        device = query.device
        key_positions = torch.arange(self.offset + length - window_kv.shape[1], self.offset + length, device=device)
        allowed = ((key_positions[None, :] <= positions[:, None])
                   & (key_positions[None, :] > positions[:, None] - module.window_size)).expand(batch, -1, -1)
        kv = window_kv
        if module.compress_ratio:
            # NeMo's sentinel column: an absent index (-1) lands there, never on a valid position.
            width = state.compressed_kv.shape[1]
            indices = state.topk_indices
            compressed = torch.zeros(batch, length, width + 1, dtype=torch.bool, device=device)
            compressed = compressed.scatter(-1, torch.where(indices >= 0, indices, width), True)
            allowed = torch.cat((allowed, compressed[..., :width]), dim=-1)
            kv = torch.cat((kv, state.compressed_kv), dim=1)
        kv = torch.cat((kv, kv.new_zeros(batch, 1, module.head_dim)), dim=1)  # the sink's zero-valued key
        bias = torch.zeros(batch, 1, length, allowed.shape[-1], device=device, dtype=torch.float32)
        bias = bias.masked_fill(~allowed.unsqueeze(1), -torch.inf).expand(-1, module.num_heads, -1, -1)
        sink = module.sinks_param(query).view(1, module.num_heads, 1, 1).expand(batch, -1, length, -1)
        bias = torch.cat((bias, sink), dim=-1)
        scale = module.head_dim ** -0.5
        if module.backend.attn == "sdpa":
            return torch.nn.functional.scaled_dot_product_attention(
                query.transpose(1, 2), kv.unsqueeze(1), kv.unsqueeze(1), attn_mask=bias, dropout_p=0.0,
                scale=scale).transpose(1, 2)
        logits = torch.einsum("bshd,btd->bhst", query.float(), kv.float()) * scale
        return torch.einsum("bhst,btd->bshd", (logits + bias).softmax(dim=-1), kv.float()).to(query.dtype)


class EngramContextCarrier:
    """A ``DeepseekV41NgramHash`` over one row's chunks: the prefix's last ``max_ngram_size - 1`` token ids."""

    def __init__(self, module: torch.nn.Module, row_tokens: int) -> None:
        self.module = module
        self.context: torch.Tensor | None = None  # [B, <= n - 1] token ids

    @staticmethod
    def state_bytes(module: torch.nn.Module, batch: int, seq_length: int, dtype: torch.dtype) -> int:
        """The ids one row carries (int64, whatever the compute dtype)."""
        return batch * min(module.max_ngram_size - 1, seq_length) * 8

    def forward(self, input_ids: torch.Tensor, *, token_mask: torch.Tensor | None = None,
                sequence_ids: torch.Tensor | None = None) -> torch.Tensor:
        """NeMo's hashes ``[B, C, layers, heads]`` of the chunk's positions, their n-grams reaching into the prefix:
        NeMo's own forward over the carried ids and the chunk, the carried positions' rows dropped."""
        if token_mask is not None or sequence_ids is not None:
            raise AssertionError("DeepSeek-V4.1's Engram carrier hashes plain unmasked rows (got a mask or documents)")
        ids = _append(self.context, input_ids)
        hashes = type(self.module).forward(self.module, ids)  # the class's forward: the instance's is this one
        self.context = ids[:, max(0, ids.shape[1] - (self.module.max_ngram_size - 1)):].clone()
        return hashes[:, ids.shape[1] - input_ids.shape[1]:]
