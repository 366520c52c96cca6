"""The world-of-one engine (and every DP-only rank): the whole target, frozen, on this rank's device.

In:  a :class:`~ds_capture.target.families.TargetInfo`, the compute dtype and attention implementation.
Out: :func:`build_single_model` -> the family's model class built on meta and filled by the sliced loader
     (:mod:`.loading`, every slice whole) straight onto the rank's device (CUDA when there is one): the
     checkpoint is read one tensor at a time, so the host never holds a second copy. It equals
     ``from_pretrained`` exactly (parameters, buffers, dtypes, logits: tests/unit/test_loading.py);
     :func:`load_with_from_pretrained` is that plain Hugging Face load, kept as the independent reference.
"""

from __future__ import annotations

import torch
from torch import nn

from ds_capture.target.families import TargetInfo


def build_single_model(target: TargetInfo, *, dtype: torch.dtype, attn_implementation: str | None,
                       expert_storage: str = "dequantized") -> nn.Module:
    """The whole target in ``dtype`` on this rank's device, eval, frozen; unused towers dropped.

    ``expert_storage="checkpoint"``: quantized routed experts stay in the checkpoint's format
    (:mod:`.resident_experts`)."""
    from ds_capture.parallel.shard_spec import build_shard_spec
    from ds_capture.target.loading import build_meta_model, load_owned_parameters
    from ds_capture.target.shard_spec import Member

    model = build_meta_model(target, dtype=dtype, attn_implementation=attn_implementation)
    if expert_storage == "checkpoint":
        from ds_capture.parallel.resident_experts import keep_experts_quantized

        keep_experts_quantized(model, target)
    load_owned_parameters(model, target, build_shard_spec(model, Member()))
    return model.eval().requires_grad_(False)


def load_with_from_pretrained(target: TargetInfo, *, dtype: torch.dtype,
                              attn_implementation: str | None) -> nn.Module:
    """``<family auto class>.from_pretrained(...)`` (peak host memory ~2x the checkpoint), eval, frozen."""
    import transformers

    from ds_capture.target.loading import default_device

    family = target.family
    attn_implementation = family.resolve_attn_implementation(attn_implementation)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if family.build_from_text_config:
        # Llama 4: the text model alone; from_pretrained strips its `language_model.` prefix (base_model_prefix).
        kwargs["config"] = family.text_config(transformers.AutoConfig.from_pretrained(target.path))
    model = getattr(transformers, family.auto_class).from_pretrained(target.path, dtype=dtype, **kwargs)
    family.drop_unused_modules(model)
    return model.to(default_device()).eval().requires_grad_(False)
