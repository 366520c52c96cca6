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


def v41_dense_attention_bias(text_config, batch: int, seq_length: int) -> int:
    """DeepSeek-V4.1's SDPA / eager attention (NeMo's non-TileLang path): an fp32 bias ``[B, H, S, S + W + 1]``
    (the sliding-window mask over S keys, W = S / ratio compressed keys, one sink column), built as a
    ``[B, 1, S, S + W]`` mask, its masked copy, then the expanded concatenation. At the layer with the smallest
    compress ratio; about 8.6 GB per call at H = 64, S = 4096, ratio 4, B = 1."""
    ratios = [r for r in text_config.compress_ratios[: text_config.num_hidden_layers] if r]
    width = seq_length // min(ratios) if ratios else 0
    keys = seq_length + width
    heads = text_config.num_attention_heads
    return batch * seq_length * 4 * (2 * keys + heads * (keys + 1))
