"""EAGLE-3's draft vocabulary and the target's distribution over it, in chunks of positions.

In: tokenized rows (``input_ids`` / ``loss_mask`` [N, S]) for the vocabulary; per forward the target's
post-final-norm hidden state ``[B, T, H]`` (compute dtype), the full lm_head matrix ``[V, H]`` and the rows'
content lengths. Out: ``selected_token_ids`` (NeMo 0.7.0's ``build_eagle3_token_mapping``, summed over the
data-parallel ranks) and, per micro-batch, the shifted ``position_mask`` ``[B, S, 1]`` and ``target_probs``
``[B, S, Vd]`` (or its top-k values / int32 draft-vocab indices ``[B, S, k]``) that NeMo's
``_compute_target_distribution`` + ``compress_target_probs`` produce.

Memory bound: no ``[B, S, V]`` tensor exists. Logits are computed for at most
``chunk_positions(V) = max(1, LOGITS_CHUNK_BYTES // (V * 4))`` positions at a time (the chunk's
``[C, V]`` logits, its fp32 draft-vocab softmax ``[C, Vd]`` and its argmax: about 2 x 64 MiB at
most, whatever B, S and V), and only at content positions.

Shift (EAGLE3_CACHE.md §3): slot ``t`` holds the distribution of position ``t + 1``. Slots whose
source position is not content (``t + 1 >= num_tokens``, and always ``S - 1``) hold the uniform
distribution NeMo writes at ``S - 1`` (the softmax of zero logits) and ``position_mask`` False: the
cache then does not depend on how rows were batched or how far padding was computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The model's own last-position logits must equal lm_head(final norm output) within this (x max |logit|):
# summation order across TP ranks aside, a family that post-processes its logits fails it loudly.
_LOGITS_TOLERANCE = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 3e-2}


def logits_mismatch(ours: torch.Tensor, output, compute_dtype: torch.dtype) -> str | None:
    """Why the model's own last-position logits (``output``, or its ``.logits``) are not ``ours`` (lm_head of the
    final norm output at the last position, [B, V]), or None where they are: the check the EAGLE-3 kind and
    ``ds-capture serve`` both make before computing a distribution from the final hidden state."""
    logits = output.logits if hasattr(output, "logits") else output  # NeMo's own classes may return the tensor
    theirs = logits[:, -1].float()
    scale = max(1.0, float(theirs.abs().max()))
    diff = float((ours.float() - theirs).abs().max())
    if diff > _LOGITS_TOLERANCE[compute_dtype] * scale:
        return (f"the target's logits are not lm_head(final norm output) (max |difference| {diff:.3g} at the last "
                f"position, logits up to {scale:.3g}): this family post-processes its logits")
    return None


LOGITS_CHUNK_BYTES = 64 * 2**20
"""Upper bound on one chunk's fp32-sized logits (C positions x V); the distribution's working memory."""

ROW_LOGITS_CHUNK_BYTES = 256 * 2**20
"""``serve``'s bound on one chunk of whole rows' fp32-sized logits (b rows x S x V); at least one row."""


def count_supervised_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int64 [V]: how often each id occurs at ``loss_mask == 1`` (unshifted rows); ids outside [0, V) dropped."""
    ids = input_ids[loss_mask.bool()].to(torch.long).flatten()
    ids = ids[(ids >= 0) & (ids < vocab_size)]
    counts = torch.zeros(vocab_size, dtype=torch.long)
    return counts.scatter_add_(0, ids, torch.ones_like(ids))


def sum_counts_over_ranks(counts: torch.Tensor, *, contributes: bool) -> torch.Tensor:
    """The dataset-wide counts on every rank (collective: every rank must call it).

    Only one rank per DP group ``contributes`` (the ranks of a TP group tokenised the same rows).
    """
    import torch.distributed as torch_dist

    from ds_capture.capture.progress import collective_device

    local = counts if contributes else torch.zeros_like(counts)
    if not torch_dist.is_initialized():
        return local
    summed = local.to(collective_device())
    torch_dist.all_reduce(summed)  # every rank enters this all-reduce, whatever its data
    return summed.cpu()


def select_draft_vocab(counts: torch.Tensor, *, draft_vocab_size: int | None,
                       special_token_ids: list[int | None]) -> list[int]:
    """NeMo's selection: specials first (bos, eos, pad, unk order), then counted ids by count descending,
    ties to the lower id (a stable sort), then unused ids from 0 upward; truncated to ``draft_vocab_size``.

    ``draft_vocab_size`` None or >= V: the identity over the full vocabulary (no counts needed).
    """
    vocab_size = int(counts.numel())
    if draft_vocab_size is None or draft_vocab_size >= vocab_size:
        return list(range(vocab_size))
    selected: list[int] = []
    seen: set[int] = set()
    for token_id in special_token_ids:
        if token_id is None or not 0 <= token_id < vocab_size or token_id in seen:
            continue
        selected.append(int(token_id))
        seen.add(int(token_id))
    for token_id in torch.argsort(counts, descending=True, stable=True).tolist():
        if len(selected) >= draft_vocab_size or counts[token_id] == 0:
            break  # sorted by count: the rest are zero
        if token_id not in seen:
            selected.append(token_id)
            seen.add(token_id)
    for token_id in range(vocab_size):
        if len(selected) >= draft_vocab_size:
            break
        if token_id not in seen:
            selected.append(token_id)
            seen.add(token_id)
    return selected[:draft_vocab_size]


