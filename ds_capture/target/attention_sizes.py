"""Attention-score sizes of the families whose attention materialises more than ``[B, H, S, S]``: the DSA and CSA
indexers, and DeepSeek-V4's compressed keys appended to every query's own. Pure arithmetic on a text config.

In: a family's text config, a batch and a sequence length. Out: bytes, or keys per query. The registry names these
functions as data (``Family.indexer_scores``, ``Family.keys_per_query``); ``ds-capture plan``'s memory model
calls them through the family. Under chunked prefill the indexers score a chunk's queries in blocks
(:mod:`ds_capture.target.query_blocks`) of :func:`block_queries`, which plan counts the same way.
"""

from __future__ import annotations

QUERY_BLOCK_BYTES = 256 << 20
"""Under chunked prefill, an indexer's scores (and torch's broadcast copy of its keys), or GLM-5's latent attention
scores, per block of queries stay about this size: the block holds as many queries as fit, a multiple of :data:`QUERY_BLOCK_MULTIPLE`."""
QUERY_BLOCK_MULTIPLE = 16
"""Queries per indexer block are a multiple of this (and at least this): DeepSeek-V4's compress rate 4 divides it."""


def dsa_query_bytes(heads: int, dim: int, keys: int) -> int:
    """One query of a DSA indexer against ``keys`` index keys: ``matmul([.., Hi, D], [.., 1, D, T])`` broadcasts,
    so torch materialises the keys once per query, ``[D, T]`` fp32, next to the ``[Hi, T]`` fp32 scores; scaling and
    relu then hold two score tensors: ``T * 4 * max(D + Hi, 2 Hi)``."""
    return keys * 4 * max(dim + heads, 2 * heads)


def csa_query_bytes(heads: int, dim: int, keys: int) -> int:
    """One query of DeepSeek-V4's CSA indexer against ``keys`` compressed keys: the same broadcast matmul
    (``[D, T]`` + ``[Hi, T]`` fp32), then relu and scaling hold three score tensors."""
    return keys * 4 * max(dim + heads, 3 * heads)


