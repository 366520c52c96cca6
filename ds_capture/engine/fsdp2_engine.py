"""``engine: fsdp2``: the frozen target sharded with torch's native ``fully_shard`` (FSDP2).

In:  a :class:`~ds_capture.families.TargetInfo`, the :class:`~ds_capture.plan.ParallelPlan` (FSDP2 is pure
     data parallel: ``tp_size`` 1, each rank forwards its own micro-batch), the cache dtype.
Out: the plain Hugging Face causal LM (module paths unchanged, so hooks and the family registry work),
     every decoder layer and then the root wrapped by ``fully_shard`` on a 1-D mesh over the whole world,
     frozen and in eval mode. Each rank holds, and read from disk, only its dim-0 chunk of every parameter.

Steps (the torchtitan recipe): build on meta (:func:`~ds_capture.engine.loading.build_meta_model`),
:func:`apply_fsdp`, ``to_empty``, the config-computed buffers (rotary ``inv_freq``), then
:func:`load_fsdp_shards` fills each local shard from ``safe_open(...).get_slice`` with transformers' own
checkpoint-name mapping (per-expert ``experts.E.gate_proj.weight`` on disk -> fused ``experts.gate_up_proj``).

Every forward all-gathers each layer's parameters: all ranks must call it the same number of times (the
runner's padding forwards guarantee that), under ``torch.no_grad()`` (gloo collectives fail under
``inference_mode``).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from ds_capture.engine.loading import (
    LoadStats,
    _convert,
    _copy_into,
    _Owned,
    _owned_expert_keys,
    _read,
    build_meta_model,
    checkpoint_sources,
    compute_host_buffers,
    record_tensor_layout,
    restore_tensor_layout,
)
from ds_capture.errors import CaptureError
from ds_capture.families import TargetInfo, get_submodule


def build_fsdp2_model(target: TargetInfo, plan: Any, groups: Any, *, dtype: torch.dtype,
                      attn_implementation: str | None) -> nn.Module:
    """The frozen target for this rank, sharded by ``fully_shard`` over every rank of the job.

    Collective: every rank must call it (the mesh creation and, later, every forward communicate).
    ``groups`` is unused: FSDP2 shards over the whole world, which the plan sees as ``dp_size == world``.
    """
    if plan.tp_size != 1 or plan.ep_size != 1:
        raise CaptureError(
            f"engine: fsdp2 shards every parameter over all {plan.world_size} ranks and feeds each rank its own "
            f"data; it has no tensor or expert parallelism (got tp_size {plan.tp_size}, ep_size {plan.ep_size}). "
            "Set distributed.tp_size and distributed.ep_size to 1, or use engine: deepspeed."
        )
    device = _device()
    model = build_meta_model(target, dtype=dtype, attn_implementation=attn_implementation)
    mesh = _mesh(plan.world_size, device)
    apply_fsdp(model, target, mesh)
    load_fsdp_shards(model, target, device=device)
    return model


def _device() -> torch.device:
    if torch_dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _mesh(world_size: int, device: torch.device) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("fsdp",))


def apply_fsdp(model: nn.Module, target: TargetInfo, mesh: Any) -> None:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, lm_head).

    One all-gather per layer keeps at most one unsharded layer alive at a time
    (``reshard_after_forward``); the root group holds what is left over.
    """
    from torch.distributed.fsdp import fully_shard

    for layer in get_submodule(model, target.family.layers):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)


def _local_rows(param: torch.Tensor) -> tuple[int, int, int]:
    """(first row, number of rows, full rows) of dim 0 this rank holds of an FSDP2 ``Shard(0)`` parameter.

    FSDP2 cuts dim 0 like ``torch.chunk``: ``ceil(rows / world)`` per rank, the last ranks short or empty.
    """
    from torch.distributed.tensor import DTensor

    assert isinstance(param, DTensor), f"expected an FSDP2 DTensor parameter, got {type(param).__name__}"
    rows = param.shape[0]
    mesh = param.device_mesh
    per_rank = -(-rows // mesh.size())
    start = min(mesh.get_local_rank() * per_rank, rows)
    return start, param.to_local().shape[0], rows


@torch.no_grad()
def load_fsdp_shards(model: nn.Module, target: TargetInfo, *, device: torch.device) -> LoadStats:
    """Materialise the sharded ``model`` on ``device`` and fill every local shard from the checkpoint.

    Parameters are FSDP2 DTensors: this rank reads rows ``[start, start + n)`` of each checkpoint tensor
    (experts ``[start, start + n)`` for fused expert tensors, opening only those experts' per-expert
    tensors). Buffers are not sharded: persistent ones are read whole, non-persistent ones (rotary
    ``inv_freq``) are computed by the model's own ``_init_weights``. Files are mapped one at a time; every read is cloned out of the map.
    """
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from transformers.core_model_loading import MergeModulelist

    layout = record_tensor_layout(model)
    model.to_empty(device=device)  # FSDP2 picks the new local tensors up at its lazy init (first forward)
    restore_tensor_layout(model, layout)
    compute_host_buffers(model)  # rotary inv_freq etc., on ``device``

    index, key_map, state = checkpoint_sources(model, target)
    sources, converter_of = key_map.sources, key_map.converter_of

    # Plan the reads per file: (checkpoint key, model tensor, this rank's dim-0 cut or None for whole).
    reads: dict[Path, list[tuple[str, str, _Owned | None]]] = defaultdict(list)
    pieces: dict[str, dict[str, torch.Tensor]] = {}
    num_pieces: dict[str, int] = {}
    destinations: dict[str, torch.Tensor] = {}
    for name, keys in sources.items():
        tensor = state[name]
        cut = None
        if isinstance(tensor, DTensor):
            start, length, rows = _local_rows(tensor)
            destinations[name] = tensor.to_local()
            if length == 0:
                continue  # a rank past the last chunk of a small dim holds nothing of it
            if length < rows:
                cut = _Owned(dim=0, start=start, length=length, experts=name in converter_of)
        else:
            destinations[name] = tensor
        if name in converter_of:
            converter = converter_of[name]
            if cut is not None and not isinstance(converter.operations[0], MergeModulelist):
                raise CaptureError(f"{name}: FSDP2 cannot load a dim-0 shard of a tensor built by {converter!r}.")
            # Fused experts stack per-expert tensors on dim 0: the rows this rank owns are whole experts.
            keys = _owned_expert_keys(keys, key_map.pattern_of, cut)
            pieces[name], num_pieces[name], cut = {}, len(keys), None
        for key in keys:
            reads[index[key]].append((key, name, cut))

    stats = LoadStats()
    for path in sorted(reads):
        with safe_open(path, framework="pt") as handle:  # one file mapped at a time
            for key, name, cut in reads[path]:
                tensor = _read(handle, key, cut)
                num_bytes = tensor.numel() * tensor.element_size()
                stats.bytes_read += num_bytes
                stats.bytes_by_param[name] = stats.bytes_by_param.get(name, 0) + num_bytes
                if name in pieces:
                    pieces[name][key] = tensor
                    if len(pieces[name]) < num_pieces[name]:
                        continue
                    tensor = _convert(converter_of[name], pieces.pop(name), key_map.pattern_of, name)
                _copy_into(destinations[name], tensor, name, key)
        stats.num_files += 1
    assert not pieces, f"incomplete converted tensors: {sorted(pieces)}"
    return stats
