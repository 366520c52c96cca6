"""Text output of ``ds-capture plan``: a :class:`~ds_capture.sizing.command.PlanReport` -> the lines a user reads.

Ranks with identical figures are listed once, with their rank list (``0,8,16,...`` or ``0-63``).
"""

from __future__ import annotations

from typing import Any

from ds_capture.sizing import memory_model as mm
from ds_capture.sizing.count import KINDS

_SHORT = {"routed experts": "experts", "attention": "attn", "dense/shared MLP": "mlp",
          "embeddings + lm_head": "embed+head", "other": "other"}


_CARRIED_HOW = {"counted": "a meta forward's cache", "bound": "keys and values of every layer, an upper bound",
                "declared": "the family's carriers, from their declared shapes"}


def format_report(report: Any) -> str:
    t, layout = report.target, report.layout
    serve = report.driver == "serve"
    lines = [
        f"ds-capture plan {report.source}{' --serve' if serve else ''}: {t.model_type}, "
        f"{report.total_params / 1e9:,.1f}B parameters, "
        f"{t.num_hidden_layers} layers, hidden {t.hidden_size}"
        + (f", {t.num_experts} routed experts" if t.num_experts else ""),
        f"  layout: {layout.describe()} x seq_length {report.seq_length}"
        + (f" (serve: --max-batch-rows {layout.micro_batch_size} rows per forward)" if serve else "")
        + f"; compute {report.compute_dtype}, cache {report.cache_dtype}; experts stored as "
        f"{report.expert_storage.format} ({report.expert_storage.detail}); "
        f"{'aux layer ids' if report.supervision else 'layer ids'} {report.layer_ids}",
        f"  budget: {_gib(report.budget_bytes)} per GPU ({report.budget_source})",
        *([f"  chunked prefill: rows forwarded in chunks of {report.chunk_tokens} tokens; each row's carried state "
           f"{_gib(report.carried_state['bytes_per_row'])} per rank at S ({report.carried_state['how']}: "
           + _CARRIED_HOW[report.carried_state["how"]] + ")"] if report.chunk_tokens else []),
        "",
        "  per rank, GiB (parameters counted from the sharded meta model; activations are an estimate):",
        "  " + f"{'ranks':>24} " + " ".join(f"{h:>10}" for h in [*(_SHORT[k] for k in KINDS), "params", "activ.", "capture",
                                              "reserve", "zero3 ag" if layout.sharding == "zero3" else "fsdp2 ag",
                                              *(["superv."] if report.supervision else []), "peak", "host", "fits"]),
    ]
    for ranks, estimate in _groups(report.ranks):
        figures = [*(estimate.param_bytes_by_kind[k] for k in KINDS), estimate.param_bytes, estimate.activation_bytes,
                   estimate.capture_bytes, estimate.reserve_bytes, estimate.fsdp2_gather_bytes,
                   *([estimate.supervision_bytes] if report.supervision else []), estimate.peak_bytes,
                   estimate.host_bytes]
        fits = "yes" if estimate.peak_bytes <= report.budget_bytes else "NO"
        lines.append("  " + f"{_ranks(ranks):>24} " + " ".join(f"{v / mm.GIB:>10.2f}" for v in figures)
                     + f" {fits:>10}")
    largest = report.activation_largest
    lines += [
        "",
        f"  activation peak (estimate): {_gib(report.worst.activation_bytes)}; largest term: {largest.name} "
        f"{_gib(largest.bytes)} ({largest.note}); through the stack: "
        + ", ".join(f"{term.name} {_gib(term.bytes)}" for term in report.activation_terms),
        *_supervision_lines(report),
        _writer_line(report),
        "",
        f"  {'FITS' if report.fits else 'DOES NOT FIT'}: {report.reason()}",
    ]
    for option in report.storage_alternatives:
        lines.append(f"  with capture.expert_storage: {option['expert_storage']} ({option['detail']}): params "
                     f"{_gib(option['param_bytes'])}, peak {_gib(option['peak_bytes'])} per rank: "
                     f"{'fits' if option['fits'] else 'does NOT fit'}")
    for option in report.alternatives:
        lines.append(f"  would fit: {option['layout']} (peak {_gib(option['peak_bytes'])})")
    if report.cache is not None:
        lines.append(_cache_line(report.cache))
    return "\n".join(lines)


def _supervision_lines(report: Any) -> list[str]:
    """EAGLE-3's supervising ranks (each TP group's first: run's writers, serve's listeners): their terms."""
    terms = report.supervision_terms()
    if terms is None:
        return []
    who = "listening rank (serve)" if report.driver == "serve" else "writing rank"
    return [f"  supervision (each {who}): the whole lm_head {_gib(terms['lm_head_bytes'])} + one chunk of "
            f"full-vocabulary logits ({terms['logits_positions']:,} positions, draft vocabulary "
            f"{terms['draft_vocab_size']:,}) {_gib(terms['logits_bytes'])} at its peak"]


