"""The memory model behind ``ds-capture plan``: bytes per stored parameter, forward activations, capture buffers,
the writer's device and host memory, and the cache's size. Pure arithmetic, no torch, no model.

In:  numbers read off the sharded meta model (:mod:`ds_capture.sizing.command` extracts them into :class:`BlockShapes`),
     the run's batch shape and dtypes, and the target's ``quantization_config``.
Out: byte counts, each named, so the report can say which term dominates.

Everything here is an **estimate** of what the PyTorch caching allocator holds at the forward's peak; the terms
and their assumptions are written next to each function. Parameters are not estimated: they are counted from
the sharded meta model by :mod:`ds_capture.sizing.command`.

    T = B x S tokens of one micro-batch, H = hidden size, c = compute dtype bytes, K = experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

GIB = 1 << 30

RUNTIME_RESERVE_BYTES = 3 * GIB
"""A flat allowance per GPU for the CUDA context, NCCL communicators, cuBLAS workspaces and allocator slack
(not measured here: no GPU was available; typical figures are 0.5-1 GiB of context plus 1-2 GiB of NCCL)."""

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per element of the compute and cache dtypes, by their recipe names."""

DEFAULT_GPU_MEMORY_GIB = 79.6
"""The budget when no CUDA device is visible: an 80 GB H100 / A100 (torch reports 85.5e9 bytes, 79.6 GiB)."""


# ----------------------------------------------------------------------------------------------------------------
# Parameters: bytes per element as stored on the device.

@dataclass(frozen=True)
class ExpertStorage:
    """How the routed experts are held on the device: ``format`` at ``bytes_per_param`` (scales included)."""

    format: str
    """``dequantized`` (to the compute dtype), or the checkpoint's own: ``fp8``, ``fp4``, ``int4``."""
    bytes_per_param: float | None = None
    """None for ``dequantized`` (the parameter's own dtype size)."""
    detail: str = ""


COMPUTE_STORAGE = ExpertStorage(format="dequantized", detail="experts dequantized to the compute dtype")


def checkpoint_expert_storage(quantization: Mapping[str, Any] | None) -> ExpertStorage | None:
    """The routed experts' resident size when they stay in the checkpoint's quantized format
    (``capture.expert_storage: checkpoint``), from ``config.json``'s ``quantization_config``; None if unquantized.

    - ``fp8`` (DeepSeek-V3, Kimi-K2): 1 byte per parameter + one fp32 scale per ``weight_block_size`` block
      (128 x 128: 4 / 16384 bytes per parameter);
    - ``expert_dtype: fp4`` inside an fp8 config (DeepSeek-V4): 0.5 byte + one 1-byte (ue8m0) scale per 32;
      ``mxfp4`` likewise;
    - ``compressed-tensors`` with 4-bit weights (Kimi-K2 INT4 releases): 0.5 byte + one bf16 scale per
      ``group_size`` (32 when absent).
    """
    if not quantization:
        return None
    method = str(quantization.get("quant_method", "")).lower()
    expert_dtype = str(quantization.get("expert_dtype") or "").lower()
    if expert_dtype in ("fp4", "mxfp4", "nvfp4") or method == "mxfp4":
        return ExpertStorage(format="fp4", bytes_per_param=0.5 + 1 / 32, detail="fp4 + one 1-byte scale per 32")
    if method == "fp8":
        block = quantization.get("weight_block_size") or [128, 128]
        per_block = block[0] * block[1]
        return ExpertStorage(format="fp8", bytes_per_param=1 + 4 / per_block,
                             detail=f"fp8 + one fp32 scale per {block[0]}x{block[1]} block")
    if method == "compressed-tensors":
        weights = _compressed_tensors_weights(quantization)
        if "mxfp4" in str(quantization.get("format", "")).lower() or (
                str(weights.get("type", "")).lower() == "float" and int(weights.get("num_bits", 8)) == 4):
            # Kimi K3's MXFP4 experts: packed e2m1 pairs + one uint8 (e8m0) scale per group of 32.
            group = int(weights.get("group_size") or 32)
            return ExpertStorage(format="mxfp4", bytes_per_param=0.5 + 1 / group,
                                 detail=f"mxfp4 (packed e2m1) + one 1-byte e8m0 scale per {group}")
        bits = int(weights.get("num_bits", 8))
        group = int(weights.get("group_size") or 32)
        if bits == 4:
            return ExpertStorage(format="int4", bytes_per_param=0.5 + 2 / group,
                                 detail=f"int4 + one bf16 scale per {group}")
        if bits == 8:
            return ExpertStorage(format="int8", bytes_per_param=1 + 2 / group,
                                 detail=f"int8 + one bf16 scale per {group}")
    return ExpertStorage(format=f"unknown ({method or 'no quant_method'})", bytes_per_param=None,
                         detail="no size rule for this quantization; sized as the compute dtype")


