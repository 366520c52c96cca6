"""Rewrite the "# ds-capture plan says:" block of every real-target recipe in configs/ from plan's own output.

Each block lists the ``ds-capture plan ...`` commands it was made from (the recipe with a typed-in release
config.json from tests/fixtures/release_configs/); this reruns them and replaces the figures under each one.
tests/unit/test_plan_recipes.py fails when a block differs from what plan says now, and when docs/sizing.md's
table lacks a row of these runs.

    python tools/plan_headers.py [--table]   # --table also prints docs/sizing.md's table of these runs
                                             # (--readme, its old name, still works)
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_capture.cli import regenerate_header  # noqa: E402
from ds_capture.sizing.report import BLOCK_START  # noqa: E402


def main() -> None:
    import os

    os.chdir(REPO)
    table = ["| target | layout | experts | attention | MLP | embed+head | other | params | activations (largest term) "
             "| capture | reserve | gathered (FSDP2 / ZeRO-3) | peak per rank | verdict (largest consumer) |", "|" + "---|" * 14]
    for recipe in sorted((REPO / "configs").glob("*.yaml")):
        text = recipe.read_text()
        if BLOCK_START not in text.split("\n"):
            continue
        new_text, runs = regenerate_header(text)
        recipe.write_text(new_text)
        print(f"{recipe.relative_to(REPO)}: {len(runs)} plan run(s)" + ("" if new_text == text else ", rewritten"))
        table += [table_row(command, report) for command, report in runs]
    if "--table" in sys.argv or "--readme" in sys.argv:
        print("\n".join(table))


def table_row(command: str, report) -> str:
    """One markdown row of docs/sizing.md's plan table (GiB per rank)."""
    worst, gib = report.worst, 2**30
    kinds = [worst.param_bytes_by_kind[k] / gib for k in ("routed experts", "attention", "dense/shared MLP",
                                                          "embeddings + lm_head", "other")]
    name, value = report.largest_consumer()
    verdict = "fits" if report.fits else "**does not fit**"
    release = command.split("release_configs/")[1].split()[0]
    chunks = f", rows in chunks of {report.chunk_tokens}" if report.chunk_tokens else ""
    if report.seq_length != 4096:  # the table's rows are S = 4096 unless they say otherwise (long rows)
        chunks = f", S = {report.seq_length:,}" + chunks
    return (f"| {release} | {report.layout.describe()}, experts as {report.expert_storage.format}{chunks} | "
            + " | ".join(f"{v:.1f}" for v in kinds)
            + f" | {worst.param_bytes / gib:.1f} | {worst.activation_bytes / gib:.1f} ({report.activation_largest.name})"
            f" | {worst.capture_bytes / gib:.1f} | {worst.reserve_bytes / gib:.1f} | {worst.fsdp2_gather_bytes / gib:.1f}"
            f" | {worst.peak_bytes / gib:.1f} of "
            f"{report.budget_bytes / gib:.1f} | {verdict} ({name} {value / gib:.1f}) |")


if __name__ == "__main__":
    main()
