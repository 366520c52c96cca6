"""Records which family x layout combinations the distributed tests showed equal to the single process.

Tests call ``record``; ``tools/support_matrix.py`` renders ``benchmarks/results/support_matrix.json`` as the
README's support table, so the table comes from the test matrix rather than from hand edits.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "support_matrix.json"


def record(model_type: str, layout: str, entry: dict) -> None:
    """Store ``entry`` (status equal/differs/refused, max_rel_diff, ...) for ``model_type`` x ``layout``."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    data.setdefault(model_type, {})[layout] = entry
    RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
