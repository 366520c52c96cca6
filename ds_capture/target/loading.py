"""Build a target on the meta device and fill it from safetensors slices, reading only what this rank owns.

In:  a :class:`~ds_capture.target.families.TargetInfo` (checkpoint dir: ``config.json`` + ``*.safetensors``), and a
     model that is plain Hugging Face or already sharded (AutoTP layers, expert-parallel experts).
Out: :func:`build_meta_model` -> the model on ``meta`` (parameters and buffers); :func:`load_owned_parameters`
     -> the same model materialised on the rank's device with every parameter and persistent buffer filled from the
     checkpoint and every non-persistent buffer (rotary ``inv_freq``, embedding scales) computed by the model's
     own ``_init_weights`` (:func:`compute_host_buffers`), plus :class:`LoadStats` (bytes read, per parameter).

What a rank owns is read off the model itself, so the loader needs no plan:
  * an AutoTP layer (``deepspeed.module_inject.layers.TensorParallel_Layer``) publishes its partition dim
    and sizes; this rank reads rows / columns ``[sum(sizes[:tp_index]), +sizes[tp_index])``;
  * an expert-parallel experts module (:mod:`.expert_parallel`) holds experts ``[expert_start, +num_local)``;
    only those experts' checkpoint tensors are opened.
On-disk names are mapped to in-memory parameters with transformers' own conversion mapping (the one
``from_pretrained`` uses: per-expert ``experts.E.gate_proj.weight`` -> fused ``experts.gate_up_proj``).
Quantized tensors (FP8 / FP4 / INT4 with their scales: :mod:`.quant`) are mapped under their logical key and
read as this rank's slice dequantized, or, for experts kept resident (:mod:`.resident_experts`), as stored.
Multi-token-prediction tensors are never read.
One tensor is mapped at a time and cloned out of the mapping (DESIGN §6); :func:`fill_from_checkpoint` is the
read loop every engine shares (the FSDP2 engine passes its DTensor chunks).
"""

from __future__ import annotations

import ctypes
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ds_capture.errors import CaptureError
from ds_capture.target import quant
from ds_capture.target.families import TargetInfo
from ds_capture.target.quant import QuantTensor
from ds_capture.target.tensor_io import (  # noqa: F401  (re-exported: the engines and tests import them from here)
    LoadStats,
    TensorLayout,
    _checkpoint_index,
    _few,
    record_tensor_layout,
    restore_tensor_layout,
)


@dataclass(frozen=True)
class OwnedSlice:
    """The part of one parameter this rank holds: ``length`` entries of ``dim`` from ``start`` (None: whole)."""

    dim: int | None = None
    start: int = 0
    length: int = 0
    experts: bool = False
    """``dim`` 0 is the expert dimension (a per-expert checkpoint list is cut instead of a tensor)."""


def build_meta_model(target: TargetInfo, *, dtype: torch.dtype, attn_implementation: str | None) -> nn.Module:
    """The target's model class (the family's auto class) on ``meta``: no weight memory, buffers on meta too.

    Built under ``torch.device("meta")``, as ``from_pretrained`` builds it; the model's own fp32 islands
    (DeepSeek's router) keep their dtype. Buffers computed from the config are filled after
    materialisation by :func:`compute_host_buffers`. (``deepspeed.OnDevice`` keeps them real, but it
    only redirects ``empty`` / ``zeros`` / ``ones`` / ``full``, so Gemma 4's rotary init, which
    concatenates an ``arange`` with ``zeros``, fails under it.)
    """
    import transformers

    family = target.family
    if family.is_nemo:  # NeMo AutoModel's own class (the nemo extra)
        from ds_capture.target.nemo_models import build_nemo_meta_model

        family.resolve_attn_implementation(attn_implementation)
        return build_nemo_meta_model(target, dtype=dtype)
    config = family.build_config(transformers.AutoConfig.from_pretrained(target.path))
    if target.checkpoint_num_hidden_layers is not None:
        _reduce_depth(family.text_config(config), target.num_hidden_layers)
    attn_implementation = family.resolve_attn_implementation(attn_implementation)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    model_class = family.model_class(config)
    with torch.device("meta"):
        model = model_class._from_config(config, dtype=dtype)
    family.drop_unused_modules(model)
    return model.eval().requires_grad_(False)


