"""``engine: fsdp2``: the frozen target sharded with torch's native ``fully_shard`` (FSDP2).

In:  a :class:`~ds_capture.target.families.TargetInfo`, the :class:`~ds_capture.parallel.layout.ParallelLayout` (FSDP2 is pure
     data parallel: ``tp_size`` 1, each rank forwards its own micro-batch), the cache dtype.
Out: the plain Hugging Face causal LM (module paths unchanged, so hooks and the family registry work),
     every decoder layer and then the root wrapped by ``fully_shard`` on a 1-D mesh over the whole world,
     frozen and in eval mode. Each rank holds, and read from disk, only its dim-0 chunk of every parameter.

Steps (the torchtitan recipe): build on meta (:func:`~ds_capture.target.loading.build_meta_model`),
:func:`apply_fsdp`, ``to_empty``, the config-computed buffers (rotary ``inv_freq``), then
:func:`load_fsdp_shards` fills each local shard from ``safe_open(...).get_slice`` with transformers' own
checkpoint-name mapping (per-expert ``experts.E.gate_proj.weight`` on disk -> fused ``experts.gate_up_proj``).

Expert-parallel layout (NeMo-built families, ``distributed.ep_size`` = the world): :func:`keep_experts_local` first
splits the routed experts E/world per rank (:mod:`.grouped_experts`, exact all-to-all routing) and the Engram
tables by rows (:mod:`.engram_parallel`); ``fully_shard`` leaves those out (``ignored_params``), so they never enter
an all-gather, and with ``capture.expert_storage: checkpoint`` the experts stay packed as released
(:mod:`.packed_grouped_experts`). Byte for byte one process's cache (tests/distributed/test_nemo_family_layouts.py).

Every forward all-gathers each layer's parameters: all ranks must call it the same number of times (the
runner's padding forwards guarantee that), under ``torch.no_grad()`` (gloo collectives fail under
``inference_mode``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from ds_capture.errors import CaptureError
from ds_capture.parallel.shard_spec import build_shard_spec, member_of
from ds_capture.target.families import TargetInfo
from ds_capture.target.family import get_submodule
from ds_capture.target.checkpoint_reads import OwnedSlice, fill_from_checkpoint
from ds_capture.target.key_map import checkpoint_sources
from ds_capture.target.loading import build_meta_model, compute_host_buffers
from ds_capture.target.shard_spec import ShardSpec, dim0_chunk
from ds_capture.target.tensor_io import LoadStats, record_tensor_layout, restore_tensor_layout


def build_fsdp2_model(target: TargetInfo, plan: Any, groups: Any, *, dtype: torch.dtype,
                      attn_implementation: str | None, expert_storage: str = "dequantized") -> nn.Module:
    """The frozen target for this rank, sharded by ``fully_shard`` over every rank of the job.

    Collective: every rank must call it (the mesh creation and, later, every forward communicate).
    ``plan.ep_size == world`` (NeMo-built families only): :func:`keep_experts_local` first, and ``fully_shard``
    leaves those parameters out; ``groups`` is otherwise unused (FSDP2 shards over the whole world).
    ``expert_storage == "checkpoint"`` (that layout only): the rank's experts stay packed as released
    (:mod:`.packed_grouped_experts`), rebuilt one expert at a time in the forward.
    """
    device = _device()
    model = build_meta_model(target, dtype=dtype, attn_implementation=attn_implementation)
    ignored: set[nn.Parameter] = set()
    if plan.ep_size > 1:
        model, ignored = keep_experts_local(model, target, world_size=plan.world_size, rank=plan.rank)
        if expert_storage == "checkpoint":
            from ds_capture.parallel.packed_grouped_experts import keep_grouped_experts_packed

            keep_grouped_experts_packed(model)
            kept = {id(q) for q in model.parameters()}  # the replaced stacks are no parameters any more
            ignored = {p for p in ignored if id(p) in kept}
    spec = build_shard_spec(model, member_of(plan), sharding="fsdp2", family=target.family)
    mesh = _mesh(plan.world_size, device)
    apply_fsdp(model, target, mesh, ignored_params=ignored)
    load_fsdp_shards(model, target, spec, device=device)
    return model


def keep_experts_local(model: nn.Module, target: TargetInfo, *, world_size: int, rank: int
                       ) -> tuple[nn.Module, set[nn.Parameter]]:
    """FSDP2's expert-parallel layout (``engine: fsdp2`` with ``distributed.ep_size`` = the world): the meta
    ``model``'s routed experts split E/world per rank (:mod:`.grouped_experts`, exact all-to-all routing) and the
    family's row-parallel tables split by rows (:mod:`.engram_parallel`), both over WORLD. Returns the model and
    those parameters, which ``fully_shard`` must leave out (``ignored_params``): they never enter an all-gather."""
    from ds_capture.parallel.engram_parallel import apply_engram_row_parallel, row_parallel_tables
    from ds_capture.parallel.expert_parallel import apply_expert_parallel, moe_experts_modules

    family = target.family
    world = torch_dist.group.WORLD
    model = apply_expert_parallel(model, family, ep_group=world, ep_size=world_size, ep_rank=rank)
    model = apply_engram_row_parallel(model, family, group=world, group_size=world_size, group_rank=rank)
    local = [m for _, m in moe_experts_modules(model, family)] + [t for _, t in row_parallel_tables(model, family)]
    return model, {p for module in local for p in module.parameters()}


def check_fsdp2_degrees(family: Any, engine: str, *, world_size: int, tp_size: int, ep_size: int) -> None:
    """``engine: fsdp2``'s degrees: no tensor parallelism; expert parallelism only for NeMo's ``GroupedExperts``
    families, over every rank (``ep_size == world``: the experts ignored by ``fully_shard``, the rest sharded)."""
    if engine != "fsdp2" or (tp_size == 1 and ep_size == 1):
        return
    if tp_size == 1 and family.is_nemo and ep_size == world_size:
        return
    raise CaptureError(
        f"engine: fsdp2 shards every parameter over all {world_size} ranks; it has no tensor parallelism, and expert "
        f"parallelism only for NeMo-built families over every rank (distributed.ep_size = the world size) (got "
        f"tp_size {tp_size}, ep_size {ep_size}). Set distributed.tp_size to 1 and distributed.ep_size to 1 (or to "
        f"{world_size} for a NeMo-built family), or use engine: deepspeed.")


def _device() -> torch.device:
    if torch_dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _mesh(world_size: int, device: torch.device) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("fsdp",))


def apply_fsdp(model: nn.Module, target: TargetInfo, mesh: Any, *,
               ignored_params: set[nn.Parameter] | None = None) -> None:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, lm_head).

    One all-gather per layer keeps at most one unsharded layer alive at a time
    (``reshard_after_forward``); the root group holds what is left over. ``ignored_params`` (expert-parallel
    experts, row-split tables) stay plain local tensors, in no group.
    """
    from torch.distributed.fsdp import fully_shard

    ignored = ignored_params or set()
    layers = get_submodule(model, target.family.layers)
    for layer in (layers.values() if isinstance(layers, nn.ModuleDict) else layers):  # NeMo's classes: a ModuleDict
        own = {p for p in layer.parameters() if p in ignored}
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, ignored_params=own or None)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, ignored_params=ignored or None)


