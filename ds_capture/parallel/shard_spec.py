"""The layout as a value: the :class:`~ds_capture.target.shard_spec.ShardSpec` of a model the engines shaped.

In:  a model on ``meta`` after the layout's module replacements (expert parallelism, row-parallel tables, AutoTP or
     the family's TP plan, experts kept stored), the family, the :class:`~ds_capture.target.shard_spec.Member` it
     was shaped for, and the sharding that partitions the rest (``deepspeed``: nothing; ``fsdp2``: dim-0 chunks;
     ``zero3``: flat partitions).
Out: :func:`build_shard_spec` -> the spec. The engines build it once and pass it to the loader; ``plan`` builds it on
     its meta model (rank 0's shapes, every rank's sizes) and counts every rank from it, so the two cannot drift.

This is the one place that reads the sharded modules: AutoTP's published partition metadata
(:func:`autotp_partitions`), the TP plan's linears, the expert-parallel experts (both kinds), the stored expert
stacks and the row-parallel tables. The target stage learns the layout from the spec alone.
"""

from __future__ import annotations

import sys
from typing import Any, Iterator

from torch import nn

from ds_capture.errors import CaptureError
from ds_capture.target.family import Family
from ds_capture.target.shard_spec import Member, Placement, ShardSpec

SHARDINGS = ("deepspeed", "fsdp2", "zero3")


def build_shard_spec(model: nn.Module, member: Member, *, sharding: str = "deepspeed",
                     family: Family | None = None) -> ShardSpec:
    """Every tensor's placement on ``model`` (see the module docstring); ``sharding`` partitions what the module
    replacements left whole (``fsdp2`` / ``zero3``: every parameter except the expert-parallel experts and tables;
    ``family`` tells FSDP2 which dim 0 counts experts)."""
    from ds_capture.parallel.engram_parallel import RowParallelTable
    from ds_capture.parallel.resident_experts import StoredExpertStack

    assert sharding in SHARDINGS, sharding
    places: dict[str, Placement] = {}
    packed: set[str] = set()
    local: list[str] = []  # module prefixes kept out of FSDP2's / ZeRO-3's partitioning
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, StoredExpertStack):
            packed.add(module_name)
        for name, place in _tp_placements(module, prefix):
            places[name] = place
        if getattr(module, "ep_size", 1) > 1 and hasattr(module, "expert_start"):  # both expert-parallel kinds
            local.append(prefix)
            for name, place in _expert_placements(module, prefix):
                places[name] = place
        if isinstance(module, RowParallelTable) and module.group_size > 1:
            local.append(prefix)
            places[prefix + "weight"] = Placement("split", sizes=(module.rows_per_rank,) * module.group_size,
                                                  group="world", total=module.num_embeddings)
    if sharding != "deepspeed":
        _partition_the_rest(model, family, sharding, tuple(local), places, packed)
    return ShardSpec(placements=places, packed=frozenset(packed), gathers=tuple(_gathers(places, sharding)),
                     member=member)


def member_of(layout: Any) -> Member:
    """This rank's :class:`Member` of a :class:`~ds_capture.parallel.layout.ParallelLayout`."""
    return Member(rank=layout.rank, world_size=layout.world_size, tp_rank=layout.tp_rank, ep_rank=layout.ep_rank)


def _tp_placements(module: nn.Module, prefix: str) -> Iterator[tuple[str, Placement]]:
    """A TP-split module's parameters: the family's own plan (``owned_slices``, even splits) or an AutoTP layer."""
    for leaf, cut in getattr(module, "owned_slices", {}).items():  # our own TP plan's linears
        yield prefix + leaf, Placement("split", dim=cut.dim, sizes=(cut.length,) * module.tp_size, group="tp")
    # An AutoTP layer exists only if DeepSpeed built it: a process that never imported DeepSpeed skips it.
    autotp = sys.modules.get("deepspeed.module_inject.layers")
    if autotp is not None and isinstance(module, autotp.TensorParallel_Layer):
        for name, dim, sizes in autotp_partitions(module, prefix, autotp):
            yield name, Placement("split", dim=dim, sizes=tuple(sizes), group="tp")


def _expert_placements(module: nn.Module, prefix: str) -> Iterator[tuple[str, Placement]]:
    """An expert-parallel experts module's stacked tensors (parameters, or stacks kept stored): E/ep experts each."""
    from ds_capture.parallel.resident_experts import StoredExpertStack

    place = Placement("split", sizes=(module.num_local_experts,) * module.ep_size, group="ep", experts=True)
    for leaf, param in module.named_parameters(recurse=False):
        if param.dim() and param.shape[0] == module.num_local_experts:
            yield prefix + leaf, place
    for leaf, child in module.named_children():
        if isinstance(child, StoredExpertStack):
            yield prefix + leaf, place


def _partition_the_rest(model: nn.Module, family: Family | None, sharding: str, local: tuple[str, ...], places: dict[str, Placement],
                        packed: set[str]) -> None:
    """FSDP2's dim-0 chunks / ZeRO-3's flat partitions of every parameter not kept local (buffers stay whole)."""
    from ds_capture.parallel.expert_parallel import moe_experts_modules

    experts = (tuple(f"{name}." for name, _ in moe_experts_modules(model, family))
               if family is not None and family.is_moe else ())
    for name, param in model.named_parameters(remove_duplicate=False):  # a tied tensor under each of its names
        if name.startswith(local) or name in places or name in packed:
            continue
        if sharding == "zero3":
            places[name] = Placement("flat", group="world")
        elif param.dim() > 0:
            places[name] = Placement("chunk", group="world", experts=name.startswith(experts))


def _gathers(places: dict[str, Placement], sharding: str) -> list[str]:
    groups = {(place.group, place.total is not None) for place in places.values() if place.kind == "split"}
    out = []
    if ("tp", False) in groups:
        out.append("tensor parallel: partial outputs all-reduced or all-gathered over the TP group")
    if ("ep", False) in groups:
        out.append("expert parallel: routed tokens all-to-all over the EP group")
    if ("world", True) in groups:
        out.append("row-parallel tables: ids and rows all-to-all over the world")
    if sharding == "fsdp2":
        out.append("FSDP2: each decoder layer's chunks all-gathered for its forward, then the root's")
    if sharding == "zero3":
        out.append("ZeRO-3: each module's partitions all-gathered for its own forward, released after")
    return out


def autotp_partitions(module: nn.Module, prefix: str, autotp: Any) -> Iterator[tuple[str, int, list[int]]]:
    """``(name, partition dim, partition sizes)`` of each split parameter of one AutoTP layer (``autotp``: the
    module ``deepspeed.module_inject.layers``); a split the loader cannot slice is refused."""
    # The layer knows its split (sizes frozen at build); re-publish it on the current parameters, since
    # to_empty() replaced the parameter objects that carried it.
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
        yield prefix + leaf, meta["partition_dim"], meta["partition_sizes"]