def _reduce_depth(text_config, num_layers: int) -> None:
    """``target_num_hidden_layers``: the config describes only the first ``num_layers`` decoder layers."""
    depth = text_config.num_hidden_layers
    text_config.num_hidden_layers = num_layers
    for name, value in vars(text_config).items():  # per-layer lists (layer_types, ...) keep their first entries
        if isinstance(value, list) and len(value) == depth and name.endswith("layer_types"):
            setattr(text_config, name, value[:num_layers])


@torch.no_grad()
def compute_host_buffers(model: nn.Module) -> None:
    """Fill every non-persistent buffer (rotary ``inv_freq``, embedding scales) the way ``from_pretrained`` does.

    These are computed from the config, not stored in the checkpoint: the model's own ``_init_weights`` runs on
    each module that owns one. That module's parameters are flagged ``_is_hf_initialized`` for the call, which
    transformers' init functions honour, so only the buffers change.
    """
    for module in model.modules():
        if not module._non_persistent_buffers_set:
            continue
        params = [p for p in module.parameters(recurse=False) if not getattr(p, "_is_hf_initialized", False)]
        for param in params:
            param._is_hf_initialized = True
        try:
            model._init_weights(module)
        finally:
            for param in params:
                del param._is_hf_initialized



def _owned_slices(model: nn.Module) -> dict[str, OwnedSlice]:
    """Parameter name -> the slice of the checkpoint tensor this rank holds (absent: the whole tensor)."""
    # An AutoTP layer exists only if DeepSpeed built it: a process that never imported DeepSpeed (one
    # process, DP-only ranks) skips its import here (~0.6 s).
    autotp = sys.modules.get("deepspeed.module_inject.layers")
    owned: dict[str, OwnedSlice] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if autotp is not None and isinstance(module, autotp.TensorParallel_Layer):
            # The layer knows its split (sizes frozen at build); re-publish it on the current parameters,
            # since to_empty() replaced the parameter objects that carried it.
            module._mark_uc_metadata()
            for leaf, param in module.named_parameters(recurse=False):
                meta = getattr(param, autotp.DS_AUTOTP_UC_META, None)
                if meta is None or meta["sub_param_shard_widths"]:
                    raise CaptureError(
                        f"AutoTP sharded {prefix}{leaf} with a layout the loader cannot slice "
                        f"({type(module).__name__}). Set distributed.tp_size to 1 for this target."
                    )
                if meta["replicated"] or meta["partition_dim"] is None:
                    continue
                sizes = meta["partition_sizes"]
                owned[prefix + leaf] = OwnedSlice(dim=meta["partition_dim"], start=sum(sizes[: module.tp_index]),
                                                  length=sizes[module.tp_index])
        if getattr(module, "resident_quantized", False) and module.owned is not None:
            owned[module_name] = module.owned  # experts kept quantized (resident_experts): the EP rank's experts
        for leaf, cut in getattr(module, "owned_slices", {}).items():  # our own TP plan's linears
            owned[prefix + leaf] = cut
        for leaf, cut in getattr(module, "expert_slices", {}).items():  # expert parallelism: the rank's experts
            owned[prefix + leaf] = cut
    return owned


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


def _map_checkpoint_keys(model: nn.Module, keys: list[str], dropped: tuple[str, ...] = (),
                         layers: str | None = None, prefix: str = "") -> KeyMap:
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
    model_names = set(model.state_dict().keys()) | set(_resident_stacks(model))
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


def _read_slice(handle: Any, key: str, owned: OwnedSlice | None) -> torch.Tensor:
    """This rank's slice of one checkpoint tensor, cloned out of the mapped file."""
    if owned is None:
        return handle.get_tensor(key).clone()
    view = handle.get_slice(key)
    index = [slice(None)] * len(view.get_shape())
    index[owned.dim] = slice(owned.start, owned.start + owned.length)
    return view[tuple(index)].clone()