def _compressed_tensors_weights(quantization: Mapping[str, Any]) -> Mapping[str, Any]:
    for group in (quantization.get("config_groups") or {}).values():
        if isinstance(group, Mapping) and isinstance(group.get("weights"), Mapping):
            return group["weights"]
    return {}


def stored_bytes(numel: int, itemsize: int, *, is_routed_expert: bool, storage: ExpertStorage) -> float:
    """Device bytes of ``numel`` elements of one tensor: its own dtype, or the experts' quantized storage."""
    if is_routed_expert and storage.bytes_per_param is not None:
        return numel * storage.bytes_per_param
    return numel * itemsize


# ----------------------------------------------------------------------------------------------------------------
# Forward activations (estimate).

@dataclass(frozen=True)
class BlockShapes:
    """What the activation estimate needs, read off one rank's sharded meta model."""

    hidden_size: int
    residual_streams: int
    """Copies of the residual stream per token (DeepSeek-V4's hyper-connections: hc_mult; else 1)."""
    attention_outputs: int
    """Largest, over decoder layers, sum of the output features of the attention block's projections on this rank."""
    attention_heads: int
    """Attention heads on this rank (for the eager implementation's score matrix)."""
    mlp_outputs: int
    """Largest sum of the output features of a dense / shared MLP's projections on this rank."""
    head_dim: int
    """Per-head width of the attention's keys (for the eager implementation's repeated keys / values)."""
    kv_heads: int
    """Key/value heads on this rank (fewer than ``attention_heads``: eager repeats them)."""
    experts_per_token: int
    expert_intermediate: int
    """I of one routed expert (its down_proj input); 0 for a dense target."""
    vocab_size: int


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    note: str = ""


