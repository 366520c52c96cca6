"""Build a target on the meta device and fill it from safetensors slices, reading only what this rank owns.

In:  a :class:`~ds_capture.target.families.TargetInfo` (checkpoint dir: ``config.json`` + ``*.safetensors``), and a
     model that is plain Hugging Face or already sharded (AutoTP layers, expert-parallel experts).
Out: :func:`build_meta_model` -> the model on ``meta`` (parameters and buffers); :func:`load_owned_parameters`
     -> the same model materialised on the rank's device with every parameter and persistent buffer filled from the
     checkpoint and every non-persistent buffer (rotary ``inv_freq``, embedding scales) computed by the model's
     own ``_init_weights`` (:func:`compute_host_buffers`), plus :class:`LoadStats` (bytes read, per parameter).

What a rank owns is the layout's :class:`~ds_capture.target.shard_spec.ShardSpec`, an argument (the parallel stage
builds it; ``plan`` counts from the same spec): a TP-split tensor is read as this rank's rows / columns, an
expert-parallel stack as its experts (only those experts' checkpoint tensors are opened), a tensor kept packed as
stored.
On-disk names are mapped to in-memory parameters with transformers' own conversion mapping (the one
``from_pretrained`` uses: per-expert ``experts.E.gate_proj.weight`` -> fused ``experts.gate_up_proj``).
Quantized tensors (FP8 / FP4 / INT4 with their scales: :mod:`.quant`) are mapped under their logical key and
read as this rank's slice dequantized, or, for experts kept resident (:mod:`.resident_experts`), as stored.
Multi-token-prediction tensors are never read.
Which keys become which tensor is :mod:`.key_map`'s; the read loop every engine shares (the FSDP2 engine passes its
DTensor chunks) is :func:`~ds_capture.target.checkpoint_reads.fill_from_checkpoint`.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from ds_capture.target.checkpoint_reads import fill_from_checkpoint
from ds_capture.target.families import TargetInfo
from ds_capture.target.key_map import checkpoint_sources
from ds_capture.target.shard_spec import ShardSpec
from ds_capture.target.tensor_io import LoadStats, record_tensor_layout, restore_tensor_layout


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



def default_device() -> torch.device:
    """This rank's compute device: its CUDA device when there is one (``dist`` set it), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def load_owned_parameters(model: nn.Module, target: TargetInfo, spec: ShardSpec,
                          device: torch.device | None = None) -> LoadStats:
    """Materialise ``model`` on ``device`` (default: :func:`default_device`) and fill every parameter /
    persistent buffer from this rank's slices (read on the host one tensor at a time, copied to ``device``).

    ``spec``: what this rank holds of each tensor (the layout's :class:`~ds_capture.target.shard_spec.ShardSpec`;
    ``ShardSpec()``: the whole model).

    A model AutoTP already materialised stays where DeepSpeed put it (the accelerator's current device).

    Missing checkpoint tensors and checkpoint tensors the model has no place for are errors that name
    them. Non-persistent buffers are computed from the config (:func:`compute_host_buffers`).
    """
    if target.family.is_nemo:  # filled from the release layout, one tensor at a time (NeMo's adapters, per tensor)
        from ds_capture.target.nemo_models import load_nemo_parameters

        return load_nemo_parameters(model, target, device or default_device(), spec)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        layout, shared = record_tensor_layout(model), _shared_tensor_names(model)
        model.to_empty(device=device or default_device())  # only this rank's shards: the layout is applied
        restore_tensor_layout(model, layout)
        _retie(model, shared)  # to_empty gave each name of a tied tensor its own storage
    compute_host_buffers(model)

    index, key_map, state = checkpoint_sources(model, target, packed=spec.packed)
    owned = {name: cut for name in key_map.sources if (cut := spec.cut(name)) is not None}
    return fill_from_checkpoint(index, key_map, state, owned, packed=spec.packed)


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
