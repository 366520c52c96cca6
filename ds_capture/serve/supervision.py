"""NeMo's ``compute_supervision`` from one forward's captures: what ``generate`` answers, key for key.

In: the hook captures of one forward over ``input_ids`` ``[B, S]`` (the 3 aux layers' outputs concatenated,
``[B, S, 3H]``, and the post-final-norm state ``[B, S, H]``, in the compute dtype), the full lm_head ``[V, H]``
read from the checkpoint (so every layout, TP and EP included, takes the argmax over the *full* vocabulary from the
single process's matrix), the client's ``loss_mask`` and its draft vocabulary. Out, as NeMo 0.7.0's
``HFEagle3TargetModel.generate_batch`` + ``_compute_target_distribution`` produce them:

- ``aux_hidden_states`` ``[B, S, 3H]`` compute dtype, unshifted;
- ``target_probs`` ``[B, S, Vd]`` float32: softmax over the draft vocabulary of the logits shifted left by one
  (the last slot holds zero logits, so the uniform distribution);
- ``position_mask`` ``[B, S, 1]`` bool: the shifted logits' argmax over the full vocabulary is in the draft
  vocabulary, and the shifted ``loss_mask`` is set;
- ``input_ids`` / ``loss_mask`` shifted left by one, 0 at ``S - 1``, in the client's dtype.

Full logits exist here only for ``rows_per_chunk`` rows at a time (``[b, S, V]``), never for the batch, and never
leave this rank. Chunks are whole rows: the matmul then has ``b x S`` rows as NeMo's ``[B, S, V]`` one does, and
measured equal bit for bit (a handful of rows at a time takes another kernel, 1e-5 off).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_capture.cache.eagle3.draft_distribution import FullLogits, rows_per_chunk
from ds_capture.cache.eagle3.kind import shift_left  # NeMo's _shift_left_with_zero, as the EAGLE-3 cache shifts


@dataclass(frozen=True)
class VocabMapping:
    """A trainer's draft vocabulary (``set_vocab_mapping``): the ids and the full-vocabulary membership mask."""

    selected_token_ids: torch.Tensor
    """int64 [Vd]."""
    selected_token_mask: torch.Tensor
    """bool [V]."""

    def same_as(self, other: "VocabMapping") -> bool:
        return (torch.equal(self.selected_token_ids, other.selected_token_ids)
                and torch.equal(self.selected_token_mask, other.selected_token_mask))


class Supervisor(FullLogits):
    """Turns captures into ``generate``'s answer (see the module docstring); one per listening rank."""

    def compute(self, aux: torch.Tensor, last: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                mapping: VocabMapping) -> dict[str, torch.Tensor]:
        """The answer for one request: ``aux`` / ``last`` are its rows of the forward (``[B, S, .]``)."""
        B, S = input_ids.shape
        selected = mapping.selected_token_ids.to(last.device)
        member = mapping.selected_token_mask.to(last.device)
        # The identity (no draft_vocab_size): index_select would only copy the logits.
        identity = selected.numel() == self.vocab_size and bool(
            torch.equal(selected, torch.arange(self.vocab_size, device=selected.device)))
        shifted_loss_mask = shift_left(loss_mask)
        probs, masks = [], []
        rows = rows_per_chunk(S, self.vocab_size)  # ds-capture plan sizes this chunk (sizing/supervision.py)
        for lo in range(0, B, rows):
            hi = min(B, lo + rows)
            logits = shift_left(self.logits(last[lo:hi]))  # [b, S, V]: the only full-vocabulary tensor
            masks.append((member[logits.argmax(dim=-1)].cpu() & shifted_loss_mask[lo:hi].bool()).unsqueeze(-1))
            probs.append(torch.softmax((logits if identity else logits.index_select(-1, selected)).float(),
                                       dim=-1).cpu())
            del logits
        target_probs = probs[0] if len(probs) == 1 else torch.cat(probs)
        position_mask = masks[0] if len(masks) == 1 else torch.cat(masks)
        return {
            "aux_hidden_states": aux.cpu(),
            "target_probs": target_probs,
            "position_mask": position_mask,
            "input_ids": shift_left(input_ids),
            "loss_mask": shifted_loss_mask,
        }
