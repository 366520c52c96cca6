"""Capture: scoped forward hooks that turn one forward pass into the cache's hidden-state tensors.

In: a plain Hugging Face causal LM (possibly sharded by an engine: its module paths are unchanged),
its :class:`~ds_capture.target.family.Family`, and the layer ids. Out, per forward: the concatenated
intermediate features ``[B, S, H*k]`` and the post-final-norm state ``[B, S, H]``.

Layer-id semantics (DESIGN §3), for L decoder layers: id ``i`` in ``0..L-2`` is the output of
decoder layer ``i`` (Hugging Face ``hidden_states[i+1]``); id ``L-1`` is the post-final-norm output
(so its slice equals the last hidden state); id ``-1`` is the embedding output. With
``pre_norm_last`` (EAGLE-3's semantics) id ``L-1`` is the last decoder layer's own output instead, and
the post-norm state is still recorded as the last hidden state. A family with a ``feature_module``
(DeepSeek-V4.1, NeMo's ``get_dspark_target_feature_modules``) captures that module's forward *input* in
layer ``i`` for every id ``0..L-1`` (the last one too), reduced by the family (mean over the streams).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from ds_capture.errors import CaptureError
from ds_capture.target.families import Family


def default_layer_ids(num_layers: int, draft_num_hidden_layers: int = 5) -> list[int]:
    """DESIGN §3 default: ``n = min(draft_layers, L-1)`` ids spread over ``1..L-1`` (round half to even)."""
    n = min(draft_num_hidden_layers, num_layers - 1)
    if n <= 1:
        return [num_layers - 1]
    return sorted({round(1 + i * (num_layers - 2) / (n - 1)) for i in range(n)})


def resolve_layer_ids(
    configured: tuple[int, ...] | None, num_layers: int, draft_num_hidden_layers: int, *, source: str,
    family: Family | None = None,
) -> list[int]:
    """The configured ids checked against the target's layer count, or the default rule.

    A family with a ``feature_module`` (DeepSeek-V4.1) takes ids ``0..L-1`` only, strictly increasing, as NeMo's
    ``get_dspark_target_feature_modules`` does."""
    if configured is None:
        return default_layer_ids(num_layers, draft_num_hidden_layers)
    if family is not None and family.feature_module:
        bad = [i for i in configured if not 0 <= i <= num_layers - 1]
        if bad or list(configured) != sorted(set(configured)):
            raise CaptureError(
                f"{source}: `recipe_args.target_layer_ids` {list(configured)}: model_type {family.model_type!r} takes "
                f"strictly increasing ids in 0..{num_layers - 1} (id i is the residual streams entering decoder layer "
                f"i, {family.feature_module}'s input, so 0 is the embedding output; -1 is not accepted, as in NeMo)."
            )
        return list(configured)
    bad = [i for i in configured if not -1 <= i <= num_layers - 1]
    if bad:
        raise CaptureError(
            f"{source}: `recipe_args.target_layer_ids` {list(configured)} has ids outside -1..{num_layers - 1} "
            f"({', '.join(map(str, bad))}); the target has {num_layers} decoder layers (-1 = embeddings, "
            f"{num_layers - 1} = post-final-norm output)."
        )
    return list(configured)


def _first_tensor(output) -> torch.Tensor:
    # Decoder layers return a tensor (transformers 5) or a tuple whose first item is the hidden state.
    return output[0] if isinstance(output, (tuple, list)) else output


def _along_sequence(chunks: list[torch.Tensor]) -> torch.Tensor:
    # A whole row's one tensor as it is (no copy); a chunked row's pieces joined along the sequence ([B, S, ...]).
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)


class LayerCapture:
    """Holds what the hooks saw during the current forward; ``collect`` assembles the features."""

    def __init__(self, layer_ids: list[int], num_layers: int, family: Family, *, pre_norm_last: bool = False) -> None:
        self.layer_ids = layer_ids
        self.num_layers = num_layers
        self.post_norm_id = None if pre_norm_last or family.feature_module else num_layers - 1
        self.family = family
        # Per layer id, what each forward of the current micro-batch saw: one tensor for a whole row, one per chunk
        # in order under chunked prefill (concatenated along the sequence by collect).
        self._seen: dict[int, list[torch.Tensor]] = {}
        self._last: list[torch.Tensor] = []
        self.to_host = False
        """Each forward's captures leave the device as they are recorded (a chunked row's, in ``run``: what grows
        with the row is then on the host; ``collect`` returns host tensors)."""

    def reset(self) -> None:
        self._seen.clear()
        self._last = []

    def _record(self, layer_id: int, hidden: torch.Tensor) -> None:
        self._seen.setdefault(layer_id, []).append(self._kept(hidden))

    def _record_last(self, hidden: torch.Tensor) -> None:
        self._last.append(self._kept(hidden))

    def _kept(self, hidden: torch.Tensor) -> torch.Tensor:
        # The same values either way: a copy to the host changes no bit (a no-op on a CPU run).
        return hidden.detach().cpu() if self.to_host else hidden.detach()

    def collect(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(target_hidden_states [B, S, H*k], target_last_hidden_states [B, S, H])`` in ``dtype``."""
        missing = [i for i in self.layer_ids if i not in self._seen and i != self.post_norm_id]
        if missing or not self._last:
            never = missing + ([] if self._last else [self.num_layers - 1])
            raise RuntimeError(
                f"layer ids {never} never fired during the forward pass: the family entry for "
                f"{self.family.model_type!r} does not match the model's module layout"
            )
        last = _along_sequence(self._last)
        features = [last if i == self.post_norm_id else _along_sequence(self._seen[i]) for i in self.layer_ids]
        hidden = torch.cat([f.to(dtype) for f in features], dim=-1)
        return hidden, last.to(dtype)


@contextmanager
def capture_hidden_states(
    model: torch.nn.Module, family: Family, layer_ids: list[int], num_layers: int, *, pre_norm_last: bool = False
) -> Iterator[LayerCapture]:
    """Register the hooks for ``layer_ids`` (+ the final norm); remove them on exit, errors included."""
    capture = LayerCapture(layer_ids, num_layers, family, pre_norm_last=pre_norm_last)
    layers = model.get_submodule(family.layers)
    handles = []
    try:
        for layer_id in layer_ids:
            if family.feature_module:  # the module's input: the streams entering layer `layer_id`
                module = getattr(family.layer(layers, layer_id), family.feature_module)
                handles.append(module.register_forward_pre_hook(
                    lambda _m, args, layer_id=layer_id: capture._record(layer_id, family.reduce_layer_output(args[0]))
                ))
                continue
            if layer_id == -1:
                module = model.get_submodule(family.embed_tokens)
            elif layer_id != capture.post_norm_id:
                module = family.layer(layers, layer_id)
            else:
                continue  # L-1 is the final norm output, recorded below for every run
            handles.append(module.register_forward_hook(
                lambda _m, _args, output, layer_id=layer_id: capture._record(
                    layer_id, family.reduce_layer_output(_first_tensor(output)))
            ))
        handles.append(model.get_submodule(family.final_norm).register_forward_hook(
            lambda _m, _args, output: capture._record_last(_first_tensor(output))
        ))
        yield capture
    finally:
        for handle in handles:
            handle.remove()
