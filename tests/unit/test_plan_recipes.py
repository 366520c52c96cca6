"""The real-target recipes in configs/ are checked facts: each fits the 8 x 80 GB nodes its header names, and the
"# ds-capture plan says:" block of its header is exactly what ``ds-capture plan`` prints now, and docs/sizing.md's
table holds the row ``tools/plan_headers.py --table`` prints for each of the block's runs.

The targets are the releases' published sizes, typed into tests/fixtures/release_configs/<name>/config.json
(no weights). A block that drifts from plan's output fails here; ``python tools/plan_headers.py`` rewrites it.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from pathlib import Path

import pytest

from ds_capture.cli import regenerate_header
from ds_capture.recipe.config import load_config
from ds_capture.sizing.report import BLOCK_START

REPO = Path(__file__).resolve().parents[2]
SIZING_PAGE = REPO / "docs" / "sizing.md"
GPU_GIB = 79.6  # an 80 GB H100 / A100 as torch reports it
TINY_RECIPES = {"demo.yaml", "demo_eagle3.yaml", "tiny_moe_tp2_ep2.yaml"}
# recipe -> (release config, nodes of 8 GPUs, tp_size, ep_size, experts' storage) for every target its header
# says it serves; the storage is the one capture.expert_storage gives that release (dequantized: bf16).
SERVES = {
    "deepseek_v4_flash.yaml": [("deepseek_v4_flash", 1, 1, 8, "fp4")],
    "deepseek_v41.yaml": [("deepseek_v41", 2, 1, 16, "fp4")],
    "kimi_k3.yaml": [("kimi_k3", 4, 1, 32, "mxfp4")],
    "deepseek_v3_kimi_k2.yaml": [("deepseek_v3", 2, 8, 16, "fp8"), ("kimi_k2", 4, 8, 32, "fp8")],
    "glm5.yaml": [("glm5_fp8", 4, 1, 32, "fp8"), ("glm5", 8, 1, 64, "dequantized")],
    "glm5_tp8_ep32.yaml": [("glm5", 4, 8, 32, "dequantized")],
    "glm46.yaml": [("glm46", 2, 8, 16, "dequantized")],
    "qwen3_235b_a22b.yaml": [("qwen3_235b_a22b", 1, 4, 8, "dequantized")],
    "qwen35.yaml": [("qwen35", 1, 1, 8, "dequantized")],
}


def test_every_real_target_recipe_is_checked():
    recipes = {path.name for path in (REPO / "configs").glob("*.yaml")} - TINY_RECIPES
    assert recipes == set(SERVES)
    for name in recipes:
        assert BLOCK_START in (REPO / "configs" / name).read_text().split("\n"), name


def _table_row():
    """``tools/plan_headers.py``'s row renderer (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("plan_headers", REPO / "tools" / "plan_headers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.table_row


# Transformers' DeepSeek-V4 / V3 / GLM-4.6 classes count their carried state by a meta forward (10 to 15 s a recipe):
# --full checks their headers, CI the other six (both NeMo families, GLM-5's two, both Qwens).
SLOW = {"deepseek_v4_flash.yaml", "deepseek_v3_kimi_k2.yaml", "glm46.yaml"}


@pytest.mark.parametrize("recipe", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name
                                    for name in sorted(SERVES)])
def test_recipe_fits_its_nodes_and_its_header_is_plans_output(recipe, monkeypatch):
    monkeypatch.chdir(REPO)  # the header's commands use repository-relative paths
    text = (REPO / "configs" / recipe).read_text()
    regenerated, runs = regenerate_header(text)
    assert regenerated == text, "the plan block is stale; run python tools/plan_headers.py:\n" + "\n".join(
        difflib.unified_diff(text.split("\n"), regenerated.split("\n"), lineterm="", n=0))
    table_row, page = _table_row(), SIZING_PAGE.read_text().split("\n")
    missing = [table_row(command, report) for command, report in runs if table_row(command, report) not in page]
    assert not missing, ("docs/sizing.md's plan table lacks these rows; paste them from "
                         "python tools/plan_headers.py --table:\n" + "\n".join(missing))

    recipe_cfg = load_config(REPO / "configs" / recipe)
    title = " ".join(line.lstrip("# ") for line in text.split("\n")[:3])
    count = re.search(r"(one|\d+) nodes? (?:x|of) 8 GPUs \(80 GB\)", title).group(1)
    title_nodes = 1 if count == "one" else int(count)
    assert title_nodes == SERVES[recipe][0][1]
    for release, nodes, tp_size, ep_size, storage in SERVES[recipe]:
        matching = [report for command, report in runs if command.endswith(f"release_configs/{release}")
                    or f"release_configs/{release} " in command]
        own = [r for r in matching if (r.layout.world_size, r.layout.tp_size, r.layout.ep_size) == (nodes * 8, tp_size,
                                                                                                  ep_size)
               and r.layout.micro_batch_size == recipe_cfg.recipe_args.micro_batch_size
               and r.expert_storage.format == storage]
        assert own, (recipe, release, [c for c, _ in runs])
        for report in own:
            assert report.budget_bytes == GPU_GIB * 2**30
            assert report.fits, report.reason()
    # Each header also shows a layout that does not fit, named with its largest consumer.
    assert any(not report.fits and "largest consumer" in report.reason() for _, report in runs), recipe
