"""Rewrite the "# ds-capture plan says:" block of every real-target recipe in configs/ from plan's own output.

Each block lists the ``ds-capture plan ...`` commands it was made from (the recipe with a typed-in release
config.json from tests/fixtures/release_configs/); this reruns them and replaces the figures under each one.
tests/unit/test_plan_recipes.py fails when a block differs from what plan says now.

    python tools/plan_headers.py            # from the repository root
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_capture.sizing_report import BLOCK_START, regenerate_header  # noqa: E402


def main() -> None:
    import os

    os.chdir(REPO)
    for recipe in sorted((REPO / "configs").glob("*.yaml")):
        text = recipe.read_text()
        if BLOCK_START not in text.split("\n"):
            continue
        new_text, runs = regenerate_header(text)
        recipe.write_text(new_text)
        print(f"{recipe.relative_to(REPO)}: {len(runs)} plan run(s)" + ("" if new_text == text else ", rewritten"))


if __name__ == "__main__":
    main()