def block_queries(query_bytes: int) -> int:
    """Queries per block (an indexer's, a latent attention's) under chunked prefill: as many as fit :data:`QUERY_BLOCK_BYTES` at
    ``query_bytes`` each, rounded down to a multiple of :data:`QUERY_BLOCK_MULTIPLE`, at least one multiple."""
    fit = QUERY_BLOCK_BYTES // max(query_bytes, 1)
    return max(QUERY_BLOCK_MULTIPLE, fit // QUERY_BLOCK_MULTIPLE * QUERY_BLOCK_MULTIPLE)


def dsa_indexer_scores(text_config, batch: int, seq_length: int) -> int:
    """GLM-5's DSA indexer over a ``[B, S]`` batch: every query against S keys (:func:`dsa_query_bytes`); 8 GiB per
    row at S = 4096 for GLM-5's 32 heads of 128."""
    return batch * seq_length * dsa_query_bytes(text_config.index_n_heads, text_config.index_head_dim, seq_length)


def csa_indexer_scores(text_config, batch: int, seq_length: int) -> int:
    """DeepSeek-V4's CSA indexer over a ``[B, S]`` batch: every query against the ``S / rate`` compressed keys."""
    rate = compressed_rate(text_config, "compressed_sparse_attention")
    if not rate:
        return 0
    heads, dim = text_config.index_n_heads, text_config.index_head_dim
    return batch * seq_length * csa_query_bytes(heads, dim, seq_length // rate)


def compressed_keys_per_query(text_config) -> float:
    """DeepSeek-V4: every query attends to its S keys plus the compressed entries (S / rate) appended to them."""
    rates = [compressed_rate(text_config, kind) for kind in set(text_config.layer_types or ())]
    return 1 + max((1 / rate for rate in rates if rate), default=0.0)


def compressed_chunk_keys(text_config, queries: int, seq_length: int) -> int:
    """DeepSeek-V4 under chunked prefill: a chunk's queries attend to the sliding window's tail and the chunk itself
    (the cache keeps the window's last keys, not the prefix), plus the compressed keys of the whole row."""
    rates = [compressed_rate(text_config, kind) for kind in set(text_config.layer_types or ())]
    rate = min((rate for rate in rates if rate), default=0)
    return min(seq_length, text_config.sliding_window + queries) + (seq_length // rate if rate else 0)


LATENT_ATTENTION_FROM_BYTES = 1 << 30
"""GLM-5's and DeepSeek-V3.2's MLA under chunked prefill attend on the cached latent only where transformers'
expansion of the prefix (:func:`mla_expansion_bytes`) would exceed this: below it the module's own forward runs,
whose sums are the chunked path's as before (the latent attention sums in another order, and a near-tie of two
index scores downstream can then fall the other way)."""


def mla_expansion_bytes(heads: int, keys: int, nope: int, rope: int, value: int, compute_bytes: int) -> int:
    """Transformers' MLA over ``keys`` cached latents: ``kv_b_proj``'s output ``[T, heads, nope + v]`` and the keys
    ``[heads, T, nope + rope]`` (the values are a view of the former), in the compute dtype."""
    return keys * heads * (2 * nope + value + rope) * compute_bytes


def latent_query_bytes(heads: int, keys: int, compute_bytes: int) -> int:
    """One query of GLM-5's latent attention under chunked prefill (:class:`~ds_capture.target.query_blocks.
    LatentMlaBlocks`) against ``keys`` latent keys: every head's scores, fp32 with their softmax and its cast to the
    compute dtype, and the block's boolean masks."""
    return keys * (heads * (8 + compute_bytes) + 3)


def latent_attention_transient(text_config, seq_length: int, compute_bytes: int, tp_size: int) -> int:
    """GLM-5's MLA under chunked prefill, one row, alive during one layer's attention: transformers' expansion of
    the prefix (:func:`mla_expansion_bytes`; 11 GiB per layer at S = 131,072) while it stays under
    :data:`LATENT_ATTENTION_FROM_BYTES`, then the attention on the latent: the prefix's latent keys joined with their
    rotary part (``[S, kv_lora_rank + rope]``) and one block of queries' scores against them."""
    text = text_config
    heads = text.num_attention_heads // tp_size
    expanded = mla_expansion_bytes(heads, seq_length, text.qk_nope_head_dim, text.qk_rope_head_dim, text.v_head_dim,
                                   compute_bytes)
    per_query = latent_query_bytes(heads, seq_length, compute_bytes)
    latent = seq_length * (text.kv_lora_rank + text.qk_rope_head_dim) * compute_bytes
    if expanded <= LATENT_ATTENTION_FROM_BYTES:
        return expanded
    return max(LATENT_ATTENTION_FROM_BYTES, latent + block_queries(per_query) * per_query)


def compressed_rate(text_config, layer_type: str) -> int:
    if layer_type not in (text_config.layer_types or ()):
        return 0
    return int((text_config.compress_rates or {}).get(layer_type, 0))


def v41_dense_attention_bias(text_config, batch: int, seq_length: int, queries: int | None = None,
                             compute_bytes: int = 2) -> int:
    """DeepSeek-V4.1's SDPA / eager attention (NeMo's non-TileLang path) at the layer with the smallest compress ratio
    (W = S / ratio compressed keys): the larger of its two transients, which are never alive together.

    - the fp32 bias ``[B, H, Q, K + 1]`` (K keys and one sink column), built as a ``[B, 1, Q, K]`` mask, its masked
      copy, then the expanded concatenation. A whole row (``queries`` None or S): Q = S and K = S + W (the window's
      mask spans the row); about 8.6 GB per call at H = 64, S = 4096, ratio 4, B = 1. A chunk of Q queries
      (``capture.chunked_prefill``, :mod:`ds_capture.target.nemo_v41_chunks`): K = (window - 1) + Q + W, the window's
      tail, the chunk and the row's compressed keys;
    - the indexer's scores ``[B, Q, Hi, W]`` in the compute dtype: the einsum's, their ReLU and the weighted
      product alive together (NeMo's BF16 reference path; then ``[B, Q, W]``)."""
    ratios = [r for r in text_config.compress_ratios[: text_config.num_hidden_layers] if r]
    width = seq_length // min(ratios) if ratios else 0
    queries = seq_length if queries is None or queries >= seq_length else queries
    window = seq_length if queries == seq_length else min(text_config.sliding_window - 1, seq_length) + queries
    keys = window + width
    heads = text_config.num_attention_heads
    bias = batch * queries * 4 * (2 * keys + heads * (keys + 1))
    indexer = 3 * batch * queries * text_config.index_n_heads * width * compute_bytes if ratios else 0
    return max(bias, indexer)
