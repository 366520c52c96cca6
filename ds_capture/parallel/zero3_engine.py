"""``engine: deepspeed`` with ZeRO-3: NeMo-built targets partitioned by DeepSpeed's own ZeRO stage 3, frozen.

In:  a :class:`~ds_capture.target.families.TargetInfo` of a NeMo-built family, the
     :class:`~ds_capture.parallel.layout.ParallelLayout` (``tp_size`` 1, ``ep_size`` = the world), the compute dtype,
     ``capture.expert_storage``.
Out: the plain model (NeMo's class, module paths unchanged) with DeepSpeed's ZeRO-3 hooks on it, frozen and in eval
     mode: every rank holds ``ceil(numel / world)`` elements of every parameter except the routed experts (E/world
     per rank, expert-parallel as in :mod:`.grouped_experts`) and the Engram tables (split by rows); each module's
     parameters are all-gathered for its own forward and released right after.

Asked for with ``deepspeed_config: {zero_optimization: {stage: 3}}`` (:func:`zero_stage`); ds_capture sets ZeRO-3's
other knobs itself (:data:`ZERO3_CONFIG`: nothing kept whole, no prefetch, every gathered parameter released after
its module), so ``ds-capture plan`` can count what a rank holds.

Steps: the model on meta, its experts split expert-parallel and its Engram tables by rows
(:func:`~ds_capture.parallel.fsdp2_engine.keep_experts_local`), each of those parameters given a one-rank partition
group (``ds_zero_partition_process_group``, which DeepSpeed 0.19.8 reads at conversion: it partitions them over
that rank alone, i.e. keeps them whole and never gathers them from others). Then one block at a time (each decoder
layer, then the rest): materialise it (uninitialised), convert it with ``deepspeed.zero.Init(module=block)`` (the
parameters are partitioned and their full copies freed), and fill this rank's partitions straight from the
checkpoint (the rows covering its flat range, then that range). Finally ``deepspeed.initialize`` (no optimizer):
on a model whose parameters are already ZeRO parameters it does not broadcast rank 0's weights (which would
overwrite every rank's experts with rank 0's: the trap benchmarks/zero3_frozen_probe.py measured).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from ds_capture.errors import CaptureError
from ds_capture.target.families import TargetInfo
from ds_capture.target.family import get_submodule

ZERO3_CONFIG: Mapping[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,  # DeepSpeed requires it; no step is ever taken
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,  # no parameter kept whole because it is small
        "stage3_model_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 0,  # no prefetch: one module's parameters gathered at a time
        "stage3_max_live_parameters": 0,
        "stage3_max_reuse_distance": 0,  # released after every module's forward
    },
    "fp16": {"enabled": False},  # the model is built in the compute dtype; DeepSpeed casts nothing
    "bf16": {"enabled": False},
    "steps_per_print": 2**62,
}
"""The DeepSpeed config of the ZeRO-3 layout (``ds-capture plan`` counts a rank under exactly these settings)."""


def zero_stage(ds_config: Mapping[str, Any] | None, ds_source: str) -> int:
    """The ZeRO stage a recipe asks for: ``deepspeed_config.zero_optimization.stage`` (0 when absent).

    A frozen target has no optimizer states (stage 1) or gradients (stage 2) to partition; 3 partitions its
    parameters. The other ZeRO knobs are ds_capture's (:data:`ZERO3_CONFIG`), so plan's figure is what runs."""
    section = (ds_config or {}).get("zero_optimization")
    if section is None:
        return 0
    if not isinstance(section, Mapping):
        raise CaptureError(f"{ds_source}: zero_optimization must be a mapping such as {{stage: 3}}, got {section!r}.")
    stage = section.get("stage", 0)
    if stage not in (0, 3) or isinstance(stage, bool):
        raise CaptureError(
            f"{ds_source}: zero_optimization.stage {stage!r}: a frozen target has no optimizer states (stage 1) or "
            "gradients (stage 2) to partition. Use 3 to partition its parameters (engine: deepspeed, a NeMo-built "
            "family, distributed.ep_size = the world size), or 0 (or no zero_optimization) to keep them whole.")
    others = sorted(set(section) - {"stage"})
    if others:
        raise CaptureError(
            f"{ds_source}: zero_optimization.{others[0]}: ds_capture sets ZeRO-3's other settings itself (nothing "
            "kept whole, no prefetch, every gathered parameter released after its module) so that ds-capture plan "
            f"counts what each rank holds. Keep only zero_optimization.stage (remove {', '.join(others)}).")
    return stage


def check_zero3_degrees(family: Any, *, world_size: int, tp_size: int, ep_size: int) -> None:
    """ZeRO-3's layout: a NeMo-built family, no tensor parallelism, the routed experts over every rank."""
    if family.is_nemo and tp_size == 1 and ep_size == world_size:
        return
    if not family.is_nemo:
        raise CaptureError(
            f"deepspeed_config zero_optimization.stage 3 partitions NeMo-built families (deepseek_v41, kimi_k3); "
            f"model_type {family.model_type!r} is sharded by AutoTP and expert parallelism instead. Remove "
            "zero_optimization, or use engine: fsdp2 to shard every parameter.")
    raise CaptureError(
        f"deepspeed_config zero_optimization.stage 3 partitions every parameter over all {world_size} ranks and keeps "
        f"the routed experts expert-parallel over all of them: it needs distributed.tp_size 1 and "
        f"distributed.ep_size {world_size} (got tp_size {tp_size}, ep_size {ep_size}).")