def _local_rows(param: torch.Tensor) -> tuple[int, int, int]:
    """(first row, number of rows, full rows) of dim 0 this rank holds of an FSDP2 ``Shard(0)`` parameter.

    FSDP2 cuts dim 0 like ``torch.chunk``: ``ceil(rows / world)`` per rank, the last ranks short or empty.
    """
    from torch.distributed.tensor import DTensor

    assert isinstance(param, DTensor), f"expected an FSDP2 DTensor parameter, got {type(param).__name__}"
    rows = param.shape[0]
    mesh = param.device_mesh
    start, _ = dim0_chunk(rows, mesh.size(), mesh.get_local_rank())
    return start, param.to_local().shape[0], rows


@torch.no_grad()
def load_fsdp_shards(model: nn.Module, target: TargetInfo, spec: ShardSpec, *, device: torch.device) -> LoadStats:
    """Materialise the sharded ``model`` on ``device`` and fill every local shard from the checkpoint.

    Parameters are FSDP2 DTensors: this rank reads rows ``[start, start + n)`` of each checkpoint tensor
    (experts ``[start, start + n)`` for fused expert tensors, opening only those experts' per-expert
    tensors). Buffers are not sharded: persistent ones are read whole, non-persistent ones (rotary
    ``inv_freq``) are computed by the model's own ``_init_weights``. The reads are
    :func:`~ds_capture.target.checkpoint_reads.fill_from_checkpoint`'s, as for the DeepSpeed engine. Which rows a
    rank reads is the layout's ``spec`` (its chunks checked against the DTensors FSDP2 made).
    """

    layout = record_tensor_layout(model)
    model.to_empty(device=device)  # FSDP2 picks the new local tensors up at its lazy init (first forward)
    restore_tensor_layout(model, layout)
    if target.family.is_nemo:  # NeMo's class: the release layout, placed one tensor at a time into the local chunks
        return _load_nemo_shards(model, target, spec, device)
    compute_host_buffers(model)  # rotary inv_freq etc., on ``device``

    index, key_map, state = checkpoint_sources(model, target)
    # This rank's dim-0 chunk of every DTensor parameter (a fused expert tensor's rows are whole experts,
    # so only those experts' per-expert checkpoint tensors are opened); buffers and plain tensors whole.
    destinations, rows = _local_chunks({name: state[name] for name in key_map.sources})
    owned = spec_cuts(spec, state, rows)
    return fill_from_checkpoint(index, key_map, destinations, owned)