def _writer_line(report: Any) -> str:
    host = _gib(max(r.writer_host_bytes for r in report.ranks))
    if report.driver == "serve":
        return (f"  answer: {host} on the host per listening rank (one forward's aux states and fp32 target_probs over "
                "the whole vocabulary); each listener also holds the embedding and lm_head on the host")
    return (f"  writer: 0 on the device after each forward; host {host} per writing rank (capture.writer_buffer_mib, "
            "at least one micro-batch); rank 0 also reads the embedding and lm_head on the host")


def _cache_line(cache: dict[str, Any]) -> str:
    line = f"  cache: {_mib(cache['bytes_per_sample'])} per sample (padded to S, as {cache['format']} stores rows)"
    if cache["total_bytes"] is not None:
        return line + (f"; {cache['num_samples']:,} samples: {_gib(cache['total_bytes'])} with target weights; "
                       f"without stored padding ~{_gib(cache['unpadded_total_bytes'])} (mean "
                       f"{cache['lengths']['mean_tokens']} tokens per row, {cache['lengths']['how']})")
    return line + f"; {cache['note']}"


def _groups(ranks: list) -> list[tuple[list[int], Any]]:
    """Ranks whose figures are identical, grouped (first-seen order)."""
    groups: dict[tuple, tuple[list[int], Any]] = {}
    for estimate in ranks:
        key = (tuple(round(v) for v in estimate.param_bytes_by_kind.values()), round(estimate.peak_bytes),
               round(estimate.host_bytes))
        groups.setdefault(key, ([], estimate))[0].append(estimate.rank)
    return list(groups.values())


def _ranks(ranks: list[int], shown: int = 3) -> str:
    """``0``, ``1-15``, ``1-3,5-7``; after ``shown`` runs, ``... (N ranks)``."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:shown])
    return text + (f",... ({len(ranks)} ranks)" if len(runs) > shown else "")


def _gib(value: float) -> str:
    if abs(value) < mm.GIB:
        return f"{value / (1 << 20):,.1f} MiB"
    return f"{value / mm.GIB:,.1f} GiB"


def _mib(value: float) -> str:
    return f"{value / (1 << 20):,.1f} MiB"


# ----------------------------------------------------------------------------------------------------------------
# Recipe headers: the "# ds-capture plan says:" block of each real-target recipe in configs/ is plan's output.

BLOCK_START = "# ds-capture plan says: (tests/unit/test_plan_recipes.py checks this block; python tools/plan_headers.py rewrites it)"
BLOCK_END = "# (end of ds-capture plan's block)"
COMMAND_PREFIX = "#   $ "


def header_lines(report: Any) -> list[str]:
    """The figures of one plan run, as recipe-header comment lines (after its ``$ ds-capture plan ...`` line)."""
    worst, t = report.worst, report.target
    kinds = ", ".join(f"{_SHORT[k]} {worst.param_bytes_by_kind[k] / mm.GIB:.1f}" for k in KINDS)
    name, value = report.largest_consumer()
    lines = [
        f"#     {t.model_type} {report.total_params / 1e9:.1f}B, {report.layout.describe()} x {report.seq_length}"
        + (f" in chunks of {report.chunk_tokens} (chunked_prefill: {report.chunked_prefill}; carried state "
           f"{report.carried_state['bytes_per_row'] / mm.GIB:.2f} per row)" if report.chunk_tokens else "")
        + f", compute {report.compute_dtype}, experts as {report.expert_storage.format}",
        f"#     per rank (GiB): params {worst.param_bytes / mm.GIB:.1f} ({kinds})",
        f"#       + activations ~{worst.activation_bytes / mm.GIB:.1f} (estimate; largest: {report.activation_largest.name})"
        f" + capture {worst.capture_bytes / mm.GIB:.1f} + reserve {worst.reserve_bytes / mm.GIB:.1f}"
        + (f" + {'ZeRO-3 gathers' if report.layout.sharding == 'zero3' else 'FSDP2 all-gathers'} "
           f"{worst.fsdp2_gather_bytes / mm.GIB:.1f}" if worst.fsdp2_gather_bytes else "")
        + (f" + supervision {worst.supervision_bytes / mm.GIB:.1f}" if worst.supervision_bytes else ""),
        f"#       = {worst.peak_bytes / mm.GIB:.1f} of {report.budget_bytes / mm.GIB:.1f}: "
        f"{'fits' if report.fits else 'does NOT fit'}; largest consumer: {name} {value / mm.GIB:.1f}",
        f"#     writer host memory {max(r.writer_host_bytes for r in report.ranks) / mm.GIB:.1f} GiB per writing rank; "
        + (f"cache {report.cache['bytes_per_sample'] / (1 << 20):.1f} MiB per sample" if report.cache else "no cache"),
    ]
    for option in report.storage_alternatives:
        lines.append(f"#     with capture.expert_storage: {option['expert_storage']} ({option['format']}): peak "
                     f"{option['peak_bytes'] / mm.GIB:.1f} GiB: {'fits' if option['fits'] else 'does NOT fit'}")
    for option in report.alternatives[:2]:
        lines.append(f"#     would fit: {option['layout']} ({option['peak_bytes'] / mm.GIB:.1f} GiB)")
    return lines