def checkpoint_sources(model: nn.Module, target: TargetInfo) -> tuple[dict[str, Path], KeyMap, dict]:
    """Where every model tensor comes from: (checkpoint key -> file, the key map, the model's state dict).

    Missing checkpoint tensors and checkpoint tensors the model has no place for are a ``CaptureError``
    naming them. A tied lm_head takes the embedding's key. Quantized weights are listed under their logical
    key (``X.weight``; their scales are parts, not tensors) in ``key_map.quantized`` (:mod:`.quant`).
    """
    files = _checkpoint_index(target.path)
    headers = quant.read_headers(files.values())
    index, _parts = quant.logical_keys(files, headers)
    family = target.family
    key_map = _map_checkpoint_keys(model, list(index), family.drop_modules + target.skipped_layer_modules,
                                   family.layers, family.checkpoint_prefix)
    used = {key for keys in key_map.sources.values() for key in keys}
    key_map.quantized = quant.plan_quantized(files, headers, quant.load_quant_config(target.path), used)
    sources = key_map.sources
    state = {**model.state_dict(keep_vars=True), **_resident_stacks(model)}
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


def _resident_stacks(model: nn.Module) -> dict[str, nn.Module]:
    """Fused expert tensors held in the checkpoint's quantized format (:mod:`.resident_experts`), by name."""
    return {name: module for name, module in model.named_modules() if getattr(module, "resident_quantized", False)}