def forward_activation_terms(shapes: BlockShapes, *, micro_batch_size: int, seq_length: int, compute_bytes: int,
                             ep_size: int, tp_size: int, fp32_row_parallel: bool, attn_implementation: str,
                             keys_per_query: float = 1.0, indexer_bytes: int = 0, bias_bytes: int = 0,
                             dequantized_experts_bytes: int = 0, chunk_tokens: int | None = None,
                             carried_bytes: int = 0, carried_transient_bytes: int = 0,
                             indexer_queries: int | None = None, chunk_keys: int | None = None,
                             sdpa_mask_copy: bool = True) -> tuple[list[Term], Term]:
    """The live tensors of the heaviest moment of one forward at ``micro_batch_size x seq_length``.

    Returns (the terms alive through the whole layer stack, the largest per-block transient). The block
    transients are not additive: one block runs at a time, so the peak is the stack terms + the largest block.
    ``attn_implementation`` is the one the model resolved (DeepSeek-V4 supports only ``eager``); ``keys_per_query``
    the attention's keys per query relative to S (compressed KV appended); ``indexer_bytes`` the fp32 scores a
    sparse-attention indexer materialises (the family's rule, :mod:`ds_capture.target.families`); ``bias_bytes`` a
    dense attention bias alive with the attention, at the forward's queries (DeepSeek-V4.1's fp32
    ``[B, H, Q, K + 1]``, or its indexer's scores where larger: :func:`~ds_capture.target.attention_sizes.
    v41_dense_attention_bias`);
    ``dequantized_experts_bytes`` one MoE layer's local experts in the compute dtype, which resident quantized
    experts (``capture.expert_storage: checkpoint``) cost while that layer runs (grouped experts).
    ``chunk_tokens`` (``capture.chunked_prefill``): every per-token term counts one chunk's queries against the whole
    row's keys (the indexer's rows too), and the stack holds ``carried_bytes``, the row's carried state
    (:mod:`ds_capture.sizing.carried_state`); ``carried_transient_bytes`` what one layer's attention expands from it
    for the last chunk (a NeMo carrier's: MLA's prefix keys and values from the latent; GLM-5's latent keys and a
    block of queries' scores against them);
    ``indexer_queries`` the queries an indexer scores at once under chunks (its block,
    :func:`ds_capture.target.attention_sizes.block_queries`); ``chunk_keys`` the keys each of a chunk's
    queries attends to where that is fewer than the row's (DeepSeek-V4: a sliding window's tail and the compressed
    keys); ``sdpa_mask_copy``: under chunks, sdpa turns the boolean ``[B, 1, C, S]`` mask into an additive one in
    the compute dtype (False where the family's chunked attention takes no sdpa: GLM-5's on the latent).
    Assumptions: every row at full ``seq_length`` (the worst micro-batch); sdpa's memory-efficient CUDA kernel (no
    [S, S] scores; on CPU, MLA's unequal q/v head dims fall back to the math kernel, which materialises them);
    balanced routing (each EP rank receives T*K pairs; a hot rank receives more). tests/unit/test_sizing_estimate.py
    checks the estimate against a measured forward (at least the peak, at most 3x it).
    """
    B, S, H, c = micro_batch_size, seq_length, shapes.hidden_size, compute_bytes
    Q = min(chunk_tokens or S, S)  # queries per forward: the chunk's, or the whole row's
    T = B * Q
    indexer_rows = min(Q, indexer_queries or Q) if Q < S else Q  # chunked: the indexer scores a block at a time
    indexer_bytes = indexer_bytes * indexer_rows // S  # its rows are the queries (a bias is the family's own count at Q)
    stack = [
        Term("residual stream", 3 * T * H * shapes.residual_streams * c,
             f"hidden, residual and normed input [T, {shapes.residual_streams} x H]"),
        Term("attention mask", B * Q * S, "the model's [B, 1, S, S] boolean causal mask (sliding windows, eager "
                                        "attention; sdpa without a window needs none: no padding mask is passed)"
             if Q == S else f"the model's [B, 1, {Q}, S] boolean mask of a chunk against its prefix"),
    ]
    if Q < S:
        stack.append(Term("carried state", carried_bytes, f"chunked prefill: what each layer carries from the row's "
                                                          f"earlier chunks of {Q} tokens, at S"))
    attention = 2 * T * shapes.attention_outputs * c
    note = "2 x every attention projection's output (q, kv, o, indexer...) on this rank"
    if fp32_row_parallel and tp_size > 1:
        attention += T * H * 4
        note += " + the fp32 row-parallel o_proj output"
    keys = chunk_keys if Q < S and chunk_keys else int(S * keys_per_query)
    scores, scores_note = _score_terms(shapes, B=B, Q=Q, S=S, keys=keys, c=c, attn_implementation=attn_implementation,
                                       bias_bytes=bias_bytes, indexer_bytes=indexer_bytes, indexer_rows=indexer_rows)
    attention, note = attention + scores, note + scores_note
    if Q < S and attn_implementation == "sdpa" and sdpa_mask_copy:
        attention += B * Q * keys * (c + 1)  # where(mask.logical_not(), -inf, 0): a boolean and an additive copy
        note += f" + sdpa's additive copy of the chunk's [B, 1, {Q}, {keys}] mask"
    if Q < S and carried_transient_bytes:
        attention += carried_transient_bytes
        note += f" + what one layer's attention builds from the carried state ({carried_transient_bytes / GIB:.1f} GiB)"
    blocks = [Term("attention block", attention, note),
              Term("dense / shared MLP block", 2 * T * shapes.mlp_outputs * c,
                   "2 x every MLP projection's output on this rank")]
    if shapes.experts_per_token:
        blocks.append(_moe_block(shapes, T=T, c=c, ep_size=ep_size, dequantized_experts_bytes=dequantized_experts_bytes))
    return stack, max(blocks, key=lambda term: term.bytes)