def build_zero3_model(target: TargetInfo, plan: Any, *, dtype: torch.dtype, attn_implementation: str | None,
                      expert_storage: str = "dequantized") -> nn.Module:
    """This rank's ZeRO-3 partition of the frozen target (see the module docstring). Collective: every rank."""
    from ds_capture.parallel.dist import import_deepspeed
    from ds_capture.parallel.fsdp2_engine import keep_experts_local
    from ds_capture.parallel.shard_spec import build_shard_spec, member_of
    from ds_capture.target.loading import build_meta_model

    deepspeed = import_deepspeed()
    model = build_meta_model(target, dtype=dtype, attn_implementation=attn_implementation).requires_grad_(False)
    model, local = keep_experts_local(model, target, world_size=plan.world_size, rank=plan.rank)
    if expert_storage == "checkpoint":
        from ds_capture.parallel.packed_grouped_experts import keep_grouped_experts_packed

        keep_grouped_experts_packed(model)  # the stacks become packed buffers: no parameters, never partitioned
    alone = _own_group(plan.world_size, plan.rank)
    kept = {id(p) for p in model.parameters()}
    for param in local:
        if id(param) in kept:
            param.ds_zero_partition_process_group = alone  # whole on this rank, never gathered from others
    spec = build_shard_spec(model, member_of(plan), sharding="zero3", family=target.family)  # on meta, before partitioning
    _load_block_by_block(model, target, spec, deepspeed)
    engine, *_ = deepspeed.initialize(model=model, config=dict(ZERO3_CONFIG))
    module = engine.module
    module.__dict__["_ds_capture_zero3_engine"] = engine  # keep the engine (its hooks' owner) alive, unregistered
    return module.eval().requires_grad_(False)


def _own_group(world_size: int, rank: int) -> Any:
    """A process group of this rank alone (``new_group`` is collective: every rank creates every rank's)."""
    own = None
    for r in range(world_size):
        group = torch_dist.new_group([r])
        if r == rank:
            own = group
    return own


@torch.no_grad()
def _load_block_by_block(model: nn.Module, target: TargetInfo, spec: Any, deepspeed: Any) -> None:
    """Materialise, partition and fill ``model`` one block (decoder layer, then the rest) at a time; within a block
    one module's own parameters at a time are ever whole here (then partitioned). ``spec``: the layout's
    :class:`~ds_capture.target.shard_spec.ShardSpec` (the experts and table rows this rank holds, the packed stacks)."""
    from ds_capture.target.nemo_models import fill_from_release, init_nonpersistent_buffers, model_dtype

    device = torch.device("cuda", torch.cuda.current_device()) if torch_dist.get_backend() == "nccl" \
        else torch.device("cpu")
    dtype = model_dtype(model)
    rows, packed = spec.rows(), spec.packed
    names = set(model.state_dict(keep_vars=True)) | set(packed)
    filled: set[str] = set()  # the last block is the whole model: its layers' stacks are filled already
    for prefix, block in _blocks(model, target.family):
        fresh = _materialise_and_partition(block, prefix, device, deepspeed, packed)
        destinations: dict[str, Any] = {}
        block_rows: dict[str, tuple[int, int]] = {}
        finish: list[Callable[[], None]] = []
        for name, tensor in fresh.items():
            if name in filled:
                continue
            filled.add(name)
            if name in packed:
                destinations[name], block_rows[name] = tensor, rows[name]
                tensor.device = device
            elif hasattr(tensor, "ds_id"):
                _partition_destination(name, tensor, rows, destinations, block_rows, finish)
            elif name in names:  # a persistent buffer, whole on every rank
                destinations[name] = tensor
        fill_from_release(target, model.config, destinations, block_rows, dtype=dtype, names=names, packed=packed)
        for step in finish:
            step()
    init_nonpersistent_buffers(model, target.family)


