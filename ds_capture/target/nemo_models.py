"""Targets built by NeMo AutoModel 0.7.0's own model classes (DeepSeek-V4.1, Kimi K3): the ``nemo`` extra.

In:  a :class:`~ds_capture.target.families.TargetInfo` whose family's ``implementation`` is ``"nemo"`` (its
     ``nemo_class`` / ``nemo_config_class``, ``release_placement`` and ``buffer_modules``), the compute dtype.
Out: :func:`read_nemo_config` -> NeMo's config object for the checkpoint; :func:`build_nemo_meta_model` -> the
     model on ``meta`` with the CPU-capable backend; :func:`load_nemo_parameters` -> the same model materialised
     on the rank's device and filled (:func:`fill_from_release`, also the FSDP2 engine's) from the *release*
     checkpoint one logical tensor at a time (quantized ones dequantized by :mod:`.quant`), reading only the
     routed experts this rank owns.

NeMo's state-dict adapters convert a whole release state dict; what they do is per tensor (a key rename, one
weight / scale pair dequantized, one expert's ``w1 / w3 / w2`` written as a slice of the stacked expert tensor).
The family's ``release_placement(key, config)`` says, for one release key, which native tensor (and which
expert, slice, transpose or narrow) it becomes, so the loader never holds more than one tensor beyond the model
(tests/unit/test_nemo_*_release.py hold it to the adapters' ``from_hf`` bit for bit).

The backend is the torch one (``BackendConfig(attn="sdpa", linear="torch", experts="torch", dispatcher="torch")``):
the constructor's default needs GPU kernels, and the expert-parallel split of :mod:`ds_capture.parallel.
grouped_experts` is exact for the ``torch`` experts loop. NeMo wraps its expert activations in
``torch.compile(fullgraph=True)`` (seconds of gcc per shape on CPU); they run as the plain functions here.
"""

from __future__ import annotations

import copy
import importlib
import json
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Collection, Iterator

import torch
from torch import nn

from ds_capture.errors import CaptureError
from ds_capture.target.inputs import tokenizer_files
from ds_capture.target.nemo_config import read_nemo_config, resolve

def cpu_backend() -> Any:
    """The torch backend every NeMo target is built with (CPU and GPU alike: one numerics, exact EP)."""
    from nemo_automodel.components.models.common import BackendConfig

    return BackendConfig(attn="sdpa", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch",
                         rope="torch", rope_fusion=False, gate_precision="float32")


def eager_expert_activations() -> None:
    """Replace NeMo's ``torch.compile``d expert activations by the functions they wrap (same math, no compile).

    They are looked up in ``nemo_automodel.components.moe.experts``'s globals when an experts module is built,
    so this runs before every build."""
    experts = importlib.import_module("nemo_automodel.components.moe.experts")
    for name, value in list(vars(experts).items()):
        if not isinstance(value, types.FunctionType):  # NeMo's placeholders for absent kernels raise on any getattr
            continue
        original = getattr(value, "_torchdynamo_orig_callable", None)
        if original is not None and getattr(original, "__module__", "") == experts.__name__:
            setattr(experts, name, original)


