"""Sparse-attention indexers in blocks of queries under chunked prefill: the scores of a block, not of the chunk.

In: one transformers indexer module, GLM-5's ``GlmMoeDsaIndexer`` or DeepSeek-V3.2's ``DeepseekV32Indexer`` (DSA) or
DeepSeek-V4's ``DeepseekV4Indexer`` (CSA), and a chunk's call to it with the row's cache. Out: the same top-k
indices, computed by the module's own forward over blocks of
:func:`~ds_capture.target.attention_sizes.indexer_block_queries` queries, in order.

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

import torch
import torch.nn.functional as F

from ds_capture.target import attention_sizes


class DsaIndexerBlocks:
    """GLM-5's and DeepSeek-V3.2's DSA indexer: ``forward(hidden_states, q_resid, (cos, sin), mask [B, C, T],
    position_ids, cache)`` in blocks of queries; returns ``[B, C, min(index_topk, T)]`` int32 key indices."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def forward(self, hidden_states: torch.Tensor, q_resid: torch.Tensor, position_embeddings, attention_mask,
                position_ids=None, cache=None) -> torch.Tensor:
        module, own = self.module, type(self.module).forward
        num_queries, keys = hidden_states.shape[1], attention_mask.shape[-1]  # C queries, T = prefix + C keys
        block = attention_sizes.indexer_block_queries(
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

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def forward(self, hidden_states: torch.Tensor, q_residual: torch.Tensor, position_ids: torch.Tensor, cache,
                layer_idx: int) -> torch.Tensor:
        module, own = self.module, type(self.module).forward
        num_queries = hidden_states.shape[1]
        keys = (int(position_ids[0, -1]) + 1) // module.compress_rate  # compressed keys once this chunk is in
        block = attention_sizes.indexer_block_queries(
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