def _moe_block(shapes: BlockShapes, *, T: int, c: int, ep_size: int, dequantized_experts_bytes: int) -> Term:
    """The MoE block of ``T`` tokens: the expert-parallel dispatch or the grouped experts' math on T x K pairs, the
    shared experts, and one layer's resident experts dequantized."""
    H = shapes.hidden_size
    P, I = T * shapes.experts_per_token, shapes.expert_intermediate
    expert_math = P * (3 * H + 3 * I) * c  # gathered rows, gate_up [2I], act [I], out [H], weighted [H]
    combine = P * H * 4  # routing weights are fp32: the weighted [T, K, H] product is fp32
    if ep_size > 1:
        dispatch = 4 * P * H * c  # send, receive, return trip, pairs back in order
        routed = dispatch + max(expert_math, combine)
        note = (f"expert-parallel dispatch 4 x [T*K, H] + expert math on T*K = {P:,} pairs "
                f"(balanced routing)")
    else:
        routed = expert_math + combine
        note = f"grouped experts on T*K = {P:,} pairs + the fp32 weighted combine"
    if dequantized_experts_bytes:
        note += f" + the layer's resident experts dequantized ({dequantized_experts_bytes / GIB:.1f} GiB)"
    return Term("MoE block", routed + T * H * c + 2 * T * shapes.mlp_outputs * c + dequantized_experts_bytes,
                note + " + the shared experts")


def _score_terms(shapes: BlockShapes, *, B: int, Q: int, S: int, keys: int, c: int, attn_implementation: str,
                 bias_bytes: int, indexer_bytes: int, indexer_rows: int) -> tuple[int, str]:
    """The attention's score-sized tensors of ``Q`` queries against ``keys`` keys: eager scores (and repeated keys /
    values), a dense bias, or an indexer's scores of ``indexer_rows`` queries, whichever is larger (in turn)."""
    scores, note = 0, ""
    if attn_implementation == "eager":
        scores = eager_scores_bytes(B, shapes.attention_heads, Q, keys, c)
        if shapes.kv_heads < shapes.attention_heads:  # repeat_kv materialises keys and values per query head
            scores += 2 * B * shapes.attention_heads * keys * shapes.head_dim * c
        note += f" + eager attention's [B, {shapes.attention_heads}, {'S' if Q == S else Q}, {keys}] scores (3 live copies)"
    if bias_bytes:
        scores += bias_bytes
        note += f" + the dense fp32 attention bias ({bias_bytes / GIB:.1f} GiB)"
    if indexer_bytes:
        block = f" of a block of {indexer_rows} queries" if indexer_rows < Q else ""
        note += f" + the sparse-attention indexer's fp32 scores{block} ({indexer_bytes / GIB:.1f} GiB, before the scores)"
    return max(scores, indexer_bytes), note


def eager_scores_bytes(batch: int, heads: int, queries: int, keys: int, compute_bytes: int) -> int:
    """Eager attention's score-sized tensors alive at once: scores, masked logits, softmax (fp32 or its cast)."""
    return batch * heads * queries * keys * (2 * compute_bytes + 4)


