"""Parallel layout: world = dp x tp (plus ep over the same ranks), validated before any weight loads.

In:  world size and rank (from :class:`ds_capture.parallel.dist.DistEnv`), the TP / EP degrees (one source of
     truth: the YAML ``distributed`` section or the DeepSpeed JSON, see :func:`resolve_degrees`) and
     the target's head / expert counts.
Out: a frozen :class:`ParallelLayout` that answers "my DP rank, my shards / samples, do I write, who is
     in my TP / DP / EP group", and (with a process group) :func:`new_groups` -> the group handles;
     :func:`check_family_layout`: the family's refusals of TP / EP (every driver and ``plan`` call it).

Rank layout (documented contract, DESIGN §5):
  TP groups  consecutive global ranks ``[dp_rank*tp, dp_rank*tp + tp)``; they see the same micro-batch.
  DP groups  ranks with the same ``tp_rank``: ``tp_rank, tp_rank + tp, ...``; ``dp_rank = rank // tp``.
  EP groups  consecutive global ranks ``[(rank // ep)*ep, ... + ep)``, ``ep_rank = rank % ep``: the
             layout of DeepSpeed's ``groups._create_expert_and_data_parallel`` without ``mp_size``. An EP
             group may coincide with a TP group (ranks holding the same tokens each route their own
             copy) or span several DP groups (different tokens per EP rank); both are exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ds_capture.errors import CaptureError
from ds_capture.target.families import Family


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the dp x tp grid and in its EP group."""

    world_size: int
    rank: int
    dp_size: int
    tp_size: int
    ep_size: int
    dp_rank: int
    tp_rank: int
    ep_rank: int
    sharding: str = "deepspeed"
    """What partitions the model besides TP and EP: ``deepspeed`` (nothing: AutoTP x EP, or the whole model), ``fsdp2``
    (FSDP2's dim-0 chunks) or ``zero3`` (ZeRO-3's flat partitions); resolved once (:mod:`.resolve`)."""
    expert_storage: str = "dequantized"
    """``capture.expert_storage``: ``dequantized`` or ``checkpoint`` (kept as released: resident or packed)."""
    zero_stage: int = 0
    """``zero_optimization.stage`` as configured (a stage 3 of one process is the plain model: ``sharding`` deepspeed)."""

    @staticmethod
    def single() -> "ParallelLayout":
        return ParallelLayout(world_size=1, rank=0, dp_size=1, tp_size=1, ep_size=1, dp_rank=0, tp_rank=0, ep_rank=0)

    @property
    def is_writer(self) -> bool:
        """One rank per TP group (its tp-rank 0) writes the shards of its DP rank."""
        return self.tp_rank == 0

    @property
    def is_manifest_writer(self) -> bool:
        """Global rank 0 alone writes the manifest and the target weights."""
        return self.rank == 0

    @property
    def tp_ranks(self) -> list[int]:
        return list(range(self.dp_rank * self.tp_size, (self.dp_rank + 1) * self.tp_size))

    @property
    def dp_ranks(self) -> list[int]:
        return list(range(self.tp_rank, self.world_size, self.tp_size))

    @property
    def ep_ranks(self) -> list[int]:
        start = (self.rank // self.ep_size) * self.ep_size
        return list(range(start, start + self.ep_size))

    def shard_range(self, num_shards: int) -> range:
        """This DP rank's contiguous run of global shard indices (may be empty)."""
        return shard_ranges(num_shards, self.dp_size)[self.dp_rank]

    def sample_range(self, num_samples: int, shard_size: int) -> range:
        """The global sample indices of this DP rank's shards (shard-aligned; the last shard may be short)."""
        num_shards = -(-num_samples // shard_size)
        shards = self.shard_range(num_shards)
        return range(min(shards.start * shard_size, num_samples), min(shards.stop * shard_size, num_samples))


def shard_ranges(num_shards: int, dp_size: int) -> list[range]:
    """Split ``num_shards`` into ``dp_size`` contiguous runs; the first ``num_shards % dp_size`` take one extra.

    ``shard_ranges(5, 2) == [range(0, 3), range(3, 5)]``; with more DP ranks than shards the last
    ranges are empty.
    """
    base, extra = divmod(num_shards, dp_size)
    ranges, start = [], 0
    for dp_rank in range(dp_size):
        stop = start + base + (1 if dp_rank < extra else 0)
        ranges.append(range(start, stop))
        start = stop
    return ranges


def build_layout(*, world_size: int, rank: int, tp_size: int, ep_size: int, num_experts: int | None,
               num_attention_heads: int, num_key_value_heads: int | None) -> ParallelLayout:
    """Validate the degrees against the world and the model, then place ``rank``.

    ``num_experts`` is None for a dense target; ``num_key_value_heads`` None means no GQA (= heads).
    Every failure is a ``CaptureError`` that names the values and the fix, raised before any weight loads.
    """
    fix_degrees = "set distributed.tp_size / distributed.ep_size in the YAML (or the DeepSpeed JSON)"
    for name, value in (("tp_size", tp_size), ("ep_size", ep_size), ("world_size", world_size)):
        if value < 1:
            raise CaptureError(f"{name} {value} must be at least 1; {fix_degrees}.")
    if world_size % tp_size:
        raise CaptureError(f"world_size {world_size} is not a multiple of tp_size {tp_size}: every data-parallel "
                           f"rank needs a full tensor-parallel group. Launch a multiple of {tp_size} ranks or "
                           f"{fix_degrees}.")
    if num_attention_heads % tp_size:
        raise CaptureError(f"tp_size {tp_size} does not divide num_attention_heads {num_attention_heads}: AutoTP "
                           f"splits attention by heads. Use a tp_size that divides {num_attention_heads}.")
    if num_key_value_heads is not None and num_key_value_heads % tp_size:
        raise CaptureError(f"tp_size {tp_size} does not divide num_key_value_heads {num_key_value_heads}: AutoTP "
                           f"splits the key/value heads too. Use a tp_size that divides {num_key_value_heads}.")
    if ep_size > 1 and num_experts is None:
        raise CaptureError(f"ep_size {ep_size} on a dense target: the model has no routed experts to shard. "
                           "Set distributed.ep_size to 1.")
    if num_experts is not None and num_experts % ep_size:
        raise CaptureError(f"ep_size {ep_size} does not divide num_experts {num_experts}: every expert-parallel "
                           f"rank holds the same number of experts. Use an ep_size that divides {num_experts}.")
    if world_size % ep_size:
        raise CaptureError(f"ep_size {ep_size} does not divide world_size {world_size}: expert-parallel groups "
                           f"are consecutive ranks and must tile the world. Launch a multiple of {ep_size} ranks "
                           f"or {fix_degrees}.")
    if not 0 <= rank < world_size:
        raise CaptureError(f"rank {rank} is outside world_size {world_size}; the launcher environment is wrong.")
    return ParallelLayout(world_size=world_size, rank=rank, dp_size=world_size // tp_size, tp_size=tp_size,
                        ep_size=ep_size, dp_rank=rank // tp_size, tp_rank=rank % tp_size, ep_rank=rank % ep_size)


# DeepSpeed 0.19.8 key names: training AutoTP reads tensor_parallel.autotp_size
# (runtime/tensor_parallel/config.py), init_inference reads tensor_parallel.tp_size (inference/config.py),
# AutoEP reads expert_parallel.autoep_size (module_inject/auto_ep_config.py); ep_size is accepted as an alias.
_DS_TP_KEYS = (("tensor_parallel", "autotp_size"), ("tensor_parallel", "tp_size"))
_DS_EP_KEYS = (("expert_parallel", "autoep_size"), ("expert_parallel", "ep_size"))


def check_family_layout(family: Family, tp_size: int, ep_size: int) -> None:
    """The family's own refusals of tensor and expert parallelism: ``run``, ``serve`` and ``plan`` check them first
    (the family's reason beats a head-count mismatch of :func:`build_layout`)."""
    if tp_size > 1 and not family.supports_tp:
        raise CaptureError(f"tp_size {tp_size}: {family.tp_refusal}")
    if ep_size > 1 and not family.supports_ep:
        raise CaptureError(f"ep_size {ep_size}: {family.ep_refusal}")


def resolve_degrees(yaml_tp: int | None, yaml_ep: int | None, ds_config: Mapping[str, Any] | None, *,
                    yaml_source: str, ds_source: str) -> tuple[int, int]:
    """``(tp_size, ep_size)`` from the one place that sets each; a contradiction is an error.

    ``yaml_source`` / ``ds_source`` name the files in messages. A DeepSpeed ``autotp_size`` of 0 means
    "AutoTP off" (DeepSpeed's default) and counts as 1.
    """
    tp = _resolve_one("tp_size", yaml_tp, _ds_values(ds_config, _DS_TP_KEYS, ds_source), yaml_source, ds_source)
    ep = _resolve_one("ep_size", yaml_ep, _ds_values(ds_config, _DS_EP_KEYS, ds_source), yaml_source, ds_source)
    return tp, ep


def _ds_values(ds_config: Mapping[str, Any] | None, keys: tuple[tuple[str, str], ...],
               ds_source: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for section, key in keys:
        block = (ds_config or {}).get(section)
        if isinstance(block, Mapping) and block.get(key) is not None:
            value = block[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CaptureError(f"{ds_source}: {section}.{key} must be a non-negative integer, got {value!r}.")
            found[f"{section}.{key}"] = max(value, 1)
    if len(set(found.values())) > 1:
        shown = " but ".join(f"{k} = {v}" for k, v in found.items())
        raise CaptureError(f"{ds_source}: {shown}. Keep one of them (or make them equal).")
    return found


def _resolve_one(name: str, yaml_value: int | None, ds_values: dict[str, int], yaml_source: str,
                 ds_source: str) -> int:
    ds_value = next(iter(ds_values.values()), None)
    if yaml_value is not None and ds_value is not None and yaml_value != ds_value:
        ds_key = next(iter(ds_values))
        raise CaptureError(f"contradicting parallel degrees: {yaml_source}: distributed.{name} = {yaml_value} but "
                           f"{ds_source}: {ds_key} = {ds_value}. Set the degree in one place only (or make them "
                           "equal).")
    if yaml_value is not None:
        return yaml_value
    return ds_value if ds_value is not None else 1


@dataclass
class ParallelGroups:
    """This rank's process groups; None where the degree is 1 (no communication needed)."""

    tp_group: Any
    dp_group: Any
    ep_group: Any


def new_groups(plan: ParallelLayout) -> ParallelGroups:
    """Create every TP, DP and EP group and return this rank's handles.

    Collective: ``torch.distributed.new_group`` must be called by every rank of the default group for
    every group, members or not, in the same order. The order here is fixed: all TP groups (by
    dp_rank), then all DP groups (by tp_rank), then all EP groups (by first rank). A degree of 1
    creates no group at all (the same decision on every rank, since degrees are global).
    """
    import torch.distributed as torch_dist

    def create(all_ranks: list[list[int]], size: int) -> Any:
        if size == 1:
            return None
        mine = None
        for ranks in all_ranks:
            group = torch_dist.new_group(ranks)
            if plan.rank in ranks:
                mine = group
        return mine

    tp, dp, ep, world = plan.tp_size, plan.dp_size, plan.ep_size, plan.world_size
    tp_group = create([list(range(d * tp, (d + 1) * tp)) for d in range(dp)], tp)
    dp_group = create([list(range(t, world, tp)) for t in range(tp)], dp)
    ep_group = create([list(range(s, s + ep)) for s in range(0, world, ep)], ep)
    return ParallelGroups(tp_group=tp_group, dp_group=dp_group, ep_group=ep_group)
