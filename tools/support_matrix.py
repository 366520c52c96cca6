"""Print docs/support.md's family x layout support table (markdown) from the test results and the registry.

In:  ``benchmarks/results/support_matrix.json``, written by ``tests/distributed/test_family_layouts.py`` (per
     family and layout: ``equal`` with the max relative diff vs one process, ``differs``, or ``refused`` with the
     reason), and the refusals declared in ``ds_capture.target.family_registry.FAMILIES``.
Out: a markdown table on stdout; a layout with no test result and no declared refusal reads "untested".
     Paste it over the table in docs/support.md: tests/unit/test_docs.py fails while the page differs.

    python -m pytest tests/unit/test_families.py tests/distributed/test_family_layouts.py
    python tools/support_matrix.py            # or: --results path/to/support_matrix.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from ds_capture.target.families import FAMILIES  # noqa: E402

LAYOUTS = (("single", "single"), ("dp", "DP"), ("tp", "TP"), ("ep", "EP"), ("tp_x_ep", "TP x EP"),
           ("fsdp2", "FSDP2"))
SHOWN = ("qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v4", "glm_moe_dsa", "gemma4", "kimi_k25",
         "glm4_moe", "qwen3_5_moe", "qwen3_next", "deepseek_v32", "minimax_m2", "kimi_linear", "gpt_oss", "glm5_next",
         "llama4", "minimax_m3_vl", "deepseek_v41", "kimi_k3")


def cell(model_type: str, layout: str, results: dict) -> str:
    """One table cell: the tested outcome first, else what the registry declares."""
    family = FAMILIES[model_type]
    if family.refusal:
        return "refused"
    tested = results.get(model_type, {}).get(layout)
    if tested and tested["status"] == "equal":
        return "yes" if layout == "single" else f"yes ({tested['max_rel_diff']:.0e})"
    if tested and tested["status"] == "differs":
        return f"DIFFERS ({tested['max_rel_diff']:.0e})"
    uses_tp, uses_ep = layout in ("tp", "tp_x_ep"), layout in ("ep", "tp_x_ep")
    if (uses_tp and not family.supports_tp) or (uses_ep and not (family.supports_ep and family.is_moe)):
        return "refused"
    if tested and tested["status"] == "refused":
        return "refused"
    return "untested"


def notes(results: dict) -> list[str]:
    """One line per family with a declared refusal (the reason the user sees) or a caveat."""
    lines = []
    for model_type in SHOWN:
        family = FAMILIES[model_type]
        for what, reason in (("all layouts", family.refusal.format(model_type=model_type)),
                             ("TP", family.tp_refusal if not family.supports_tp else ""),
                             ("EP", family.ep_refusal if not family.supports_ep else ""),
                             ("caveat", family.caveat)):
            if reason:
                lines.append(f"- `{model_type}` {what}: {reason}")
    return lines


def render(results: dict) -> str:
    header = "| family | " + " | ".join(name for _, name in LAYOUTS) + " |"
    rule = "|---" * (len(LAYOUTS) + 1) + "|"
    rows = [f"| `{m}` | " + " | ".join(cell(m, layout, results) for layout, _ in LAYOUTS) + " |" for m in SHOWN]
    legend = ("yes (d): the cache equals the single-process cache, max |a-b| / max(1, max|a|) = d (fp32, CPU/gloo); "
              "DP, TP, EP: engine deepspeed (TP: AutoTP, or the family's own tp_plan where it has one: "
              + ", ".join(f"`{m}`" for m in SHOWN if FAMILIES[m].tp_plan) + "); FSDP2: engine fsdp2 on 2 ranks; "
              "untested: allowed but not covered by tests/distributed/test_family_layouts.py yet.")
    return "\n".join([header, rule, *rows, "", legend, "", *notes(results)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "support_matrix.json")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text()) if args.results.is_file() else {}
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