def _blocks(model: nn.Module, family: Any) -> list[tuple[str, nn.Module]]:
    """Each decoder layer, then the model itself (its remaining tensors: embedding, norms, lm_head, Engram...)."""
    layers = get_submodule(model, family.layers)
    items = layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers)
    return [*((f"{family.layers}.{key}.", layer) for key, layer in items), ("", model)]


def _materialise_and_partition(block: nn.Module, prefix: str, device: torch.device, deepspeed: Any,
                               packed: frozenset[str]) -> dict[str, Any]:
    """Module by module, children first: give the module's own tensors still on meta uninitialised storage on
    ``device`` and convert its parameters to ZeRO-3 ones (``zero.Init(module=...)``: partitioned, the whole copy
    freed). Returns full name -> owner (a ZeRO parameter, a buffer, or a packed expert stack)."""
    fresh: dict[str, Any] = {}
    replaced: dict[int, nn.Parameter] = {}  # a tied parameter stays one parameter
    for module_name, module in reversed(list(block.named_modules())):
        full = prefix + (f"{module_name}." if module_name else "")
        if full[:-1] in packed:
            fresh[full[:-1]] = module
        for leaf, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                module._buffers[leaf] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
                fresh[full + leaf] = module._buffers[leaf]
        materialised = False
        for leaf, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                if id(param) not in replaced:  # a meta tensor's storage cannot be swapped in place: a new parameter
                    new = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False)
                    new.__dict__.update(param.__dict__)  # ds_zero_partition_process_group, if set
                    replaced[id(param)] = new
                    fresh[full + leaf] = new
                module._parameters[leaf] = replaced[id(param)]
                materialised = True
        if materialised:
            deepspeed.zero.Init(module=module, config_dict_or_path=dict(ZERO3_CONFIG))
    return fresh


def _partition_destination(name: str, param: Any, rows: dict[str, tuple[int, int]], destinations: dict[str, Any],
                           block_rows: dict[str, tuple[int, int]], finish: list[Callable[[], None]]) -> None:
    """Where the checkpoint's rows for this rank's partition of ``param`` go (and how they reach ``ds_tensor``).

    DeepSpeed partitions the flattened parameter, padded to a multiple of its group's size, into equal ranges:
    rank ``r`` of the group holds ``[r * n, (r + 1) * n)``. A one-rank group's range is the whole (local) tensor,
    filled in place (``rows``: the experts or table rows it holds); otherwise the rows covering the range are read
    into a scratch tensor and the range copied out of it."""
    group = param.ds_process_group
    size, rank = torch_dist.get_world_size(group), torch_dist.get_rank(group)
    partition = param.ds_tensor
    shape, numel = tuple(param.ds_shape), param.ds_numel
    if size == 1:
        whole = partition.view(shape)
        if name in rows:
            block_rows[name] = rows[name]
            count = rows[name][1]
            whole[count:].zero_()  # a table's last owner: padding rows past the table
            whole = whole[:count]
        destinations[name] = whole
        return
    start = partition.numel() * rank
    end = min(start + partition.numel(), numel)
    partition[max(end - start, 0):].zero_()  # the padding past the parameter's last element
    if start >= end:
        return  # this rank's range is all padding
    if not shape:  # a scalar: read whole
        scratch = torch.empty((), dtype=partition.dtype, device=partition.device)
        destinations[name] = scratch
        finish.append(lambda: partition[:1].copy_(scratch.reshape(1)))
        return
    row = numel // shape[0]
    first, last = start // row, -(-end // row)
    scratch = torch.empty((last - first, *shape[1:]), dtype=partition.dtype, device=partition.device)
    destinations[name], block_rows[name] = scratch, (first, last - first)
    offset = start - first * row
    finish.append(lambda: partition[:end - start].copy_(scratch.reshape(-1)[offset:offset + end - start]))
