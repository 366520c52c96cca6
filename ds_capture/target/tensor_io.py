"""Checkpoint files and tensor bookkeeping every loader shares (transformers' families and NeMo's alike).

In:  a checkpoint directory; a model about to be materialised. Out: :func:`_checkpoint_index` (key -> file),
:class:`LoadStats` (what a rank read), :func:`record_tensor_layout` / :func:`restore_tensor_layout` (dtypes that
survive a whole-model cast), :func:`_few` (a short list of names for an error message).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ds_capture.errors import CaptureError


@dataclass
class LoadStats:
    """What :func:`load_owned_parameters` read from disk on this rank."""

    bytes_read: int = 0
    num_files: int = 0
    bytes_by_param: dict[str, int] = field(default_factory=dict)


@dataclass
class TensorLayout:
    """Dtypes of every parameter / buffer, to survive casts (``init_inference`` casts the whole module)."""

    dtypes: dict[str, torch.dtype]


def record_tensor_layout(model: nn.Module) -> TensorLayout:
    # Every name, shared ones included: a tied lm_head is listed under its own name once to_empty untied it.
    tensors = {**dict(model.named_parameters(remove_duplicate=False)),
               **dict(model.named_buffers(remove_duplicate=False))}
    return TensorLayout(dtypes={name: t.dtype for name, t in tensors.items()})


@torch.no_grad()
def restore_tensor_layout(model: nn.Module, layout: TensorLayout) -> None:
    """Undo what a whole-model cast did (``init_inference`` calls ``module.bfloat16()``).

    Parameters and buffers keep their (uninitialised or meta) storage in the recorded dtype; they are filled later.
    """
    for name, param in model.named_parameters():
        if param.dtype != layout.dtypes[name]:
            module_name, _, leaf = name.rpartition(".")
            fresh = torch.empty(param.shape, dtype=layout.dtypes[name], device=param.device)
            setattr(model.get_submodule(module_name), leaf, nn.Parameter(fresh, requires_grad=False))
    for name, buffer in model.named_buffers():
        if buffer.dtype != layout.dtypes[name]:  # e.g. DeepSeek's fp32 e_score_correction_bias, rotary inv_freq
            module_name, _, leaf = name.rpartition(".")
            model.get_submodule(module_name)._buffers[leaf] = torch.empty(buffer.shape, dtype=layout.dtypes[name],
                                                                         device=buffer.device)


def _checkpoint_index(path: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it."""
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        return {key: path / name for key, name in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise CaptureError(
            f"recipe_args.target_model_name_or_path: {path} has no model.safetensors(.index.json). "
            "Save the target with save_pretrained(safe_serialization=True)."
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as handle:
        return {key: single for key in handle.keys()}


def _few(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "") or "none"
