"""The session's plan: what one run or one service will be, resolved once, before any process group or weight.

In:  a validated :class:`~ds_capture.recipe.config.RunConfig`, the world size and this rank, and the driver: ``run``
     (the recipe's ``micro_batch_size``) or ``serve`` (its ``--max-batch-rows``).
Out: :func:`resolve_session` -> a :class:`SessionPlan`: the target's facts at the recipe's depth, the cache kind's
     layer ids (DSpark's ``target_layer_ids``, EAGLE-3's ``aux_layer_ids``), the resolved
     :class:`~ds_capture.parallel.layout.ParallelLayout`, the chunked prefill's chunk and the driver's largest
     forward. Every refusal of these (family, layer ids, layout, attention, chunking, the driver's cache kind) is
     raised here, once.

``ds-capture plan`` sizes this object (:func:`~ds_capture.sizing.command.plan_capture`) and the session runs it
(:func:`~ds_capture.session.plan_session`), so what plan counts is what the drivers build.

    session = resolve_session(load_config("configs/demo_eagle3.yaml"), world_size=2, serve_rows=8)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds_capture.cache.registry import kind_class
from ds_capture.capture.chunked import resolve_chunk_tokens
from ds_capture.errors import CaptureError
from ds_capture.parallel.layout import ParallelLayout
from ds_capture.parallel.resolve import resolve_layout
from ds_capture.target.families import TargetInfo, read_target_info

SERVE_MAX_BATCH_ROWS = 64
"""``ds-capture serve --max-batch-rows``'s default: the most rows one request (and one forward) may carry."""


@dataclass(frozen=True)
class SessionPlan:
    """What a session will be, known before any process group or weight: the target, its layer ids, the layout."""

    target: TargetInfo
    layer_ids: list[int]
    """The cache kind's layer ids (EAGLE-3: its aux layers), checked against the target's depth."""
    plan: ParallelLayout
    chunk_tokens: int | None = None
    """``capture.chunked_prefill`` resolved: rows are forwarded in chunks of this many tokens (``None``: whole)."""
    micro_batch_size: int = 1
    """Rows of the largest forward: the recipe's ``micro_batch_size`` (``run``), ``--max-batch-rows`` (``serve``)."""
    serve: bool = False
    """The driver is ``ds-capture serve`` (each replica's first rank supervises every answer; no cache is written)."""
    pre_norm_last: bool = False
    """The cache kind's hook semantics: layer id L-1 is the last decoder layer's own output (EAGLE-3)."""
    supervised: bool = False
    """The writing rank computes the target's distribution from the final state and the whole lm_head (EAGLE-3)."""

    @property
    def driver(self) -> str:
        return "serve" if self.serve else "run"


def resolve_session(cfg: Any, *, world_size: int | None, rank: int = 0,
                    serve_rows: int | None = None) -> SessionPlan:
    """``cfg``'s session on ``world_size`` ranks (None: the smallest world its degrees allow), placed at ``rank``;
    ``serve_rows``: sized as ``ds-capture serve --max-batch-rows serve_rows`` (None: as ``run``)."""
    args = cfg.recipe_args
    if serve_rows is not None:
        if cfg.cache_kind != "eagle3":
            raise CaptureError(f"{cfg.source}: ds-capture serve answers NeMo's EAGLE-3 remote protocol: set "
                               f"`cache_kind: eagle3` (got {cfg.cache_kind!r}); recipe_args.aux_layer_ids chooses "
                               "the aux layers.")
        if serve_rows < 1:
            raise CaptureError(f"--max-batch-rows ({serve_rows}) must be >= 1.")
    target = read_target_info(args.target_path, trust_remote_code=args.trust_remote_code)
    target = target.with_depth(args.target_num_hidden_layers, source=cfg.source)
    kind = kind_class(cfg.cache_kind)
    layer_ids = kind(cfg).resolve_layer_ids(cfg, target)
    # The layout, resolved once (family, degrees, sharding, expert storage): plan sizes this same value.
    plan = resolve_layout(cfg, target, world_size=world_size, rank=rank)
    target.family.resolve_attn_implementation(args.target_attn_implementation, source=cfg.source)
    chunk_tokens = resolve_chunk_tokens(cfg.capture.chunked_prefill, target.family, args.seq_length,
                                        source=cfg.source)
    return SessionPlan(target=target, layer_ids=layer_ids, plan=plan, chunk_tokens=chunk_tokens,
                       micro_batch_size=args.micro_batch_size if serve_rows is None else serve_rows,
                       serve=serve_rows is not None, pre_norm_last=kind.pre_norm_last, supervised=kind.supervised)
