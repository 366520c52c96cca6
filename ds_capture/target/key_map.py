"""Which checkpoint tensors become which model tensors: transformers' conversion mapping, per model tensor.

In:  a model (on meta or materialised, plain or sharded) and its :class:`~ds_capture.target.families.TargetInfo`.
Out: :func:`checkpoint_sources` -> (checkpoint key -> file, the :class:`KeyMap`, the model's state dict): every
     model tensor's checkpoint keys (per-expert ``experts.E.gate_proj.weight`` -> fused ``experts.gate_up_proj``,
     the converter that builds it), quantized keys under their logical name (:mod:`.quant`), and the keys that are
     never read (multi-token-prediction layers). A missing or unexpected tensor is a CaptureError naming it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ds_capture.errors import CaptureError
from ds_capture.target import quant
from ds_capture.target.families import TargetInfo
from ds_capture.target.quant import QuantTensor
from ds_capture.target.tensor_io import _checkpoint_index, _few


@dataclass
class KeyMap:
    """How checkpoint keys become model tensors (transformers' own conversion mapping)."""

    sources: dict[str, list[str]]
    """Model tensor -> its checkpoint keys, in natural order (experts 0, 1, ..., 10)."""
    converter_of: dict[str, Any]
    """Model tensor -> the ``WeightConverter`` that builds it (absent: a 1:1 rename)."""
    pattern_of: dict[str, str]
    """Checkpoint key -> the converter source pattern it matched (gate_proj / up_proj lists)."""
    unexpected: list[str]
    ignored: list[str] = field(default_factory=list)
    """Checkpoint keys that are not part of the model and are never read (multi-token-prediction layers)."""
    quantized: dict[str, QuantTensor] = field(default_factory=dict)
    """Logical checkpoint key (``X.weight``) -> its quantized parts (:mod:`.quant`); read dequantized."""


def map_checkpoint_keys(model: nn.Module, keys: list[str], dropped: tuple[str, ...] = (),
                         layers: str | None = None, prefix: str = "", packed: Collection[str] = ()) -> KeyMap:
    """Group checkpoint keys by the model tensor they become; keys of ``dropped`` modules are left out, and so
    are keys outside ``prefix`` when one is given (the others are mapped with it stripped).

    A key the model has no place for is ``ignored`` (never read, no error) when it matches the model's own
    ``_keys_to_ignore_on_load_unexpected`` (transformers' regexes: DeepSeek-V4's ``mtp.*``) or sits in a
    decoder layer past the model's last one under ``layers`` (the multi-token-prediction layer that
    DeepSeek-V3 / Kimi-K2 store as ``model.layers.<num_hidden_layers>``, GLM as layer 92 / 78).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, apply_renamings, dot_natural_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    model_names = set(model.state_dict().keys()) | set(packed)
    sources: dict[str, list[str]] = defaultdict(list)
    converter_of: dict[str, Any] = {}
    pattern_of: dict[str, str] = {}
    unexpected, ignored = [], []
    ignore_patterns = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    num_layers = len(model.get_submodule(layers)) if layers else 0
    for key in sorted(keys, key=dot_natural_key):
        if not key.startswith(prefix):
            continue  # e.g. Llama 4's vision tower next to its `language_model.` text model
        renamed = apply_renamings(key[len(prefix):], renamings)
        matched = None
        for converter in converters:
            converted, pattern = converter.rename_source_key(renamed)
            if pattern is not None:
                renamed, matched = converted, converter
                pattern_of[key] = pattern
                break
        # Checkpoints saved from the base model (DeepSeek-V4's release: `layers.0...`, `norm.weight`) lack the
        # CausalLM's `model.` prefix; from_pretrained adds it (or strips it) the same way.
        prefixed = f"{model.base_model_prefix}.{renamed}"
        if renamed not in model_names and prefixed in model_names:
            renamed = prefixed
        if any(renamed.startswith(module + ".") for module in dropped):
            pattern_of.pop(key, None)
            continue
        if renamed not in model_names and _not_in_model(key, renamed, ignore_patterns, layers, num_layers):
            pattern_of.pop(key, None)
            ignored.append(key)
            continue
        if matched is not None:
            converter_of[renamed] = matched
        if renamed in model_names:
            sources[renamed].append(key)
        else:
            unexpected.append(key)
    return KeyMap(sources=dict(sources), converter_of=converter_of, pattern_of=pattern_of, unexpected=unexpected,
                  ignored=ignored)


def _not_in_model(key: str, renamed: str, patterns: list[re.Pattern], layers: str | None, num_layers: int) -> bool:
    """``key`` is a known extra tensor (an ignore regex, or a decoder layer index >= the model's depth)."""
    if any(p.search(key) or p.search(renamed) for p in patterns):
        return True
    if layers and renamed.startswith(layers + "."):
        index = renamed[len(layers) + 1 :].split(".", 1)[0]
        return index.isdigit() and int(index) >= num_layers
    return False


def checkpoint_sources(model: nn.Module, target: TargetInfo, packed: Collection[str] = ()
                       ) -> tuple[dict[str, Path], KeyMap, dict]:
    """Where every model tensor comes from: (checkpoint key -> file, the key map, the model's state dict).

    ``packed``: the modules that stand in for a tensor kept as stored (the shard spec's ``packed``), mapped too.

    Missing checkpoint tensors and checkpoint tensors the model has no place for are a ``CaptureError``
    naming them. A tied lm_head takes the embedding's key. Quantized weights are listed under their logical
    key (``X.weight``; their scales are parts, not tensors) in ``key_map.quantized`` (:mod:`.quant`).
    """
    files = _checkpoint_index(target.path)
    headers = quant.read_headers(files.values())
    index, _parts = quant.logical_keys(files, headers)
    family = target.family
    key_map = map_checkpoint_keys(model, list(index), family.drop_modules + target.skipped_layer_modules,
                                   family.layers, family.checkpoint_prefix, packed)
    used = {key for keys in key_map.sources.values() for key in keys}
    key_map.quantized = quant.plan_quantized(files, headers, quant.load_quant_config(target.path), used)
    sources = key_map.sources
    state = {**model.state_dict(keep_vars=True), **{name: model.get_submodule(name) for name in packed}}
    lm_head, embed = f"{family.lm_head}.weight", f"{family.embed_tokens}.weight"
    if target.tie_word_embeddings and lm_head in state and lm_head not in sources and embed in sources:
        sources[lm_head] = sources[embed]  # tied: the lm_head is the embedding
    missing = sorted(name for name in state if name not in sources)
    if missing or key_map.unexpected:
        raise CaptureError(
            f"{target.path}: the checkpoint does not match the {target.model_type} model built from its config.json "
            f"(missing: {_few(missing)}; unexpected: {_few(key_map.unexpected)}). Re-save the target with "
            "save_pretrained, or point recipe_args.target_model_name_or_path at a complete checkpoint."
        )
    return index, key_map, state