def spec_cuts(spec: ShardSpec, state: dict[str, torch.Tensor], rows: dict[str, tuple[int, int]]
              ) -> dict[str, OwnedSlice]:
    """The spec's cut of every tensor in ``state``, checked against the chunks FSDP2 really made (``rows``)."""
    owned = {}
    for name, tensor in state.items():
        cut = spec.cut(name, tensor.shape[0] if tensor.dim() else None)
        if cut is not None:
            owned[name] = cut
    made = {name: (cut.start, cut.length) for name, cut in owned.items()}
    if made != rows:
        raise AssertionError(f"the shard spec's chunks differ from FSDP2's: {sorted(set(made.items()) ^ set(rows.items()))[:4]}")
    return owned


def _local_chunks(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
    """Name -> this rank's local tensor (a DTensor's local chunk, anything else as is), and ``(first row, rows)``
    of dim 0 for each DTensor this rank holds only part of."""
    from torch.distributed.tensor import DTensor

    local: dict[str, torch.Tensor] = {}
    rows: dict[str, tuple[int, int]] = {}
    for name, tensor in tensors.items():
        if isinstance(tensor, DTensor):
            start, length, full = _local_rows(tensor)
            local[name] = tensor.to_local()
            if length < full:
                rows[name] = (start, length)
        else:
            local[name] = tensor
    return local, rows


def _load_nemo_shards(model: nn.Module, target: TargetInfo, spec: ShardSpec, device: torch.device) -> LoadStats:
    """:func:`~ds_capture.target.nemo_models.fill_from_release` into this rank's dim-0 chunk of every DTensor; the
    expert-parallel layout's experts and row-split tables read as the DeepSpeed engine reads them (``spec``)."""
    from ds_capture.target.nemo_models import (fill_from_release, init_nonpersistent_buffers, model_dtype,
                                               trim_padding_rows)

    state = model.state_dict(keep_vars=True)
    destinations, chunks = _local_chunks(state)
    rows = spec.rows({name: tensor.shape[0] for name, tensor in state.items() if tensor.dim()})
    if {name: rows[name] for name in chunks if name in rows} != chunks:
        raise AssertionError("the shard spec's chunks differ from FSDP2's")
    trim_padding_rows(destinations, rows)
    for name in spec.packed:  # capture.expert_storage: checkpoint (:mod:`.packed_grouped_experts`)
        destinations[name] = model.get_submodule(name)
        destinations[name].device = device
    stats = fill_from_release(target, model.config, destinations, rows, dtype=model_dtype(model),
                              packed=spec.packed)
    init_nonpersistent_buffers(model, target.family)
    return stats
