"""Chunked prefill: one micro-batch forwarded in chunks of C tokens, in order, each layer carrying its state.

In: ``capture.chunked_prefill`` (``auto`` | ``off`` | tokens), the target's :class:`Family`, the recipe's
``seq_length`` and, for ``auto``, the chunk ``ds-capture plan`` chose. Out: :func:`resolve_chunk_tokens`, the chunk
a run forwards with (``None``: whole rows), refused before anything loads where the family cannot take it; and
:func:`forward_in_chunks`, the forward of one micro-batch chunk by chunk.

What each chunk needs from the ones before is the state of every layer kind, and Hugging Face's cache layers are
exactly those carriers, chosen per layer from the model's own config (``layer_types``): the prefix's keys and
values for full attention; the window's tail for sliding-window layers (Gemma 4, gpt-oss with its sinks) and
Llama 4's chunked local attention; the index keys of DSA indexers (GLM-5, DeepSeek-V3.2), whose top-k per query
is then taken over its whole causal prefix; DeepSeek-V4's compressor buffers; the recurrent and convolution
state of Gated DeltaNet and KDA layers (Qwen3-Next, Qwen3.5-MoE, Kimi-Linear, GLM-5-Next). The family declares
as data what it needs beyond that (:attr:`Family.chunk_multiple`: linear attention's 64-token blocks, DeepSeek-V4.1's
compression groups; its indexers scoring a chunk's queries in blocks, :attr:`Family.chunk_query_blocks`) and which
families carry nothing (:attr:`Family.chunk_refusal`; none today). NeMo's classes take no cache: a NeMo-built family
declares one carrier per layer kind (:attr:`Family.chunk_carriers`), which :func:`carried_state` puts in front of
NeMo's modules for one row's chunks (Kimi K3: :mod:`ds_capture.target.nemo_kda_mla_chunks`; DeepSeek-V4.1:
:mod:`ds_capture.target.nemo_v41_chunks`).

On the CPU a chunk's causal attention against its prefix runs in two unmasked kernels
(:mod:`ds_capture.target.chunk_attention`), as fast as a whole row's. Every captured tensor equals the whole row's
up to float summation order (fp32: within 1e-5 of the row maximum on
every family's tiny target, ``tests/unit/test_chunked_prefill.py``); activations are those of one chunk against
its prefix, so memory grows with the row only through the carried state and the captured output.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Mapping

import torch

from ds_capture.errors import CaptureError
from ds_capture.target.chunk_attention import split_chunk_attention
from ds_capture.target.families import Family


def resolve_chunk_tokens(setting: int | str, family: Family, seq_length: int, *, source: str,
                         planned: int | None = None) -> int | None:
    """The chunk a run forwards rows with, or ``None`` for whole rows; a chunk the family cannot take is refused.

    ``planned``: ``auto``'s chunk, ``ds-capture plan``'s choice (``None``: whole rows fit, or no budget is known).
    A chunk as long as the row is the whole row (one forward, as ``off``)."""
    if setting == "off":
        return None
    chunk = planned if setting == "auto" else int(setting)
    if chunk is None or chunk >= seq_length:
        return None
    where = f"{source}: `capture.chunked_prefill` {setting!r}" + (f" (plan's chunk {chunk})" if setting == "auto" else "")
    if family.chunk_refusal:
        raise CaptureError(f"{where}: {family.chunk_refusal}")
    multiple = family.chunk_multiple
    if chunk % multiple:
        lower, upper = chunk // multiple * multiple, (chunk // multiple + 1) * multiple
        nearest = f"{lower} or {upper}" if lower else f"{upper}"
        raise CaptureError(
            f"{where}: model_type {family.model_type!r} takes chunks that are a multiple of {multiple} tokens "
            f"({family.chunk_multiple_reason.format(multiple=multiple)}). Use {nearest}, or off."
        )
    return chunk


def forward_in_chunks(model: torch.nn.Module, inputs: dict[str, torch.Tensor], chunk_tokens: int,
                      forward_kwargs: dict[str, Any], *, carriers: Mapping[str, str] | None = None,
                      query_blocks: Mapping[str, str] | None = None) -> Any:
    """The last chunk's output of ``model`` over ``inputs`` forwarded ``chunk_tokens`` at a time, in order.

    Forward hooks fire once per chunk, in order (the capture concatenates what they saw). The cache the model
    builds on the first chunk carries each layer's state to the next and is dropped with the row: the output
    keeps none of it. ``attention_mask`` (a client's, serve) covers the prefix and the chunk, as a cache expects.
    Collective for sharded engines: every rank forwards the same chunks (rows are padded to one length).
    ``carriers``: the family's :attr:`Family.chunk_carriers` (a NeMo-built target): they carry the state instead.
    ``query_blocks``: the family's :attr:`Family.chunk_query_blocks`, run in front of their modules for the row's
    chunks (a sparse-attention indexer scoring blocks of a chunk's queries)."""
    if carriers:
        return _forward_with_carriers(model, inputs, chunk_tokens, forward_kwargs, carriers)
    input_ids = inputs["input_ids"]
    kwargs = {**forward_kwargs, "use_cache": True}
    cache, output = None, None
    with (carried_state(model, query_blocks, input_ids.shape[1]) if query_blocks else nullcontext(),
          split_chunk_attention()):
        for start in range(0, input_ids.shape[1], chunk_tokens):
            end = start + chunk_tokens
            chunk = {"input_ids": input_ids[:, start:end]}
            if "attention_mask" in inputs:
                chunk["attention_mask"] = inputs["attention_mask"][:, :end]
            output = model(**chunk, cache=cache, **kwargs)  # (transformers 5.24 renamed past_key_values to cache)
            cache = output.cache
    output.cache = None  # the carried state goes with the row
    return output


@contextmanager
def carried_state(model: torch.nn.Module, carriers: Mapping[str, str], row_tokens: int) -> Iterator[list[Any]]:
    """For one row's chunks: every module of ``model`` whose class ``carriers`` names forwards through a fresh
    carrier of its kind (``carrier_class(module, row_tokens).forward``; ``row_tokens``: the row's length, which
    DeepSeek-V4.1's indexer computes its top-k over), which holds that layer's state from chunk to chunk; yields
    the carriers. The modules' own forwards are back on exit, errors included, and the carried state goes
    with the carriers."""
    from ds_capture.target.nemo_config import resolve

    kinds = {name: resolve(path) for name, path in carriers.items()}
    installed, held = [], []
    try:
        for module in model.modules():
            kind = kinds.get(type(module).__name__)
            if kind is not None:
                held.append(kind(module, row_tokens))
                module.forward = held[-1].forward  # an instance attribute: nn.Module.__call__ runs it, hooks too
                installed.append(module)
        assert installed, (f"no module of {sorted(kinds)} in {type(model).__name__}: the family's chunk_carriers / "
                           f"chunk_query_blocks are stale")
        yield held
    finally:
        for module in installed:
            del module.forward


def _forward_with_carriers(model: torch.nn.Module, inputs: dict[str, torch.Tensor], chunk_tokens: int,
                           forward_kwargs: dict[str, Any], carriers: Mapping[str, str]) -> Any:
    """The chunks of a NeMo-built target, its layer kinds' state carried by ``carriers``; the last chunk's output.

    The chunks are forwarded without a mask: a right-padded row's content never sees its padding (causal), as in
    :meth:`ds_capture.capture.micro_batches.PlannedBatch.model_inputs`; a client's mask (serve) with padding before
    content is refused, as the carriers keep no per-row holes."""
    input_ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise CaptureError(
            "capture.chunked_prefill: a row of this request has padding before its content (attention_mask 0 then "
            "1), which the chunked prefill of a NeMo-built target cannot carry. Send right-padded rows (content "
            "first), or set capture.chunked_prefill: off.")
    output = None
    with carried_state(model, carriers, input_ids.shape[1]):
        for start in range(0, input_ids.shape[1], chunk_tokens):
            output = model(input_ids=input_ids[:, start:start + chunk_tokens], **forward_kwargs)
    return output
