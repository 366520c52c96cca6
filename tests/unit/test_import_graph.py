"""The package reads top-down: stages in the order data flows, no stage importing a later one, no import circle.

Floors (DESIGN §2): errors / demo -> recipe -> data (-> regenerate) -> target -> parallel -> capture -> cache (the kind interface
and the common pieces, then one package per kind, then the registry that dispatches over kinds) -> sizing ->
session -> the drivers (runner, serve) -> cli. Every ``import`` of a ``ds_capture`` module is counted, including those inside functions: a lazy
import is still a dependency. A module may import its own stage's modules and any earlier floor's; the two
cache kinds never import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ds_capture"

# (prefix, floor): the longest matching prefix decides. Modules on one floor form one unit only when they share
# the prefix; different units on the same floor (the two kinds) may not import each other.
FLOORS = [
    ("ds_capture", 0),  # the package's __init__: __version__
    ("ds_capture.errors", 0),
    ("ds_capture.durable", 0),  # fsync of a directory: the cache writers and regenerate's journal
    ("ds_capture.demo", 1),
    ("ds_capture.demo_configs", 0.5),  # the demo's tiny configs (data), below the demo
    ("ds_capture.recipe", 2),
    ("ds_capture.data", 3),
    ("ds_capture.regenerate", 3.5),  # a driver that needs only the data stage: the server holds the target
    ("ds_capture.target", 4),
    ("ds_capture.parallel", 5),
    ("ds_capture.capture", 6),
    ("ds_capture.cache", 7),  # the package __init__ (a docstring)
    ("ds_capture.cache.kind", 7),
    ("ds_capture.cache.common", 7.5),
    ("ds_capture.cache.dspark", 8),
    ("ds_capture.cache.eagle3", 8),
    ("ds_capture.cache.registry", 9),
    ("ds_capture.cache.reader", 9.5),  # re-exports for users of the old module paths
    ("ds_capture.cache.compare", 9.5),
    ("ds_capture.sizing", 10),
    ("ds_capture.session", 10.5),  # the target session every driver shares (layout, engine, hooks, forward)
    ("ds_capture.runner", 11),  # the drivers: the offline cache and the service, siblings that never import each other
    ("ds_capture.serve", 11),
    ("ds_capture.cli", 12),
    ("ds_capture.__main__", 13),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> tuple[str, float]:
    matches = [(prefix, floor) for prefix, floor in FLOORS if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} sits on no floor: add its package to FLOORS in {__file__}"
    return max(matches, key=lambda match: len(match[0]))


def ds_capture_imports(path: Path) -> set[str]:
    """Every ds_capture module ``path`` imports (``from ds_capture.x import y`` counts ``ds_capture.x.y`` when
    that is a module, else ``ds_capture.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "ds_capture"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "ds_capture":
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in MODULES else node.module)
    return found


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
GRAPH = {name: ds_capture_imports(path) for name, path in MODULES.items()}


def later_stage_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for importer, imported in sorted(graph.items()):
        unit, floor = unit_of(importer)
        for name in sorted(imported):
            other_unit, other_floor = unit_of(name)
            if other_floor > floor or (other_floor == floor and other_unit != unit):
                bad.append(f"{importer} (floor {floor}) imports {name} (floor {other_floor})")
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_stage_imports_a_later_stage():
    assert later_stage_imports(GRAPH) == []


def test_no_import_circle():
    assert circles(GRAPH) == []


def test_nothing_below_the_recipe_sees_the_demo():
    """``demo:`` paths are resolved where the config (or ``regenerate``'s command line) is read; no later stage
    imports the demo."""
    users = sorted(name for name, imported in GRAPH.items() if "ds_capture.demo" in imported)
    assert users == ["ds_capture.cli", "ds_capture.recipe.config"]


@pytest.mark.parametrize("graph, expected", [
    ({"ds_capture.target.families": {"ds_capture.sizing.memory_model"}, "ds_capture.sizing.memory_model": set()},
     ["ds_capture.target.families (floor 4) imports ds_capture.sizing.memory_model (floor 10)"]),
    ({"ds_capture.cache.eagle3.kind": {"ds_capture.cache.dspark.kind"}, "ds_capture.cache.dspark.kind": set()},
     ["ds_capture.cache.eagle3.kind (floor 8) imports ds_capture.cache.dspark.kind (floor 8)"]),
])
def test_the_checks_catch_what_they_are_for(graph, expected):
    assert later_stage_imports(graph) == expected
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_public_entry_points_keep_their_earlier_import_paths():
    """What users import from the pre-stage layout still imports, and is the function that does the work."""
    from ds_capture.cache import compare, dspark, reader, registry
    from ds_capture.runner import run_capture

    assert callable(run_capture)
    assert (reader.read_manifest, reader.verify_cache, reader.inspect_cache, reader.format_inspect) == (
        dspark.reader.read_manifest, registry.verify_cache, registry.inspect_cache, registry.format_inspect)
    assert compare.compare_caches is registry.compare_caches
