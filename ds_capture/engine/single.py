"""The world-of-one engine: the target loaded whole by Hugging Face, frozen.

In:  a :class:`~ds_capture.families.TargetInfo`, the compute dtype and attention implementation.
Out: ``AutoModelForCausalLM.from_pretrained(...)`` (the family's auto class: a multimodal wrapper's own, its
     unused towers dropped) in eval mode with gradients off; this is also the reference every sharded
     layout must reproduce.
"""

from __future__ import annotations

import torch
from torch import nn

from ds_capture.families import TargetInfo


def build_single_model(target: TargetInfo, *, dtype: torch.dtype, attn_implementation: str | None) -> nn.Module:
    """The whole target in ``dtype`` (on this rank's CUDA device when there is one), eval, frozen."""
    import transformers

    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = getattr(transformers, target.family.auto_class).from_pretrained(target.path, dtype=dtype, **kwargs)
    target.family.drop_unused_modules(model)
    if torch.cuda.is_available():
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    return model.eval().requires_grad_(False)
