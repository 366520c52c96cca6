"""``ds-capture plan``: what one capture run (or ``serve``) needs on every rank, from the target's ``config.json`` alone.

In:  a validated :class:`~ds_capture.recipe.config.RunConfig`, a world size and a GPU budget, or the session's own
     :class:`~ds_capture.sizing.session_plan.SessionPlan` (the cache kind's layer ids, the resolved layout, the
     driver). Nothing else is read but the target's ``config.json`` (no weights, no tokenizer needed) and, when it
     exists, the dataset (to count its rows and estimate their lengths).
Out: a :class:`PlanReport`: per rank, parameter bytes by kind (counted from the real-size model built on
     ``meta`` and shaped by the engines' own layout functions, :mod:`ds_capture.parallel.meta_layout`), the
     forward's activation peak (an estimate, :mod:`ds_capture.sizing.memory_model`, with its largest term named), the
     capture buffers, the writer's device and host memory, an EAGLE-3 supervising rank's lm_head and logits chunk
     (:mod:`.supervision`), the total against the budget, and the cache's size (none for ``serve``).
     The session (``run``, ``serve``) calls :func:`refuse_if_not_fitting` on its SessionPlan before any weight loads.

Ranks are computed per distinct role and expanded: under the DeepSpeed engine a rank's parameters depend only
on its TP rank (every EP rank holds E/ep experts), its writer memory on whether it is its TP group's rank 0;
under FSDP2 on the rank's dim-0 chunks. So a world of 512 costs one meta model.

    report = plan_capture(load_config("configs/glm5.yaml"), world_size=64, gpu_memory_gib=79.6)
    print(report.format())
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ds_capture.errors import CaptureError
from ds_capture.parallel.resolve import layout_of
from ds_capture.recipe.config import RunConfig
from ds_capture.sizing import memory_model as mm
from ds_capture.sizing.cache_size import cache_estimate
from ds_capture.sizing.alternatives import Proposal, fitting_layouts
from ds_capture.sizing.count import DTYPE_BYTES, Layout, RankEstimate, Sizer
from ds_capture.sizing.session_plan import SessionPlan, resolve_session
from ds_capture.sizing.supervision import Supervision, supervision_of
from ds_capture.target.families import TargetInfo

MAX_WORLD_SIZE = 512


@dataclass
class PlanReport:
    """Everything ``ds-capture plan`` prints; :meth:`to_dict` is the ``--json`` object."""

    source: str
    target: TargetInfo
    layout: Layout
    compute_dtype: str
    cache_dtype: str
    seq_length: int
    layer_ids: list[int]
    budget_bytes: float
    budget_source: str
    expert_storage: mm.ExpertStorage
    total_params: int
    ranks: list[RankEstimate]
    activation_largest: mm.Term
    activation_terms: list[mm.Term]
    cache: dict[str, Any] | None
    """The cache's size (:mod:`.cache_size`); None for ``serve``, which writes none."""
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    storage_alternatives: list[dict[str, Any]] = field(default_factory=list)
    chunk_tokens: int | None = None
    """``capture.chunked_prefill`` as plan sizes it: the configured chunk, ``auto``'s choice, or None (whole rows)."""
    carried_state: dict[str, Any] | None = None
    """Under chunked prefill: one row's carried state per rank (bytes) and how it was found (counted / bound)."""
    chunked_prefill: int | str = "auto"
    """The configured setting (``auto``: plan chose ``chunk_tokens``)."""
    driver: str = "run"
    """``run`` (a cache; ``micro_batch_size`` rows per forward) or ``serve`` (``--max-batch-rows`` rows, no cache)."""
    supervision: Supervision | None = None
    """The supervising ranks' lm_head and logits chunk (EAGLE-3), None where nothing is supervised."""

    @property
    def worst(self) -> RankEstimate:
        return max(self.ranks, key=lambda r: r.peak_bytes)

    @property
    def fits(self) -> bool:
        return self.worst.peak_bytes <= self.budget_bytes

    def largest_consumer(self) -> tuple[str, float]:
        name, value = max(self.worst.consumers().items(), key=lambda item: item[1])
        if name == "activations":
            name = f"activations ({self.activation_largest.name})"
        return name, value

    def reason(self) -> str:
        """The one-line verdict (``run`` refuses with it)."""
        worst, (name, value) = self.worst, self.largest_consumer()
        verdict = "fits" if self.fits else "does NOT fit"
        line = (f"{self.layout.describe()}: rank {worst.rank} needs {_gib(worst.peak_bytes)} of "
                f"{_gib(self.budget_bytes)} per GPU ({self.budget_source}): {verdict}; largest consumer: {name} "
                f"{_gib(value)}")
        if not self.fits and self.alternatives:
            line += "; would fit: " + "; ".join(a["layout"] for a in self.alternatives[:3])
        return line

    def to_dict(self) -> dict[str, Any]:
        name, value = self.largest_consumer()
        return {
            "config": self.source, "driver": self.driver, "model_type": self.target.model_type,
            "total_params": self.total_params,
            "layout": {"engine": self.layout.engine, "world_size": self.layout.world_size,
                       "dp_size": self.layout.dp_size, "tp_size": self.layout.tp_size,
                       "ep_size": self.layout.ep_size, "zero_stage": self.layout.zero_stage,
                       "micro_batch_size": self.layout.micro_batch_size,
                       "seq_length": self.seq_length, "chunk_tokens": self.chunk_tokens},
            "carried_state": self.carried_state,
            "compute_dtype": self.compute_dtype, "cache_dtype": self.cache_dtype, "layer_ids": self.layer_ids,
            "expert_storage": {"format": self.expert_storage.format, "detail": self.expert_storage.detail},
            "gpu_memory_bytes": int(self.budget_bytes), "gpu_memory_source": self.budget_source,
            "fits": self.fits, "largest_consumer": {"name": name, "bytes": int(value)},
            "activation_estimate": {"largest_term": self.activation_largest.name,
                                    "largest_term_bytes": int(self.activation_largest.bytes),
                                    "note": self.activation_largest.note,
                                    "stack_terms": {t.name: int(t.bytes) for t in self.activation_terms}},
            "reason": self.reason(),
            "per_rank": [r.to_dict(self.budget_bytes) for r in self.ranks],
            "layouts_that_fit": self.alternatives,
            "expert_storage_alternatives": self.storage_alternatives,
            "cache": self.cache,
            "supervision": self.supervision_terms(),
        }

    def supervision_terms(self) -> dict[str, Any] | None:
        """The supervising ranks' (EAGLE-3) terms by name, in bytes: the whole lm_head and one logits chunk."""
        if self.supervision is None:
            return None
        terms = self.supervision.device_terms(self.layout.micro_batch_size, self.seq_length, self.chunk_tokens)
        return {"driver": self.driver, "draft_vocab_size": self.supervision.draft_vocab_size,
                "logits_positions": self.supervision.logits_positions(self.layout.micro_batch_size, self.seq_length),
                **{term.name.replace("supervision ", "") + "_bytes": int(term.bytes) for term in terms}}

    def format(self) -> str:
        from ds_capture.sizing.report import format_report

        return format_report(self)


