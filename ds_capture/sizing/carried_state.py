"""The state a chunked prefill carries from one chunk to the next, counted on the meta device.

In: the target (its family and ``config.json``), the row length S and the compute dtype. Out: the bytes one row's
carried state holds on a rank once its last chunk ran (:func:`carried_state_bytes`), and how they were found.

Counted, not estimated, where the target's own forward runs on the meta device: it runs once over S tokens with its
cache on, and the cache's tensors are summed. Transformers' cache layers are the carriers
(:mod:`ds_capture.capture.chunked`), so this is exactly what they hold: the prefix's keys and values, a window's
tail, MLA's latent, DSA's index keys, DeepSeek-V4's compressor buffers, Gated DeltaNet / KDA recurrent and
convolution state. Measured against a real forward on every tiny family that runs on meta: equal to the byte, or a
few bytes over. The meta forward runs in bf16 (the meta kernel of grouped experts takes nothing else); what it keeps
in bf16 is scaled to the compute dtype, what transformers keeps in fp32 whatever the dtype is counted as it is. A family whose forward takes a data-dependent step (Gemma 4's ``.item()``, GLM-5-Next's ``nonzero``) gets an
upper bound from its config instead: keys and values of every layer at S.

A NeMo-built family (its classes take no cache, and do not run on meta) declares its carriers
(``Family.chunk_carriers``): their ``state_bytes`` are summed over the meta model's modules of each kind, and their
``expansion_bytes`` (what a carrier expands from its state for the last chunk: MLA's prefix keys and values) is the
largest transient of one layer (tests/unit/test_chunked_prefill_nemo.py holds the sum to a real chunked forward's
carriers, to the byte).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_capture.target.families import TargetInfo


@dataclass(frozen=True)
class CarriedState:
    bytes_per_row: int
    """One row's carried state at S on one rank: the whole model's, whatever the TP degree (MLA's latent and DSA's
    index keys are whole on every TP rank; a GQA layer's share would be 1/tp of it, so under TP this is a bound)."""
    how: str
    """``counted`` (a meta forward's cache), ``declared`` (a NeMo-built family's carriers' shapes on the meta model)
    or ``bound`` (keys and values of every layer, from the config)."""
    transient_bytes: int = 0
    """The largest one layer expands from its carried state for the row's last chunk (MLA's prefix keys and values
    from the latent: alive during that layer's attention only). 0 where the cache holds what attention reads."""


_COUNTED: dict[tuple, CarriedState] = {}


def carried_state_bytes(target: TargetInfo, seq_length: int, compute_bytes: int, *,
                        attn_implementation: str | None = None) -> CarriedState:
    """One row's carried state at ``seq_length`` on any rank (cached per target and length)."""
    key = (str(target.path), target.num_hidden_layers, seq_length, compute_bytes, attn_implementation)
    if key not in _COUNTED and target.family.chunk_carriers:
        _COUNTED[key] = _count_carriers(target, seq_length, compute_bytes)
    if key not in _COUNTED:
        try:
            total, how = _count_on_meta(target, seq_length, compute_bytes, attn_implementation), "counted"
        except Exception:  # noqa: BLE001 - any step that cannot run on meta: the config's bound instead
            total, how = _bound_from_config(target, seq_length, compute_bytes), "bound"
        _COUNTED[key] = CarriedState(bytes_per_row=total, how=how)
    return _COUNTED[key]


def _count_on_meta(target: TargetInfo, seq_length: int, compute_bytes: int, attn_implementation: str | None) -> int:
    from ds_capture.target.loading import build_meta_model

    model = build_meta_model(target, dtype=torch.bfloat16, attn_implementation=attn_implementation)
    with torch.no_grad():
        output = model(input_ids=torch.zeros(1, seq_length, dtype=torch.int64, device="meta"), use_cache=True,
                       logits_to_keep=1)
    tensors: dict[int, torch.Tensor] = {}
    _collect(output.cache, tensors, depth=0)
    if not tensors:
        raise RuntimeError("the forward returned no cache")
    # What the forward keeps in its compute dtype scales with it; what transformers keeps in fp32 whatever the dtype
    # (linear attention's recurrent state) does not.
    return sum(t.numel() * (compute_bytes if t.dtype == torch.bfloat16 else t.element_size()) for t in tensors.values())


def _count_carriers(target: TargetInfo, seq_length: int, compute_bytes: int) -> CarriedState:
    """The family's carriers' declared state (and largest expansion) for one row at S, summed over the meta model."""
    from ds_capture.target.loading import build_meta_model
    from ds_capture.target.nemo_config import resolve

    dtype = {2: torch.bfloat16, 4: torch.float32}[compute_bytes]
    kinds = {name: resolve(path) for name, path in target.family.chunk_carriers.items()}
    model = build_meta_model(target, dtype=dtype, attn_implementation=None)
    total, transient = 0, 0
    for module in model.modules():
        kind = kinds.get(type(module).__name__)
        if kind is not None:
            total += kind.state_bytes(module, 1, seq_length, dtype)
            if hasattr(kind, "expansion_bytes"):
                transient = max(transient, kind.expansion_bytes(module, 1, seq_length, dtype))
    return CarriedState(bytes_per_row=total, how="declared", transient_bytes=transient)


def _collect(value, into: dict[int, torch.Tensor], depth: int) -> None:
    # A cache is a tree of layer objects holding tensors (and lists / dicts of them); each tensor counted once.
    if depth > 6:
        return
    if isinstance(value, torch.Tensor):
        into[id(value)] = value
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, into, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, into, depth + 1)
    elif hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)):
        for item in vars(value).values():
            _collect(item, into, depth + 1)


def _bound_from_config(target: TargetInfo, seq_length: int, compute_bytes: int) -> int:
    heads = target.num_key_value_heads or target.num_attention_heads
    return 2 * target.num_hidden_layers * seq_length * heads * (target.hidden_size // target.num_attention_heads) \
        * compute_bytes
