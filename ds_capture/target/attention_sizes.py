"""Attention-score sizes of the families whose attention materialises more than ``[B, H, S, S]``: the DSA and CSA
indexers, and DeepSeek-V4's compressed keys appended to every query's own. Pure arithmetic on a text config.

In: a family's text config, a batch and a sequence length. Out: bytes, or keys per query. The registry names these
functions as data (``Family.indexer_scores``, ``Family.keys_per_query``); ``ds-capture plan``'s memory model
calls them through the family.
"""

from __future__ import annotations


def dsa_indexer_scores(text_config, batch: int, seq_length: int) -> int:
    """GLM-5's DSA indexer: ``matmul([B, S, Hi, D], [B, 1, D, S])`` broadcasts, so torch materialises the keys
    once per query, ``[B, S, D, S]`` fp32, next to the ``[B, S, Hi, S]`` fp32 scores; scaling and relu then hold
    two score tensors. Peak: ``B * S * S * 4 * max(D + Hi, 2 Hi)``."""
    heads, dim = text_config.index_n_heads, text_config.index_head_dim
    return batch * seq_length * seq_length * 4 * max(dim + heads, 2 * heads)


def csa_indexer_scores(text_config, batch: int, seq_length: int) -> int:
    """DeepSeek-V4's CSA indexer: the same broadcast matmul over the ``T = S / rate`` compressed keys
    (``[B, S, D, T]`` + ``[B, S, Hi, T]`` fp32), then relu and scaling hold three score tensors."""
    rate = compressed_rate(text_config, "compressed_sparse_attention")
    if not rate:
        return 0
    heads, dim = text_config.index_n_heads, text_config.index_head_dim
    return batch * seq_length * (seq_length // rate) * 4 * max(dim + heads, 3 * heads)


def compressed_keys_per_query(text_config) -> float:
    """DeepSeek-V4: every query attends to its S keys plus the compressed entries (S / rate) appended to them."""
    rates = [compressed_rate(text_config, kind) for kind in set(text_config.layer_types or ())]
    return 1 + max((1 / rate for rate in rates if rate), default=0.0)


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