# ----------------------------------------------------------------------------------------------------------------

def plan_capture(cfg: RunConfig, *, world_size: int | None = None, gpu_memory_gib: float | None = None,
                 compute_dtype: str | None = None, suggest: bool = True, count_dataset: bool = True,
                 session: SessionPlan | None = None, serve_rows: int | None = None) -> PlanReport:
    """Size ``cfg`` on ``world_size`` ranks (default: the smallest world its degrees allow) against the budget.

    ``compute_dtype`` None follows ``capture.compute_dtype``, sizing a GPU run (``auto`` = bf16).
    ``gpu_memory_gib`` None: ``capture.gpu_memory_gib``, else the local CUDA device's, else an 80 GB GPU.
    ``session``: the session's own :class:`SessionPlan` (:func:`~ds_capture.session.plan_session`), sized as it is;
    None: resolved here by the same :func:`resolve_session` (``ds-capture plan``; ``serve_rows``: as ``ds-capture
    serve --max-batch-rows serve_rows``).
    """
    from ds_capture.parallel.deepspeed_engine import tp_grain_size

    args = cfg.recipe_args
    if session is None:
        if world_size is not None and not 1 <= world_size <= MAX_WORLD_SIZE:
            raise CaptureError(f"--world-size {world_size} must be between 1 and {MAX_WORLD_SIZE}.")
        session = resolve_session(cfg, world_size=world_size, serve_rows=serve_rows)
    target, chunk = session.target, session.chunk_tokens
    if not 1 <= session.plan.world_size <= MAX_WORLD_SIZE:
        raise CaptureError(f"--world-size {session.plan.world_size} must be between 1 and {MAX_WORLD_SIZE}.")
    budget, budget_source = resolve_budget(cfg, gpu_memory_gib)
    dtype_name = compute_dtype or ("bf16" if cfg.capture.compute_dtype == "auto" else cfg.capture.compute_dtype)
    layout = Layout.of(session.plan, cfg.engine, session.micro_batch_size)
    storage = _configured_storage(cfg, target, partitioned_ep=_partitioned_ep(layout))
    sizer = Sizer(cfg, target, session.layer_ids, dtype_name, tp_grain_size(cfg.deepspeed_config),
                  pre_norm_last=session.pre_norm_last,
                  supervision=supervision_of(session, cfg, DTYPE_BYTES[dtype_name]))
    ranks, largest, stack = sizer.ranks(layout, storage, chunk)
    if cfg.capture.chunked_prefill == "auto" and max(r.peak_bytes for r in ranks) > budget:
        chunk, (ranks, largest, stack) = _largest_fitting_chunk(sizer, layout, storage, budget, target, args.seq_length,
                                                                (ranks, largest, stack))
    report = PlanReport(
        source=cfg.source, target=target, layout=layout, compute_dtype=dtype_name, cache_dtype=args.cache_dtype,
        seq_length=args.seq_length, layer_ids=session.layer_ids, budget_bytes=budget, budget_source=budget_source,
        expert_storage=storage, total_params=sizer.table(layout.sharding, layout.tp_size, layout.ep_size,
                                                         layout.world_size).total_params,
        ranks=ranks, activation_largest=largest, activation_terms=stack,
        cache=None if session.serve else cache_estimate(cfg, target, session.layer_ids, count_dataset),
        chunk_tokens=chunk, chunked_prefill=cfg.capture.chunked_prefill,
        carried_state=dataclasses.asdict(sizer.carried_state()) if chunk else None,
        driver=session.driver, supervision=sizer.supervision,
    )
    report.storage_alternatives = _storage_alternatives(sizer, layout, storage, chunk, budget)
    if suggest and not report.fits:
        report.alternatives = fitting_layouts(sizer, layout, storage, budget, resolve=_layout_resolver(target))
    return report


