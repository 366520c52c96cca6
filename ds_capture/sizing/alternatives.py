"""Other layouts that would fit, when plan's verdict is "does not fit": proposed, resolved, sized.

In:  a :class:`~ds_capture.sizing.count.Sizer`, the layout that does not fit, the budget, and a ``resolve`` that puts
     a :class:`Proposal` through the run's own checks (:func:`~ds_capture.parallel.resolve.layout_of`).
Out: :func:`fitting_layouts` -> up to ``limit`` layouts that fit (a smaller micro-batch first, then more ranks), each
     with its peak. A proposal keeps the layout's engine and ZeRO stage; which sharding it becomes is the resolver's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ds_capture.errors import CaptureError
from ds_capture.sizing import memory_model as mm
from ds_capture.sizing.count import Layout, Sizer


@dataclass(frozen=True)
class Proposal:
    """A layout's degrees before the run's checks resolve them (the engine and ZeRO stage as configured)."""

    engine: str
    world_size: int
    tp_size: int
    ep_size: int
    micro_batch_size: int
    zero_stage: int = 0


def _propose(layout: Layout, **degrees: int) -> Proposal:
    """``layout``'s engine and stage at other degrees (and micro-batch), to be resolved."""
    here = {"world_size": layout.world_size, "tp_size": layout.tp_size, "ep_size": layout.ep_size,
            "micro_batch_size": layout.micro_batch_size}
    return Proposal(layout.engine, zero_stage=layout.zero_stage, **{**here, **degrees})


def fitting_layouts(sizer: Sizer, layout: Layout, storage: mm.ExpertStorage, budget: float,
                    resolve: Callable[[Proposal], Layout], limit: int = 3,
                    max_builds: int = 6) -> list[dict[str, Any]]:
    """Layouts that fit: first a smaller micro-batch here, then larger ep (and other tp) on 1x, 2x, 4x, 8x the
    world, each resolved by ``resolve`` (the run's own checks; a refused one is skipped). At most
    ``max_builds`` new meta models are built (each takes about a second)."""
    found: list[dict[str, Any]] = []
    now = max(sizer.ranks(layout, storage)[0], key=lambda r: r.peak_bytes)
    experts_now = now.param_bytes_by_kind["routed experts"]
    for proposal in _proposals(sizer, layout):
        if len(found) >= limit:
            break
        # One per world, and none that only repeats a found layout's degrees on more ranks.
        if any((f["world_size"], f["micro_batch_size"]) == (proposal.world_size, proposal.micro_batch_size)
               or (f["tp_size"], f["ep_size"], f["micro_batch_size"])
               == (proposal.tp_size, proposal.ep_size, proposal.micro_batch_size) for f in found):
            continue
        # TP never shards the routed experts: a proposal whose experts, reserve and capture buffers (linear in
        # the micro-batch) already exceed the budget is skipped without building its model.
        floor = (experts_now * layout.ep_size / proposal.ep_size + mm.RUNTIME_RESERVE_BYTES
                 + now.capture_bytes * proposal.micro_batch_size / layout.micro_batch_size)
        if floor > budget:
            continue
        try:
            candidate = resolve(proposal)
            if (not sizer.has_table(candidate.sharding, candidate.tp_size, candidate.ep_size, candidate.world_size)
                    and sizer.num_built >= max_builds):
                continue
            worst = max(sizer.ranks(candidate, storage)[0], key=lambda r: r.peak_bytes)
        except CaptureError:
            continue
        if worst.peak_bytes <= budget:
            found.append({"layout": candidate.describe(), "engine": candidate.engine,
                          "world_size": candidate.world_size, "tp_size": candidate.tp_size,
                          "ep_size": candidate.ep_size, "micro_batch_size": candidate.micro_batch_size,
                          "peak_bytes": int(worst.peak_bytes)})
    return found

def _proposals(sizer: Sizer, layout: Layout) -> list[Proposal]:
    """A smaller micro-batch here; then this engine at other degrees on 1x, 2x, 4x and 8x the world (at most 512
    ranks): a partitioned layout (FSDP2, ZeRO-3) keeps tp 1 and its experts over every rank; otherwise, keeping
    the recipe's tp before trying others, every larger ep."""
    family, target = sizer.target.family, sizer.target
    out = [_propose(layout, micro_batch_size=b) for b in _halvings(layout.micro_batch_size)]
    worlds = [w for w in (layout.world_size * m for m in (1, 2, 4, 8)) if w <= 512]
    if layout.partitioned:
        over_world = layout.ep_size > 1
        return out + [_propose(layout, world_size=w, tp_size=1, ep_size=w if over_world else 1)
                      for w in worlds[1:] if not over_world or (target.num_experts and target.num_experts % w == 0)]
    tps = [layout.tp_size] + ([t for t in (1, 2, 4, 8) if t != layout.tp_size] if family.supports_tp else [])
    for tp in tps:
        for world in (w for w in worlds if w % tp == 0):
            eps = [1]
            if family.is_moe and family.supports_ep and target.num_experts:
                eps = [e for e in _divisors(target.num_experts) if e >= layout.ep_size and world % e == 0]
            out.extend(_propose(layout, world_size=world, tp_size=tp, ep_size=ep) for ep in eps)
    return [p for p in out if p != _propose(layout)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _halvings(n: int) -> list[int]:
    out = []
    while n > 1:
        n //= 2
        out.append(n)
    return out
