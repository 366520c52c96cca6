"""Shared test fixtures: a private DS_CAPTURE_HOME, tiny targets built once, the NeMo fixtures, YAML recipes.

- ``DS_CAPTURE_HOME`` points at a session temp dir (autouse), so no test writes to ``~/.cache``.
- ``tiny_target(model_type, **overrides)`` builds a random-init checkpoint with
  ``ds_capture.demo.build_tiny_target`` once per session and argument set.
- ``nemo_fixtures`` is ``tests/fixtures/nemo_dspark_v1`` (NeMo AutoModel 0.7.0's own caches, checked in;
  ``tests/fixtures/README.md`` has the command that regenerates them).
- ``write_recipe(recipe, name=...)`` writes a YAML recipe (a dict or text) into ``tmp_path``.
- Tests marked ``slow`` (the cells of the long equality matrices beyond a representative cut) are
  deselected unless ``DS_CAPTURE_FULL=1`` (``python3 scripts/dev.py test --full`` sets it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import yaml

# Two CPU cores are shared by everything on this box: one intra-op thread per test process. `capture.cpu_threads:
# auto` sizes a run by the cores it is given: this process and its forked ranks are given one. (Also what keeps
# forks safe: a child's first multi-threaded region hangs where its parent already ran OpenMP with several threads.)
# A real launcher's ranks (a subprocess) see the host's cores; tests/distributed/test_elastic_resume.py gives its
# forked ranks the host's cores too.
torch.set_num_threads(1)
import ds_capture.parallel.cpu_threads  # noqa: E402

ds_capture.parallel.cpu_threads.host_cores = lambda: 1

# In the repository (tests/fixtures/README.md says how to regenerate them with NeMo AutoModel 0.7.0).
NEMO_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nemo_dspark_v1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect ``slow`` tests unless ``DS_CAPTURE_FULL=1``: CI runs a representative cut of each matrix."""
    if os.environ.get("DS_CAPTURE_FULL") == "1":
        return
    kept = [item for item in items if item.get_closest_marker("slow") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("slow")])
        items[:] = kept


@pytest.fixture(scope="session", autouse=True)
def ds_capture_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Demo targets and other artefacts of this session go to a temp dir, never ``~/.cache``."""
    home = tmp_path_factory.mktemp("ds_capture_home")
    previous = os.environ.get("DS_CAPTURE_HOME")
    os.environ["DS_CAPTURE_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("DS_CAPTURE_HOME", None)
    else:
        os.environ["DS_CAPTURE_HOME"] = previous


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_target("qwen3", seed=0, **config_overrides) -> checkpoint dir``, built once per argument set."""
    from ds_capture.demo import build_tiny_target

    root = tmp_path_factory.mktemp("tiny_targets")
    built: dict[tuple, Path] = {}

    def make(model_type: str = "qwen3", *, seed: int = 0, **overrides: Any) -> Path:
        key = (model_type, seed, tuple(sorted(overrides.items())))
        if key not in built:
            name = f"{model_type}-s{seed}-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
            built[key] = build_tiny_target(root / name.rstrip("-"), model_type, seed=seed, **overrides)
        return built[key]

    return make


@pytest.fixture(scope="session")
def nemo_fixtures() -> Path:
    """NeMo AutoModel 0.7.0's reference caches with their target and data (part of the repository)."""
    assert (NEMO_FIXTURES / "target").is_dir(), f"NeMo reference fixtures missing from {NEMO_FIXTURES}"
    return NEMO_FIXTURES


@pytest.fixture
def write_recipe(tmp_path: Path) -> Callable[..., Path]:
    """``write_recipe(recipe, name="recipe.yaml") -> path``: a dict is dumped as YAML, a str written as is."""

    def write(recipe: dict | str, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        text = recipe if isinstance(recipe, str) else yaml.safe_dump(recipe, sort_keys=False)
        path.write_text(text, encoding="utf-8")
        return path

    return write