def _storage_alternatives(sizer: Sizer, layout: Layout, storage: mm.ExpertStorage, chunk: int | None,
                          budget: float) -> list[dict[str, Any]]:
    """The same ranks with the routed experts stored the other way (dequantized, or in the checkpoint's format),
    where the checkpoint is quantized and its experts can stay resident in this layout."""
    target = sizer.target
    checkpoint = (None if target.family.is_nemo and not _partitioned_ep(layout)  # NeMo's experts resident only there
                  else mm.checkpoint_expert_storage(target_quantization(target)))
    if checkpoint is None or checkpoint.bytes_per_param is None:
        return []
    out = []
    for option in (mm.COMPUTE_STORAGE, checkpoint):
        if option.format != storage.format:
            worst = max(sizer.ranks(layout, option, chunk)[0], key=lambda r: r.peak_bytes)
            out.append({
                "expert_storage": "checkpoint" if option is checkpoint else "dequantized", "format": option.format,
                "detail": option.detail, "param_bytes": int(worst.param_bytes),
                "peak_bytes": int(worst.peak_bytes), "fits": worst.peak_bytes <= budget})
    return out


def _largest_fitting_chunk(sizer: Sizer, layout: Layout, storage: mm.ExpertStorage, budget: float,
                           target: TargetInfo, seq_length: int, whole: tuple) -> tuple[int | None, tuple]:
    """``chunked_prefill: auto`` where whole rows do not fit: the largest of S/2, S/4, ... (each a multiple of what
    the family's layer kinds need, at least 256 tokens) that fits; whole rows (and plan's verdict on them) if none
    does, or if the family carries no state between chunks."""
    family = target.family
    if family.chunk_refusal:
        return None, whole
    multiple = max(family.chunk_multiple, 64)
    chunk = seq_length // 2 // multiple * multiple
    while chunk >= max(256, multiple):
        estimate = sizer.ranks(layout, storage, chunk)
        if max(r.peak_bytes for r in estimate[0]) <= budget:
            return chunk, estimate
        chunk = chunk // 2 // multiple * multiple
    return None, whole


