"""The README and the pages under docs/ say what the code and the tools say.

Every page is linked from the README and links back; every relative link and anchor resolves; every repository
path or ``ds_capture.`` dotted name the pages give in backticks exists; docs/layout.md's tree lists exactly the
modules of ``ds_capture/``; docs/support.md's table is ``tools/support_matrix.py``'s output; docs/sizing.md's
plan table has one row per plan run in the recipes' blocks (their content: tests/unit/test_plan_recipes.py)
and its text example is what ``ds-capture plan`` prints.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from pathlib import Path

import pytest

from ds_capture.cli import main
from ds_capture.sizing.report import BLOCK_END, BLOCK_START, COMMAND_PREFIX

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
ALL = [README, *PAGES]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A repository path or a dotted name in backticks: `ds_capture/cache/kind.py`, `benchmarks/soak.py --cycles 3`.
REPO_PATH = re.compile(r"`((?:ds_capture|tests|benchmarks|tools|configs|launch|ds_configs|scripts|docs)/[^`\s]*)")
DOTTED = re.compile(r"`(ds_capture(?:\.\w+)+)`")


def _tool(name: str):
    """A script under tools/ as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in text.split("\n") if line.startswith("#")}


def _code_block(text: str, first_line: str) -> str:
    start = text.index("```\n" + first_line) + 4
    return text[start:text.index("```", start)]


def test_every_page_is_linked_from_the_readme_and_links_back():
    assert PAGES
    linked = set(LINK.findall(README.read_text()))
    assert not [p.name for p in PAGES if f"docs/{p.name}" not in linked], "pages the README does not link"
    assert not [p.name for p in PAGES if "](../README.md)" not in p.read_text()], "pages without a link back"


@pytest.mark.parametrize("page", ALL, ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and anchor not in _anchors(file)):
            broken.append(target)
    assert not broken, f"{page.name}: links that do not resolve: {broken}"


@pytest.mark.parametrize("page", ALL, ids=lambda p: p.name)
def test_named_paths_and_dotted_names_exist(page):
    text = page.read_text()
    missing = [p for p in REPO_PATH.findall(text) if not (REPO / p.rstrip(".,:;")).exists()]
    for dotted in DOTTED.findall(text):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        if obj is None:
            missing.append(dotted)
    assert not missing, f"{page.name} names what does not exist (moved?): {missing}"


def test_layout_tree_lists_every_module_of_the_package():
    """docs/layout.md: one line per package and module of ds_capture/, nested by two-space indents."""
    block = _code_block((DOCS / "layout.md").read_text(), "ds_capture/\n")
    listed, stack = set(), []
    for line in block.split("\n"):
        if not line.strip():
            continue
        depth, name = (len(line) - len(line.lstrip())) // 2, line.split()[0]
        if depth == 0 and name != "ds_capture/":
            break  # the rest of the tree: tests/, benchmarks/, ...
        stack[depth:] = [name]
        listed.add("".join(stack).rstrip("/"))
    package = REPO / "ds_capture"
    real = {"ds_capture"} | {str(p.relative_to(REPO)) for p in package.rglob("*.py")} | {
        str(p.parent.relative_to(REPO)) for p in package.rglob("__init__.py")}
    real -= {str(p.relative_to(REPO)) for p in package.rglob("__init__.py") if p.parent != package}
    assert listed == real, (f"in docs/layout.md, not in ds_capture/: {sorted(listed - real)}; "
                            f"in ds_capture/, not in docs/layout.md: {sorted(real - listed)}")


def test_support_table_is_the_generators_output():
    support_matrix = _tool("support_matrix")
    results = json.loads((REPO / "benchmarks" / "results" / "support_matrix.json").read_text())
    table = support_matrix.render(results)
    assert table in (DOCS / "support.md").read_text(), (
        "docs/support.md's support table differs from python tools/support_matrix.py; paste its output:\n" + table)


def test_plan_table_has_one_row_per_recipe_plan_run():
    commands = []
    for recipe in sorted((REPO / "configs").glob("*.yaml")):
        lines = recipe.read_text().split("\n")
        if BLOCK_START in lines:
            block = lines[lines.index(BLOCK_START):lines.index(BLOCK_END)]
            commands += [line for line in block if line.startswith(COMMAND_PREFIX)]
    text = (DOCS / "sizing.md").read_text()
    rows = [line for line in text.split("\n")
            if re.match(r"\| \w+ \| (?:engine fsdp2, |engine deepspeed ZeRO-3, )?world \d+", line)]
    assert commands and len(rows) == len(commands), (
        f"docs/sizing.md's plan table has {len(rows)} rows for {len(commands)} plan runs in configs/ "
        "(python tools/plan_headers.py --table prints them)")


def test_plan_text_example_is_plans_output(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    text = (DOCS / "sizing.md").read_text()
    command = re.search(r"\(`(ds-capture plan -c configs/glm5\.yaml [^`]*)`\)", text).group(1)
    main(command.split()[1:])
    assert _code_block(text, "ds-capture plan configs/glm5.yaml") == capsys.readouterr().out


_DRAFTERS = {"DSpark": "train_dspark", "EAGLE-3": "train_eagle3", "DFlash": "train_dflash"}


def test_the_readme_says_which_nemo_trainers_read_the_cache():
    """The first paragraph names a drafter as served only where NeMo 0.7.0's trainer for it reads a cache
    (``recipe_args.cached_target_path``); one whose trainer does not is said to read none."""
    spec = importlib.util.find_spec("nemo_automodel")
    if spec is None:
        pytest.skip("nemo_automodel is not installed (the nemo extra): its trainers are the contract")
    recipes = Path(spec.origin).parent / "recipes" / "llm"
    first = README.read_text().split("\n\n")[1]
    served = re.search(r"drafter \(([^)]*)\) learns from", first).group(1).split(", ")
    for drafter, recipe in _DRAFTERS.items():
        reads_cache = "cached_target_path" in (recipes / f"{recipe}.py").read_text()
        assert (drafter in served) == reads_cache, (drafter, recipe, reads_cache)
        if not reads_cache:
            assert f"`{recipe}`" in first and "no DFlash trainer reads a cache" in first
