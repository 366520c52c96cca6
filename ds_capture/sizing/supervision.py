"""The supervising rank's extra memory: EAGLE-3's whole lm_head and one chunk of its full-vocabulary logits.

In:  the :class:`~ds_capture.sizing.session_plan.SessionPlan` (the cache kind supervises or not, the driver), the
     target's vocabulary and hidden size, the compute dtype, the draft vocabulary size.
Out: :func:`supervision_of` -> a :class:`Supervision` (None where nothing is supervised: DSpark), whose
     :meth:`~Supervision.device_terms` are one supervising rank's device bytes and :meth:`~Supervision.answer_bytes`
     serve's answer on the host.

The supervising ranks are the first rank of each TP group: ``run``'s writers (the cache kind's
:class:`~ds_capture.cache.eagle3.draft_distribution.DraftDistribution`) and ``serve``'s listeners (its
``Supervisor``). Each holds the checkpoint's whole lm_head ``[V, H]`` in the compute dtype, beside the model's own
(sharded) copy, and computes full-vocabulary logits one chunk at a time. The chunk's peak, per element of its
``[n, V]`` logits, with c = compute bytes and Vd = the draft vocabulary:

- ``run``: n = ``chunk_positions(V)`` content positions; the logits (c) beside the draft columns they select (c),
  their fp32 copy (4) and its softmax (4): ``n x (V x c + Vd x max(c + 4, 8))``; plus the content positions'
  final states gathered for it, ``B x S x H x c`` (whole rows; under chunked prefill they are on the host);
- ``serve``: n = ``rows_per_chunk(S, V) x S`` (whole rows, at most ``--max-batch-rows``); the logits and their
  left-shifted copy (2c), then the shifted logits beside their fp32 copy and its softmax (c + 8; the client's draft
  vocabulary can be the whole one): ``n x V x max(2c, c + 8)``.

At V = 164K and S = 4096 in bf16, serve's chunk is one row: 1.25 GiB of logits, 6.3 GiB at its peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds_capture.cache.eagle3.draft_distribution import chunk_positions, rows_per_chunk
from ds_capture.sizing import memory_model as mm


@dataclass(frozen=True)
class Supervision:
    """What one supervising rank computes (see the module docstring)."""

    driver: str
    """``run`` (the cache's distribution over content positions) or ``serve`` (the answer over whole rows)."""
    vocab_size: int
    draft_vocab_size: int
    hidden_size: int
    compute_bytes: int

    def lm_head_bytes(self) -> int:
        return self.vocab_size * self.hidden_size * self.compute_bytes

    def logits_positions(self, micro_batch_size: int, seq_length: int) -> int:
        """n: the positions of one chunk of full-vocabulary logits."""
        if self.driver == "serve":
            return min(micro_batch_size, rows_per_chunk(seq_length, self.vocab_size)) * seq_length
        return min(micro_batch_size * seq_length, chunk_positions(self.vocab_size))

    def logits_chunk_bytes(self, micro_batch_size: int, seq_length: int, chunk_tokens: int | None = None) -> int:
        """The chunk's peak (module docstring), with run's gathered content states where they are on the device."""
        c, V, Vd = self.compute_bytes, self.vocab_size, self.draft_vocab_size
        n = self.logits_positions(micro_batch_size, seq_length)
        if self.driver == "serve":
            return n * V * max(2 * c, c + 8)
        states = 0 if chunk_tokens and chunk_tokens < seq_length else (
            micro_batch_size * seq_length * self.hidden_size * c)
        return n * (V * c + Vd * max(c + 4, 8)) + states

    def device_terms(self, micro_batch_size: int, seq_length: int, chunk_tokens: int | None = None) -> list[mm.Term]:
        n = self.logits_positions(micro_batch_size, seq_length)
        return [mm.Term("supervision lm_head", self.lm_head_bytes(),
                        f"the whole lm_head [{self.vocab_size}, {self.hidden_size}] in the compute dtype"),
                mm.Term("supervision logits", self.logits_chunk_bytes(micro_batch_size, seq_length, chunk_tokens),
                        f"one chunk of full-vocabulary logits, {n} positions, at its peak")]

    def answer_bytes(self, micro_batch_size: int, seq_length: int, num_layer_ids: int) -> int:
        """``serve``: one answer on the listener's host (aux states in the compute dtype, fp32 ``target_probs`` over
        the whole vocabulary, ``position_mask``, shifted ``input_ids`` / ``loss_mask``); 0 for ``run``, whose
        host memory is its writer's."""
        if self.driver != "serve":
            return 0
        per_position = num_layer_ids * self.hidden_size * self.compute_bytes + 4 * self.vocab_size + 1 + 2 * 8
        return micro_batch_size * seq_length * per_position


def supervision_of(session: Any, cfg: Any, compute_bytes: int) -> Supervision | None:
    """The session's supervision (None where its cache kind supervises nothing)."""
    if not session.supervised:
        return None
    vocab = session.target.vocab_size
    draft = cfg.recipe_args.draft_vocab_size
    return Supervision(driver=session.driver, vocab_size=vocab, hidden_size=session.target.hidden_size,
                       draft_vocab_size=vocab if session.serve or not draft else min(draft, vocab),
                       compute_bytes=compute_bytes)