def resolve_budget(cfg: RunConfig, gpu_memory_gib: float | None) -> tuple[float, str]:
    """(bytes, where the number came from): the flag, ``capture.gpu_memory_gib``, the local CUDA device, or 80 GB."""
    if gpu_memory_gib is not None:
        return gpu_memory_gib * mm.GIB, "--gpu-memory-gib"
    configured = cfg.capture.gpu_memory_gib
    if configured is not None:
        return configured * mm.GIB, "capture.gpu_memory_gib"
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return float(total), f"this machine's {torch.cuda.get_device_name()}"
    return mm.DEFAULT_GPU_MEMORY_GIB * mm.GIB, "no CUDA device here: an 80 GB GPU"


def refuse_if_not_fitting(cfg: RunConfig, *, compute_dtype: torch.dtype, session: SessionPlan | None = None,
                          world_size: int | None = None) -> SessionPlan | None:
    """The session's check before any weight loads: plan's verdict on ``session`` (None: resolved for
    ``world_size`` ranks), a ``CaptureError`` if it does not fit; else the session with plan's chunk
    (``capture.chunked_prefill: auto``: the chunk that made it fit; None: whole rows).

    The budget is ``capture.gpu_memory_gib`` or, on a CUDA machine, the device's total memory; on a CPU-only
    machine without the key nothing is checked (host memory is not what plan sizes) and ``session`` is returned.
    """
    if (cfg.capture.gpu_memory_gib is None and not torch.cuda.is_available()) or cfg.capture.gpu_memory_gib == 0:
        return session
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[compute_dtype]
    report = plan_capture(cfg, world_size=world_size, compute_dtype=name, suggest=True, count_dataset=False,
                          session=session)
    if not report.fits:
        driver = "--max-batch-rows" if report.driver == "serve" else "recipe_args.micro_batch_size"
        raise CaptureError(
            f"{cfg.source}: {report.reason()}. Nothing was loaded. Choose a layout that fits (ds-capture plan -c "
            f"{cfg.source}{' --serve' if report.driver == 'serve' else ''} shows every rank), lower {driver}, or "
            "set capture.gpu_memory_gib.")
    return replace(session, chunk_tokens=report.chunk_tokens) if session is not None else None


def target_quantization(target: TargetInfo) -> dict | None:
    """``quantization_config`` of the target's config.json (or of its text_config), None when unquantized."""
    raw = json.loads((target.path / "config.json").read_text())
    for section in (raw, raw.get("text_config") or {}):
        quantization = section.get("quantization_config")
        if quantization:
            # DeepSeek-V4 ships the experts' dtype beside quantization_config (its config class folds it in).
            if section.get("expert_dtype") and "expert_dtype" not in quantization:
                quantization = {**quantization, "expert_dtype": section["expert_dtype"]}
            return quantization
    return None


def _partitioned_ep(layout: Layout) -> bool:
    """FSDP2's or ZeRO-3's expert-parallel layout: everything but the routed experts partitioned over every rank."""
    return layout.ep_size > 1 and layout.partitioned


def _configured_storage(cfg: RunConfig, target: TargetInfo, *, partitioned_ep: bool = False) -> mm.ExpertStorage:
    # capture.expert_storage: checkpoint keeps the routed experts resident in the checkpoint's format.
    if cfg.capture.expert_storage == "checkpoint":  # refused where it cannot run: resolve_layout
        storage = mm.checkpoint_expert_storage(target_quantization(target))
        if storage is not None:
            return storage
    return mm.COMPUTE_STORAGE


def _layout_resolver(target: TargetInfo):
    """A layout plan proposes, resolved by the run's own checks (:func:`~ds_capture.parallel.resolve.layout_of`):
    ``Proposal -> Layout``, a ``CaptureError`` where the run would refuse it."""
    def resolve(proposal: Proposal) -> Layout:
        parallel = layout_of(target, engine=proposal.engine, zero_stage=proposal.zero_stage,
                             world_size=proposal.world_size, rank=0, tp_size=proposal.tp_size,
                             ep_size=proposal.ep_size, expert_storage=None)
        return Layout.of(parallel, proposal.engine, proposal.micro_batch_size)

    return resolve


def _gib(value: float) -> str:
    if abs(value) < mm.GIB:
        return f"{value / (1 << 20):,.1f} MiB"
    return f"{value / mm.GIB:,.1f} GiB"

