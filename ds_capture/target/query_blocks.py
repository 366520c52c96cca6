"""Sparse-attention indexers in blocks of queries under chunked prefill: the scores of a block, not of the chunk.

In: one transformers indexer module, GLM-5's ``GlmMoeDsaIndexer`` or DeepSeek-V3.2's ``DeepseekV32Indexer`` (DSA) or
DeepSeek-V4's ``DeepseekV4Indexer`` (CSA), and a chunk's call to it with the row's cache. Out: the same top-k
indices, computed by the module's own forward over blocks of
:func:`~ds_capture.target.attention_sizes.block_queries` queries, in order.

A chunk's indexer scores each of its C queries against every index key of the prefix, and transformers' broadcast
matmul materialises ``[C, D, T]`` fp32 keys beside the ``[C, Hi, T]`` scores: 20 GiB per layer for GLM-5 at
C = 256, T = 131,072. Each query's top-k depends only on its own scores, so a block of queries forwarded through
the module's own forward with the row's cache is the chunk's forward for those queries: the block's index keys
join the cache before it scores them (exactly what a chunk of that size does), and it scores against the prefix
and itself only. The blocks are the chunks' ties too: a query's row holds the same keys in the same order,
masked the same way, so ``torch.topk`` picks the same set (``tests/unit/test_chunked_prefill.py`` compares the
sets with the whole row's). Only the width differs where a block sees fewer keys than ``index_topk``: the
missing columns are filled with a key after every query of the block, which the causal mask (DSA) or the
indexer's own ``-1`` sentinel (CSA) drops.

A family declares these as data (``Family.chunk_query_blocks``); :func:`ds_capture.capture.chunked.forward_in_chunks`
puts them in front of the modules for one row's chunks. Whole rows never pass through here.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from ds_capture.target import attention_sizes


class DsaIndexerBlocks:
    """GLM-5's and DeepSeek-V3.2's DSA indexer: ``forward(hidden_states, q_resid, (cos, sin), mask [B, C, T],
    position_ids, cache)`` in blocks of queries; returns ``[B, C, min(index_topk, T)]`` int32 key indices."""

    def __init__(self, module: torch.nn.Module, row_tokens: int) -> None:
        self.module = module  # (row_tokens: the carriers' signature; a block's keys are the cache's)

    def forward(self, hidden_states: torch.Tensor, q_resid: torch.Tensor, position_embeddings, attention_mask,
                position_ids=None, cache=None) -> torch.Tensor:
        module, own = self.module, type(self.module).forward
        num_queries, keys = hidden_states.shape[1], attention_mask.shape[-1]  # C queries, T = prefix + C keys
        block = attention_sizes.block_queries(
            attention_sizes.dsa_query_bytes(module.n_heads, module.head_dim, keys))
        if cache is None or block >= num_queries:
            return own(module, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=cache)
        prefix, width = keys - num_queries, min(module.index_topk, keys)
        cos, sin = position_embeddings
        blocks = []
        for start in range(0, num_queries, block):
            rows = slice(start, min(start + block, num_queries))
            topk = own(module, hidden_states[:, rows], q_resid[:, rows], (cos[:, rows], sin[:, rows]),
                       attention_mask[:, rows, :prefix + rows.stop],
                       None if position_ids is None else position_ids[:, rows], cache=cache)
            # Fewer keys than index_topk before this block's end: the chunk's last key (after every query here).
            blocks.append(F.pad(topk, (0, width - topk.shape[-1]), value=keys - 1))
        return torch.cat(blocks, dim=1)


class CsaIndexerBlocks:
    """DeepSeek-V4's CSA indexer: ``forward(hidden_states, q_residual, position_ids, cache, layer_idx)`` in blocks
    of queries (multiples of the compress rate, so each block closes its own windows); returns ``[B, C, k]``
    compressed-key indices, ``-1`` where a query has fewer than k ready."""

    def __init__(self, module: torch.nn.Module, row_tokens: int) -> None:
        self.module = module  # (row_tokens: the carriers' signature; a block's keys are the cache's)

    def forward(self, hidden_states: torch.Tensor, q_residual: torch.Tensor, position_ids: torch.Tensor, cache,
                layer_idx: int) -> torch.Tensor:
        module, own = self.module, type(self.module).forward
        num_queries = hidden_states.shape[1]
        keys = (int(position_ids[0, -1]) + 1) // module.compress_rate  # compressed keys once this chunk is in
        block = attention_sizes.block_queries(
            attention_sizes.csa_query_bytes(module.num_heads, module.head_dim, keys))
        if cache is None or block >= num_queries:
            return own(module, hidden_states, q_residual, position_ids, cache, layer_idx)
        width = min(module.index_topk, keys)
        blocks = []
        for start in range(0, num_queries, block):
            rows = slice(start, min(start + block, num_queries))
            topk = own(module, hidden_states[:, rows], q_residual[:, rows], position_ids[:, rows], cache, layer_idx)
            blocks.append(F.pad(topk, (0, width - topk.shape[-1]), value=-1))  # -1: the indexer's "not ready"
        return torch.cat(blocks, dim=1)


class LatentMlaBlocks:
    """GLM-5's MLA attention (``GlmMoeDsaAttention``; DeepSeek-V3.2's, :class:`V32LatentMlaBlocks`) under chunked
    prefill, computed on its cached latent.

    Its cache holds each token's latent (``kv_a_layernorm``'s 512 and the rotated 64), and transformers expands the
    whole prefix's latent to every head's keys and values for each chunk: ``[T, 64, 704]``, 11 GiB per layer at
    T = 131,072. The same attention on the latent itself: each head's query goes through ``kv_b_proj``'s key half into
    the latent space, scores against the latent keys (one key per token for every head), and the softmax-weighted
    latents come back through the value half, ``softmax(q W_k c^T) c W_v^T = softmax(q (c W_k^T)^T) (c W_v^T)``;
    in blocks of queries (:func:`~ds_capture.target.attention_sizes.latent_query_bytes`). Equal to the expanded
    attention up to float summation order (fp32: within 1e-5 of the row maximum, tests/unit/test_chunked_prefill.py).
    The rest (projections, the cache update, the indexer or the shared top-k, ``o_proj``) is the module's own."""

    returns_topk = True
    """GLM-5's attention returns its top-k for the next layers ("shared" indexer layers); DeepSeek-V3.2's does not."""

    def __init__(self, module: torch.nn.Module, row_tokens: int) -> None:
        self.module = module  # (row_tokens: the carriers' signature; a block's keys are the cache's)

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask: torch.Tensor, cache=None,
                position_ids=None, prev_topk_indices=None, **kwargs):
        m = self.module
        if cache is None or not self._expansion_too_large(cache, hidden_states):
            shared = {"prev_topk_indices": prev_topk_indices} if self.returns_topk else {}
            return type(m).forward(m, hidden_states, position_embeddings, attention_mask, cache=cache,
                                   position_ids=position_ids, **shared, **kwargs)
        # The module's own interleaved rotary (GLM-5's and DeepSeek-V3.2's modeling files each define it).
        apply_rotary_pos_emb_interleave = importlib.import_module(type(m).__module__).apply_rotary_pos_emb_interleave
        batch, num_queries = hidden_states.shape[:-1]
        # As GlmMoeDsaAttention.forward: queries, this chunk's latent, rotary, the cache (now prefix + chunk).
        q_resid = m.q_a_layernorm(m.q_a_proj(hidden_states))
        query = m.q_b_proj(q_resid).view(batch, num_queries, -1, m.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(query, [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        kv_pass, k_rot = torch.split(m.kv_a_proj_with_mqa(hidden_states), [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        k_pass = m.kv_a_layernorm(kv_pass).view(batch, 1, num_queries, m.kv_lora_rank)
        cos, sin = position_embeddings
        q_rot, k_rot = apply_rotary_pos_emb_interleave(
            q_rot, k_rot.view(batch, 1, num_queries, m.qk_rope_head_dim), cos, sin)
        k_pass, k_rot = cache.update(k_pass, k_rot, m.layer_idx, kwargs=kwargs)
        if m.indexer is not None:  # GLM-5's "shared" layers have none: they take the previous layer's
            topk = m.indexer(hidden_states, q_resid, position_embeddings, attention_mask[:, 0, :, :], position_ids,
                             cache=cache)
        elif prev_topk_indices is None:
            raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")
        else:
            topk = prev_topk_indices
        # kv_b_proj: [heads * (nope + v), latent] (this rank's heads); its key half takes q into the latent space.
        weight = m.kv_b_proj.weight.view(-1, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_key, w_value = weight[:, :m.qk_nope_head_dim], weight[:, m.qk_nope_head_dim:]
        query = torch.cat([torch.matmul(q_pass, w_key), q_rot], dim=-1)  # [B, H, C, latent + rope]
        keys = torch.cat([k_pass, k_rot], dim=-1)[:, 0]  # [B, T, latent + rope]
        latent_out = self._attend(query, keys, k_pass[:, 0], attention_mask, topk)  # [B, H, C, latent]
        output = torch.matmul(latent_out, w_value.transpose(-1, -2))  # [B, H, C, v]
        output = m.o_proj(output.transpose(1, 2).reshape(batch, num_queries, -1))
        return (output, None, topk) if self.returns_topk else (output, None)

    def _expansion_too_large(self, cache, hidden_states: torch.Tensor) -> bool:
        """Would transformers' expansion of the prefix and this chunk exceed ``LATENT_ATTENTION_FROM_BYTES``?"""
        m = self.module
        keys = cache.get_seq_length(m.layer_idx) + hidden_states.shape[1]
        heads = m.kv_b_proj.weight.shape[0] // (m.qk_nope_head_dim + m.v_head_dim)  # this rank's heads
        expanded = attention_sizes.mla_expansion_bytes(heads, keys, m.qk_nope_head_dim, m.qk_rope_head_dim,
                                                       m.v_head_dim, hidden_states.element_size())
        return hidden_states.shape[0] * expanded > attention_sizes.LATENT_ATTENTION_FROM_BYTES

    def _attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attention_mask: torch.Tensor,
                topk: torch.Tensor) -> torch.Tensor:
        """Softmax attention of ``query [B, H, C, d]`` over one shared ``keys [B, T, d]`` / ``values [B, T, dv]``
        per token, masked by the causal mask and the top-k (as transformers masks it), a block of queries at once."""
        batch, heads, num_queries, _ = query.shape
        total = keys.shape[1]
        block = attention_sizes.block_queries(attention_sizes.latent_query_bytes(heads, total, query.element_size()))
        outputs = []
        for start in range(0, num_queries, block):
            rows = slice(start, min(start + block, num_queries))
            size = rows.stop - rows.start
            unselected = torch.ones(batch, size, total, dtype=torch.bool, device=query.device).scatter(
                -1, topk[:, rows].long(), False).unsqueeze(1)  # [B, 1, n, T]
            # Every head reads the same latent key: the block's heads x queries are one matrix against it.
            scores = torch.matmul(query[:, :, rows].reshape(batch, heads * size, -1), keys.transpose(-1, -2))
            scores = scores.view(batch, heads, size, total).float()
            scores.mul_(self.module.scaling)
            mask = attention_mask[:, :, rows]
            if mask.dtype == torch.bool:
                scores.masked_fill_(unselected | ~mask, float("-inf"))
            else:
                scores = scores.add_(mask).masked_fill_(unselected, float("-inf"))
            probs = scores.softmax(dim=-1).to(values.dtype).view(batch, heads * size, total)
            del scores
            outputs.append(torch.matmul(probs, values).view(batch, heads, size, -1))
        return torch.cat(outputs, dim=2)


class V32LatentMlaBlocks(LatentMlaBlocks):
    """DeepSeek-V3.2's MLA attention (``DeepseekV32Attention``): as GLM-5's, every layer with its own indexer."""

    returns_topk = False