def is_compressed(target_probs_topk: int, draft_vocab_size: int) -> bool:
    """NeMo's rule: top-k is stored only when it compresses (0 < k < Vd)."""
    return 0 < target_probs_topk < draft_vocab_size


def chunk_positions(vocab_size: int) -> int:
    """Positions per logits chunk: the module's memory bound."""
    return max(1, LOGITS_CHUNK_BYTES // (vocab_size * 4))


def rows_per_chunk(seq_length: int, vocab_size: int) -> int:
    """Whole rows per logits chunk in ``serve`` (:data:`ROW_LOGITS_CHUNK_BYTES`; at least one row)."""
    return max(1, ROW_LOGITS_CHUNK_BYTES // (seq_length * vocab_size * 4))


class FullLogits:
    """The whole lm_head ``[V, H]`` in the compute dtype on the compute device (read from the checkpoint, so every
    layout multiplies the same matrix the same way); what the cache's distribution and serve's supervision share."""

    def __init__(self, lm_head: torch.Tensor) -> None:
        self.lm_head = lm_head
        self.vocab_size = int(lm_head.shape[0])

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """[..., V] logits of hidden states [..., H], as the model's own lm_head computes them (on its device: a
        chunked row's states reach the kind on the host)."""
        return F.linear(last.to(self.lm_head.device), self.lm_head)


class DraftDistribution(FullLogits):
    """The shifted EAGLE-3 supervision of one micro-batch from its final hidden states and the lm_head.

    ``lm_head`` is the full [V, H] matrix in the compute dtype on the compute device (read from the
    checkpoint, so every layout multiplies the same matrix the same way: TP, EP and FSDP2 give the
    single process's values from the single process's final hidden state).
    """

    def __init__(self, lm_head: torch.Tensor, selected_token_ids: list[int], *, target_probs_topk: int,
                 cache_dtype: torch.dtype) -> None:
        super().__init__(lm_head)
        self.selected = torch.tensor(selected_token_ids, dtype=torch.long, device=lm_head.device)
        self.selected_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=lm_head.device)
        self.selected_mask[self.selected] = True
        self.draft_vocab_size = len(selected_token_ids)
        self.topk = target_probs_topk if is_compressed(target_probs_topk, self.draft_vocab_size) else 0
        self.cache_dtype = cache_dtype
        self.chunk = chunk_positions(self.vocab_size)
        # The value every non-content slot holds: softmax of zero logits (NeMo's S - 1), through the same top-k
        # on the same device (the order top-k gives exact ties is the backend's).
        uniform = torch.softmax(torch.zeros(1, self.draft_vocab_size, device=lm_head.device), dim=-1)
        self._filler = {name: value.cpu() for name, value in self._encode(uniform).items()}

    def compute(self, last: torch.Tensor, loss_mask: torch.Tensor, num_tokens: torch.Tensor,
                seq_length: int) -> dict[str, torch.Tensor]:
        """Shifted supervision for B rows: ``position_mask`` [B, S, 1] bool and ``target_probs`` [B, S, Vd] or
        ``target_probs_values`` / ``target_probs_indices`` [B, S, k], on the CPU in the cache dtype / int32.

        ``last`` [B, T, H] (T <= S computed positions); ``loss_mask`` [B, S] unshifted; ``num_tokens`` [B].
        """
        B, T = last.shape[:2]
        S = seq_length
        # Source positions p = t + 1 that are content: 1 <= p < num_tokens (and p < T).
        positions = torch.arange(T)
        content = (positions[None, :] >= 1) & (positions[None, :] < num_tokens[:, None].clamp(max=T))
        rows, sources = content.nonzero(as_tuple=True)
        out = {name: filler[None].expand(B, S, -1).clone() for name, filler in self._filler.items()}
        position_mask = torch.zeros(B, S, 1, dtype=torch.bool)
        flat = last[rows.to(last.device), sources.to(last.device)]  # [N, H] content positions only
        for lo in range(0, len(rows), self.chunk):
            hi = min(lo + self.chunk, len(rows))
            logits = self.logits(flat[lo:hi])  # [C, V]: the only full-vocab tensor, C <= self.chunk
            top = logits.argmax(dim=-1)
            probs = torch.softmax(logits.index_select(-1, self.selected).float(), dim=-1)  # [C, Vd] fp32
            del logits
            r, t = rows[lo:hi], sources[lo:hi] - 1
            supervised = self.selected_mask[top].cpu() & loss_mask[r, t + 1].bool()
            position_mask[r, t, 0] = supervised
            for name, value in self._encode(probs).items():
                out[name][r, t] = value.cpu()
        out["position_mask"] = position_mask
        return out

    def _encode(self, probs: torch.Tensor) -> dict[str, torch.Tensor]:
        """fp32 probabilities [N, Vd] -> the stored representation (NeMo's ``compress_target_probs``)."""
        if not self.topk:
            return {"target_probs": probs.to(self.cache_dtype)}
        values, indices = torch.topk(probs, self.topk, dim=-1)
        values = values / values.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        return {"target_probs_values": values.to(self.cache_dtype), "target_probs_indices": indices.to(torch.int32)}