@contextmanager
def _without_process_group() -> Iterator[None]:
    """NeMo's constructors shard some tables over WORLD once a process group exists (DeepSeek-V4.1's Engram:
    its forward then fails until a DTensor owner is set up). ds_capture places every tensor itself, so the
    model is built as in one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    saved = dist.is_initialized
    dist.is_initialized = lambda: False
    try:
        yield
    finally:
        dist.is_initialized = saved


def build_nemo_meta_model(target: Any, *, dtype: torch.dtype) -> nn.Module:
    """NeMo's model class for ``target`` on ``meta`` in ``dtype`` (its fp32 islands kept, as NeMo casts).

    Every call returns a model of its own (callers shard it in place). A family that builds Engram's tokenizer map
    (it declares a ``planning_tokenizer``: V4.1, about 1 s per build at the release's vocabulary) is built once per
    config, tokenizer, depth and dtype in a process and handed out as copies (0.1 s), for ``plan``, which sizes
    many layouts of one target; the other classes build faster than they copy."""
    if not target.family.planning_tokenizer:
        return _build_nemo_meta_model(target, dtype=dtype)
    path = Path(target.path)
    stats = {name: (path / name).stat() for name in ("config.json", *tokenizer_files(path))
             if (path / name).is_file()}
    key = (str(path.resolve()), tuple((name, st.st_mtime_ns, st.st_size) for name, st in stats.items()),
           target.num_hidden_layers, target.checkpoint_num_hidden_layers, dtype)
    if key not in _BUILT_ONCE:
        _BUILT_ONCE.clear()  # one target at a time
        _BUILT_ONCE[key] = _build_nemo_meta_model(target, dtype=dtype)
    return copy.deepcopy(_BUILT_ONCE[key])


_BUILT_ONCE: dict[tuple, nn.Module] = {}  # build_nemo_meta_model's last Engram model, as built


def _build_nemo_meta_model(target: Any, *, dtype: torch.dtype) -> nn.Module:
    from nemo_automodel.components.models.common.utils import cast_model_to_dtype

    family = target.family
    if family.needs_fla:
        from ds_capture.target.nemo_fla import install_cpu_fla

        install_cpu_fla()
    eager_expert_activations()
    config = read_nemo_config(family, target.path)
    text = getattr(config, "text_config", config)
    if target.checkpoint_num_hidden_layers is not None:
        text.num_hidden_layers = target.num_hidden_layers
    dtype_name = str(dtype).removeprefix("torch.")
    for field in ("dtype", "torch_dtype"):  # V4.1 reads `dtype`, K3 `torch_dtype`
        if hasattr(text, field):
            setattr(text, field, dtype_name)
    model_class = resolve(family.nemo_class)
    kwargs = {}
    if family.planning_tokenizer and not tokenizer_files(target.path):
        kwargs["tokenizer"] = resolve(family.planning_tokenizer)(config)
    with _without_process_group(), torch.device("meta"):
        model = model_class(config, backend=cpu_backend(), **kwargs)
    cast_model_to_dtype(model, dtype)
    return model.eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------------ loading


def is_grouped_experts(module: nn.Module) -> bool:
    """NeMo's ``GroupedExperts`` (or a subclass), recognised by class name so NeMo need not be imported."""
    return any(cls.__name__ == "GroupedExperts" for cls in type(module).__mro__)


def trim_padding_rows(destinations: dict[str, torch.Tensor], rows: dict[str, tuple[int, int]]) -> None:
    """A row-parallel table's last owners hold padding rows past the table: zeroed, and left out of the
    destination (``rows[name] = (first row, rows read)``)."""
    for name, (_, count) in rows.items():
        if name in destinations and isinstance(destinations[name], torch.Tensor) and destinations[name].shape[0] > count:
            destinations[name][count:].zero_()
            destinations[name] = destinations[name][:count]


@torch.no_grad()
def load_nemo_parameters(model: nn.Module, target: Any, device: torch.device, spec: Any) -> Any:
    """Materialise ``model`` on ``device`` and fill this rank's part (``spec``: the layout's
    :class:`~ds_capture.target.shard_spec.ShardSpec`) from the release checkpoint (see the module docstring), then
    recompute its non-persistent buffers."""
    from ds_capture.target.tensor_io import record_tensor_layout, restore_tensor_layout

    layout = record_tensor_layout(model)
    model.to_empty(device=device)
    restore_tensor_layout(model, layout)
    state = model.state_dict(keep_vars=True)
    rows = spec.rows()
    trim_padding_rows(state, rows)
    stats = fill_from_release(target, model.config, state, rows, dtype=model_dtype(model), packed=spec.packed)
    init_nonpersistent_buffers(model, target.family)
    return stats


@torch.no_grad()
def fill_from_release(target: Any, config: Any, destinations: dict[str, torch.Tensor],
                      rows: dict[str, tuple[int, int]], *, dtype: torch.dtype,
                      names: Collection[str] | None = None, packed: Collection[str] = ()) -> Any:
    """Copy every release tensor this rank needs into ``destinations`` (native name -> local tensor) of the model
    built from NeMo's ``config`` (the model's own ``config``: a reduced depth already applied).

    ``rows[name] = (start, count)``: the local tensor holds rows ``[start, start + count)`` of dim 0 of the
    native tensor (an expert-parallel rank's experts, an FSDP2 rank's chunk, a row-parallel table's rows: only
    those rows are read where the release tensor is the native one, untransposed); ``dtype`` the model dtype (quantized
    tensors are rounded to it first, as NeMo's adapters store them); a release tensor whose expert or
    rows fall outside is never read. Every local tensor must be covered exactly; the keys the family does not
    read (vision tower, multi-token prediction, layers past the model's depth) are never opened.

    ``names``: every native name of the model, when ``destinations`` holds only some of them (a loader filling one
    block at a time): release tensors of the others are skipped here, not reported as unexpected. ``packed``: the
    destinations that keep their release pieces as stored (the shard spec's packed expert stacks)."""
    from ds_capture.target import quant
    from ds_capture.target.tensor_io import LoadStats, _checkpoint_index, _few

    family = target.family
    raw = json.loads((target.path / "config.json").read_text())
    names = set(destinations if names is None else names)
    place_key: Callable = resolve(family.release_placement)(config, raw, names)
    files = _checkpoint_index(target.path)
    headers = quant.read_headers(files.values())
    index, _parts = quant.logical_keys(files, headers)
    reads, unexpected = _release_reads(index, place_key, destinations, names, rows)
    quantized = quant.plan_quantized(files, headers, quant.load_quant_config(target.path), {k for k, _ in reads})
    written: dict[str, int] = {}
    stats = LoadStats()
    for key, placement in reads:
        destination = destinations[placement.native]
        if placement.native in packed:  # experts kept as released
            if key not in quantized:
                raise CaptureError(f"{index[key]}: {key} is not quantized; capture.expert_storage: checkpoint keeps "
                                   "only quantized routed experts packed. Use capture.expert_storage: dequantized.")
            num_bytes, numel = destination.put(placement, quantized[key], dtype)
        else:
            num_bytes, numel = _copy_release_tensor(target, key, placement, index, quantized, destination,
                                                    rows.get(placement.native, (0, None)), dtype)
        stats.bytes_read += num_bytes
        stats.bytes_by_param[placement.native] = stats.bytes_by_param.get(placement.native, 0) + num_bytes
        written[placement.native] = written.get(placement.native, 0) + numel
    stats.num_files = len({index[key] for key, _ in reads})
    missing = sorted(name for name, tensor in destinations.items() if written.get(name, 0) != tensor.numel())
    if missing or unexpected:
        raise CaptureError(
            f"{target.path}: the checkpoint does not match the {target.model_type} model built from its "
            f"config.json (missing or incomplete: {_few(missing)}; unexpected: {_few(unexpected)}). Point "
            "recipe_args.target_model_name_or_path at the complete release."
        )
    return stats


def _release_reads(index: dict[str, Any], place_key: Callable, destinations: dict[str, torch.Tensor],
                   names: set[str], rows: dict[str, tuple[int, int]]) -> tuple[list[tuple[str, Any]], list[str]]:
    """``(release key, placement)`` of every release tensor this rank reads, in key order, and the release tensors
    the model has no place for (``release key -> native name``)."""
    reads, unexpected = [], []
    for key in sorted(index):
        placement = place_key(key)
        if placement is None:
            continue
        if placement.native not in destinations:
            if placement.native not in names:
                unexpected.append(f"{key} -> {placement.native}")
            continue
        start, count = rows.get(placement.native, (0, None))
        if placement.expert is not None and count is not None and not start <= placement.expert < start + count:
            continue  # another rank's expert: never read
        if count == 0:
            continue  # an FSDP2 rank past the last chunk of a small dim
        reads.append((key, placement))
    return reads, unexpected


def _copy_release_tensor(target: Any, key: str, placement: Any, index: dict[str, Any], quantized: dict[str, Any],
                         destination: torch.Tensor, rows: tuple[int, int | None], dtype: torch.dtype) -> tuple[int, int]:
    """Read one release tensor (this rank's rows of it where it can), place it in ``destination``; (bytes read,
    elements written)."""
    from ds_capture.target.nemo_release import read_release_tensor, transform

    start, count = rows
    # The release tensor's rows are the native ones: read only this rank's (a 183 GiB Engram table's 1/world).
    sliced = (count is not None and placement.expert is None and not placement.index
              and not placement.transpose and placement.narrow is None)
    # Dequantized in fp32 and rounded to the model dtype, as NeMo's adapters store it (then cast on copy).
    tensor, num_bytes = read_release_tensor(key, index, quantized, dtype, rows=(start, count) if sliced else None)
    tensor = transform(placement, tensor)
    if placement.expert is not None:
        destination = destination[placement.expert - start]
    elif count is not None and not sliced:  # this rank's rows of a whole tensor
        tensor = tensor[start:start + count]
    destination = destination[placement.index] if placement.index else destination
    if tuple(tensor.shape) != tuple(destination.shape):
        raise CaptureError(
            f"{index[key]}: tensor {key} has shape {tuple(tensor.shape)} where the {target.model_type} model "
            f"built from config.json expects {tuple(destination.shape)} (in {placement.native}). The checkpoint "
            "and its config.json disagree: re-download the release or fix config.json."
        )
    destination.copy_(tensor)
    return num_bytes, tensor.numel()


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the NeMo model was built in (its embedding's; fp32 islands aside)."""
    return model.get_input_embeddings().weight.dtype


def _persistent_names(model: nn.Module) -> set[str]:
    return set(model.state_dict().keys())


def init_nonpersistent_buffers(model: nn.Module, family: Any) -> None:
    """Recompute the buffers no checkpoint holds (``to_empty`` left them uninitialised) with their modules' own
    ``init_weights`` (DeepSeek-V4.1's Engram hash tables); the family lists those modules."""
    persistent = _persistent_names(model)
    owners = {name.rpartition(".")[0] for name, _ in model.named_buffers() if name not in persistent}
    unknown = sorted(owners - set(family.buffer_modules))
    if unknown:
        raise AssertionError(f"family {family.model_type!r}: modules {unknown} hold non-persistent buffers that "
                             "no registry entry initialises (Family.buffer_modules)")
    for name in family.buffer_modules:
        module = _get_optional(model, name)
        if module is not None:
            module.init_weights()


def _get_optional(model: nn.Module, dotted: str) -> nn.Module | None:
    module: Any = model
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module