def capture_terms(*, micro_batch_size: int, seq_length: int, hidden_size: int, num_held: int, num_layer_ids: int,
                  compute_bytes: int, cache_bytes: int, chunk_tokens: int | None = None) -> tuple[Term, int]:
    """(the current forward's captures on the device, on the host).

    Whole rows: the hooked layers' outputs held until the forward ends (``num_held`` of them, in the compute dtype)
    and the collected ``[B, S, H*k]`` + ``[B, S, H]`` in the cache dtype, all on the device. Chunked (``run``): each
    chunk's captures leave the device as they are recorded, so the device holds one chunk's hooked outputs at most
    and the row's (held and collected, the pieces of each hooked layer and their join) are on the host."""
    T = micro_batch_size * seq_length
    held = num_held * T * hidden_size * compute_bytes
    collected = (num_layer_ids + 1) * T * hidden_size * cache_bytes
    if chunk_tokens and chunk_tokens < seq_length:
        # On the host, collect joins each layer's pieces (a copy) while the pieces are still held, then the states.
        return (Term("capture buffers", num_held * micro_batch_size * chunk_tokens * hidden_size * compute_bytes,
                     f"one chunk's {num_held} hooked layer outputs (the row's leave the device per chunk)"),
                2 * held + collected)
    return Term("capture buffers", held + collected,
                f"{num_held} hooked layer outputs held during the forward + the collected states"), 0


def writer_memory(micro_batch: int, *, is_writer: bool, buffer_bytes: int) -> tuple[Term, Term]:
    """(device, host) memory of one rank's shard writer.

    The writer (``capture.writer_buffer_mib``): captured states leave the device right after each forward
    (nothing waiting to be written holds device memory beyond the current forward's captures, counted in
    :func:`capture_terms`); the host holds the micro-batches waiting to be written in buffers (pinned on CUDA)
    bounded by ``buffer_bytes``, at least one micro-batch whatever the setting, and never a whole shard. Only the
    tp-rank-0 of each DP group writes. Adjust here if the writer's bounds change.
    """
    if not is_writer:
        return Term("writer (device)", 0), Term("writer (host)", 0, "not a writing rank")
    return (Term("writer (device)", 0, "states leave the device after each forward"),
            Term("writer (host)", max(buffer_bytes, micro_batch), "capture.writer_buffer_mib, at least one micro-batch"))


# ----------------------------------------------------------------------------------------------------------------
# The cache.

def cache_bytes_per_sample(*, seq_length: int, hidden_size: int, num_layer_ids: int, cache_bytes: int) -> int:
    """One row of a shard as format v1 stores it: padded to S (ids, loss_mask int64; both state tensors)."""
    return seq_length * (2 * 8 + hidden_size * (num_layer_ids + 1) * cache_bytes)


def eagle3_row_bytes(*, seq_length: int, hidden_size: int, num_layer_ids: int, cache_bytes: int,
                     draft_vocab_size: int, target_probs_topk: int) -> int:
    """One row of an EAGLE-3 v2 shard, padded to S: ``input_ids``, ``attention_mask``, ``loss_mask`` (int64),
    ``aux_hidden_states`` ``[S, k*H]`` (cache dtype), ``position_mask`` (bool), and ``target_probs`` ``[S, Vd]`` in
    the cache dtype, or its top-k values (cache dtype) + int32 indices ``[S, topk]`` where 0 < topk < Vd."""
    compressed = 0 < target_probs_topk < draft_vocab_size
    probs = target_probs_topk * (cache_bytes + 4) if compressed else draft_vocab_size * cache_bytes
    return seq_length * (3 * 8 + num_layer_ids * hidden_size * cache_bytes + 1 + probs)


def target_weights_bytes(*, vocab_size: int, hidden_size: int, cache_bytes: int) -> int:
    """``target_weights.safetensors``: embed_tokens and lm_head, full, in the cache dtype."""
    return 2 * vocab_size * hidden_size * cache_bytes