def default_device() -> torch.device:
    """This rank's compute device: its CUDA device when there is one (``dist`` set it), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def load_owned_parameters(model: nn.Module, target: TargetInfo, device: torch.device | None = None) -> LoadStats:
    """Materialise ``model`` on ``device`` (default: :func:`default_device`) and fill every parameter /
    persistent buffer from this rank's slices (read on the host one tensor at a time, copied to ``device``).

    A model AutoTP already materialised stays where DeepSpeed put it (the accelerator's current device).

    Missing checkpoint tensors and checkpoint tensors the model has no place for are errors that name
    them. Non-persistent buffers are computed from the config (:func:`compute_host_buffers`).
    """
    if target.family.is_nemo:  # filled from the release layout, one tensor at a time (NeMo's adapters, per tensor)
        from ds_capture.target.nemo_models import load_nemo_parameters

        return load_nemo_parameters(model, target, device or default_device())
    owned = _owned_slices(model)  # before any to_empty: it reads the AutoTP layers' partition metadata
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        layout, shared = record_tensor_layout(model), _shared_tensor_names(model)
        model.to_empty(device=device or default_device())  # only this rank's shards: the layout is applied
        restore_tensor_layout(model, layout)
        _retie(model, shared)  # to_empty gave each name of a tied tensor its own storage
    compute_host_buffers(model)

    index, key_map, state = checkpoint_sources(model, target)
    return fill_from_checkpoint(index, key_map, state, owned)


@torch.no_grad()
def fill_from_checkpoint(index: dict[str, Path], key_map: KeyMap, destinations: dict[str, torch.Tensor],
                         owned: dict[str, OwnedSlice]) -> LoadStats:
    """Copy this rank's part of every mapped checkpoint tensor into ``destinations`` (name -> local tensor).

    ``owned`` gives the slice of a tensor this rank holds (absent: all of it; ``length`` 0: nothing). Every
    read is one tensor mapped, sliced and copied; stacked experts are converted and placed one expert at a
    time; freed heap pages go back to the OS as the reads go (:func:`_release_freed_memory`).
    """
    from safetensors import safe_open
    from transformers.core_model_loading import MergeModulelist

    sources, converter_of = key_map.sources, key_map.converter_of

    # Plan the reads: per file, (checkpoint key, model tensor, slice). A converted tensor (fused experts)
    # gathers one piece per owned expert; the pieces may sit in several files.
    reads: dict[Path, list[tuple[str, str, OwnedSlice | None]]] = defaultdict(list)
    pieces: dict[str, dict[str, torch.Tensor]] = {}
    num_pieces: dict[str, int] = {}
    # Stacked experts are converted and placed one expert at a time (checkpoint key -> its slot in the
    # fused tensor), so a layer's experts are never held twice (pieces + stacked copy).
    slot_of: dict[str, int] = {}
    num_patterns: dict[str, int] = {}
    # A sliced tensor that a converter concatenates from several keys (KDA's q/k/v short convolutions into one
    # conv1d) is read whole, converted, then cut: its pieces do not line up with the slice.
    cut_after_convert: dict[str, OwnedSlice] = {}
    for name, keys in sources.items():
        cut = owned.get(name)
        if cut is not None and cut.length == 0:
            continue  # e.g. an FSDP2 rank past the last chunk of a small dim
        if getattr(destinations[name], "resident_quantized", False):  # raw parts, one owned expert at a time
            keys = _owned_expert_keys(keys, key_map.pattern_of, cut)
            slot_of.update(_expert_slots(keys, key_map.pattern_of))
            for key in keys:
                reads[index[key]].append((key, name, None))
            continue
        if name in converter_of:
            converter = converter_of[name]
            stacked = isinstance(converter.operations[0], MergeModulelist)
            if cut is not None and not (cut.experts and stacked):
                cut_after_convert[name], cut = cut, None
            keys = _owned_expert_keys(keys, key_map.pattern_of, cut)
            pieces[name], num_pieces[name], cut = {}, len(keys), None
            if stacked:
                slots = _expert_slots(keys, key_map.pattern_of)
                slot_of.update(slots)
                num_patterns[name] = len({key_map.pattern_of[key] for key in keys})
        for key in keys:
            reads[index[key]].append((key, name, cut))

    stats = LoadStats()
    placed: dict[str, int] = defaultdict(int)
    read_since_trim = 0
    for path in sorted(reads):
        for key, name, cut in reads[path]:
            if read_since_trim >= _TRIM_EVERY_BYTES:
                _release_freed_memory()
                read_since_trim = 0
            # One tensor mapped at a time: the pages a read touches count in RSS for as long as the file
            # stays mapped, so a file kept open would add up to its whole owned share to the peak.
            if getattr(destinations[name], "resident_quantized", False):
                num_bytes = destinations[name].put(slot_of[key], key_map.pattern_of[key], key_map.quantized[key],
                                                   converter_of[name])
                stats.bytes_read += num_bytes
                read_since_trim += num_bytes
                stats.bytes_by_param[name] = stats.bytes_by_param.get(name, 0) + num_bytes
                continue
            if key in key_map.quantized:  # the stored bytes and scale blocks covering the slice, dequantized
                qt = key_map.quantized[key]
                region = quant.region_of(qt, cut.dim, cut.start, cut.length) if cut else quant.region_of(qt, None, 0, 0)
                tensor, num_bytes = quant.read_dequantized(qt, region)
            else:
                with safe_open(path, framework="pt") as handle:
                    tensor = _read_slice(handle, key, cut)
                num_bytes = tensor.numel() * tensor.element_size()
            stats.bytes_read += num_bytes
            read_since_trim += num_bytes
            stats.bytes_by_param[name] = stats.bytes_by_param.get(name, 0) + num_bytes
            if key in slot_of:
                if _place_expert(destinations[name], pieces[name], key, tensor, slot_of[key], num_patterns[name],
                                 converter_of[name], key_map.pattern_of, name):
                    placed[name] += 1
                    if placed[name] * num_patterns[name] == num_pieces[name]:
                        del pieces[name]  # every owned expert of this tensor is in place
                continue
            if name in pieces:
                pieces[name][key] = tensor
                if len(pieces[name]) < num_pieces[name]:
                    continue
                tensor = _convert_pieces(converter_of[name], pieces.pop(name), key_map.pattern_of, name)
                if name in cut_after_convert:
                    after = cut_after_convert[name]
                    tensor = tensor.narrow(after.dim, after.start, after.length).clone()
            _copy_checked(destinations[name], tensor, name, key)
        stats.num_files += 1
    _release_freed_memory()
    assert not pieces, f"incomplete converted tensors: {sorted(pieces)}"
    return stats


def _shared_tensor_names(model: nn.Module) -> list[list[str]]:
    """Names that share one tensor (a tied lm_head and embedding, a rotary ``original_inv_freq``)."""
    groups: dict[int, list[str]] = defaultdict(list)
    for name, tensor in model.named_parameters(remove_duplicate=False):
        groups[id(tensor)].append(name)
    for name, tensor in model.named_buffers(remove_duplicate=False):
        groups[id(tensor)].append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model: nn.Module, shared: list[list[str]]) -> None:
    """Point every name of a group back at its first name's tensor, where shape, dtype and device agree."""
    for first, *others in shared:
        table, leaf = _owner_table(model, first)
        tensor = table[leaf]
        for name in others:
            table, leaf = _owner_table(model, name)
            current = table[leaf]
            if current.shape == tensor.shape and current.dtype == tensor.dtype and current.device == tensor.device:
                table[leaf] = tensor


def _owner_table(model: nn.Module, name: str) -> tuple[dict, str]:
    """The ``_parameters`` or ``_buffers`` dict of the module owning ``name``, and the leaf name in it."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    return (module._parameters if leaf in module._parameters else module._buffers), leaf


def _release_freed_memory() -> None:
    """Hand the heap pages freed by this file's reads back to the OS (glibc ``malloc_trim``; elsewhere a no-op).

    Every read is a short-lived copy (a slice, an expert's gate/up pieces and their fused stack). glibc serves
    them from its heap once they outgrow its mmap threshold and keeps the freed pages, fragmented between
    long-lived allocations: without this, ~0.06 of the checkpoint stayed resident on top of the parameters
    (benchmarks/load_memory.py). Called every ``_TRIM_EVERY_BYTES`` read and at the end.
    """
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None
_TRIM_EVERY_BYTES = 4 << 20


def _owned_expert_keys(keys: list[str], pattern_of: dict[str, str], cut: OwnedSlice | None) -> list[str]:
    """The checkpoint keys of this rank's experts: per source pattern (gate, up, ...), entries [start, +length)."""
    if cut is None:
        return keys
    by_pattern: dict[str, list[str]] = defaultdict(list)
    for key in keys:  # natural order: expert 0, 1, ..., E-1 within each pattern
        by_pattern[pattern_of[key]].append(key)
    return [key for group in by_pattern.values() for key in group[cut.start : cut.start + cut.length]]


def _expert_slots(keys: list[str], pattern_of: dict[str, str]) -> dict[str, int]:
    """Checkpoint key -> the index of its expert among this rank's (natural order within each pattern)."""
    seen: dict[str, int] = defaultdict(int)
    slots = {}
    for key in keys:
        slots[key] = seen[pattern_of[key]]
        seen[pattern_of[key]] += 1
    return slots


def _place_expert(destination: torch.Tensor, pieces: dict, key: str, tensor: torch.Tensor, slot: int,
                  num_patterns: int, converter: Any, pattern_of: dict[str, str], name: str) -> bool:
    """Collect one expert's pieces (gate, up, ...); once complete, convert and copy them into its slot.

    Returns True when the expert was placed."""
    group = pieces.setdefault(slot, {})
    group[key] = tensor
    if len(group) < num_patterns:
        return False
    fused = _convert_pieces(converter, pieces.pop(slot), pattern_of, name)  # [1, ...]: one expert, stacked
    _copy_checked(destination[slot : slot + 1], fused, name, key)
    return True


def _convert_pieces(converter: Any, pieces: dict[str, torch.Tensor], pattern_of: dict[str, str], name: str) -> torch.Tensor:
    """Run transformers' conversion ops (stack experts, concatenate gate/up) on this rank's pieces."""
    from transformers.core_model_loading import dot_natural_key

    collected: dict[str, list[torch.Tensor]] = defaultdict(list)
    for key in sorted(pieces, key=dot_natural_key):  # pieces arrive in file order, experts stack in index order
        collected[pattern_of[key]].append(pieces[key])
    result: dict[str, Any] = dict(collected)
    for op in converter.operations:
        result = op.convert(result, source_patterns=converter.source_patterns,
                            target_patterns=converter.target_patterns, full_layer_name=name)
    (tensor,) = result.values()
    return tensor


def _copy_checked(destination: torch.Tensor, tensor: torch.Tensor, name: str, key: str) -> None:
    if destination.shape != tensor.shape:
        raise CaptureError(
            f"{key}: checkpoint slice has shape {tuple(tensor.shape)} but {name} on this rank is "
            f"{tuple(destination.shape)}; the checkpoint does not match its config.json."
        )
    destination.copy_(tensor)  # casts to the model's dtype, as from_pretrained(dtype=...) does
