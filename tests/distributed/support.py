"""Records which family x layout combinations the distributed tests showed equal to the single process.

Tests call ``record``; ``tools/support_matrix.py`` renders ``benchmarks/results/support_matrix.json`` as the
support table in docs/support.md, so the table comes from the test matrix rather than from hand edits.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "support_matrix.json"


def record(model_type: str, layout: str, entry: dict) -> None:
    """Store ``entry`` (status equal/differs/refused, max_rel_diff, ...) for ``model_type`` x ``layout``.

    Only a full run records (``DS_CAPTURE_FULL=1``, as ``python3 scripts/dev.py test --full`` sets): the CI cut
    runs a subset of the cells, and its rerun of a cell gives a max_rel_diff that differs in the last digits from
    run to run (measured: 3.4e-07 then 4.4e-07 for one EP cell), which would rewrite the tracked file and break
    tests/unit/test_docs.py's check of the table against it.
    """
    if os.environ.get("DS_CAPTURE_FULL") != "1":
        return
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    data.setdefault(model_type, {})[layout] = entry
    RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def max_rel_diff(a_dir: Path, b_dir: Path) -> float:
    """Max over shards and keys of ``max|a-b| / max(1, max|a|)``; ids and masks must be identical."""
    import torch
    from safetensors.torch import load_file

    names = sorted(p.name for p in a_dir.glob("shard-*.safetensors"))
    assert names == sorted(p.name for p in b_dir.glob("shard-*.safetensors")) and names
    worst = 0.0
    for name in names:
        a, b = load_file(a_dir / name), load_file(b_dir / name)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for key in ("target_hidden_states", "target_last_hidden_states"):
            worst = max(worst, (a[key] - b[key]).abs().max().item() / max(1.0, a[key].abs().max().item()))
    return worst


def safetensors_digests(cache: Path) -> dict[str, str]:
    """File name -> sha256 of every ``*.safetensors`` file of a cache (byte-identity checks)."""
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(cache.glob("*.safetensors"))}
