"""The EAGLE-3 cache from every layout equals NeMo's own single-device cache and our single process.

Layouts on the MoE fixture target (tests/fixtures/eagle3, qwen3_moe, 8 layers): DP=2, EP=2 (dp 2 x ep 2),
TP=2 x EP=2 (4 ranks; AutoTP shards the lm_head: the distribution is computed from the checkpoint's full
lm_head and the model's own sharded logits are only a check), and FSDP2 (2 ranks); full and top-k. Each
cache is compared with NeMo's recorded cache (``assert_matches_nemo``: content positions, fp32 1e-5) and
with our single-process cache (``ds-capture compare``, fp32 default tolerance). The draft vocabulary of
every layout is counted over its DP ranks, so equality with NeMo's also checks the all-reduce.

Ranks are forked gloo processes with a launcher's environment (``_kill_helpers.run_forked_ranks``); EP=2
full is the cell CI runs, the rest are ``slow`` (DS_CAPTURE_FULL=1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ds_capture.cache.registry import compare_caches, verify_cache
from tests.distributed import _kill_helpers as kh
from tests.eagle3_support import assert_matches_nemo, build_fixture_target, nemo_case_recipe, read_spec

pytestmark = [pytest.mark.distributed]

SPEC = read_spec()
LAYOUTS = {  # name -> (world size, top-level keys)
    "dp2": (2, {}),
    "ep2": (2, {"distributed": {"ep_size": 2}}),
    "tp2_ep2": (4, {"distributed": {"tp_size": 2, "ep_size": 2}}),
    "fsdp2": (2, {"engine": "fsdp2"}),
}
CASES = ("qwen3_moe_full", "qwen3_moe_topk_masked")
CELLS = [pytest.param(layout, case, marks=() if (layout, case) == ("ep2", "qwen3_moe_full") else pytest.mark.slow,
                      id=f"{layout}-{case}") for layout in LAYOUTS for case in CASES]


@pytest.fixture(scope="module")
def moe_target(tmp_path_factory) -> Path:
    import ds_capture.runner  # noqa: F401 - imported once here, so each forked rank starts at once

    kh.disable_shm_op()
    return build_fixture_target(SPEC, "qwen3_moe", tmp_path_factory.mktemp("eagle3_layouts") / "qwen3_moe")


def _run(target: Path, case: str, out: Path, world: int, extra: dict, log: Path) -> None:
    recipe = nemo_case_recipe(case, target, out)
    for key, value in extra.items():
        recipe[key] = value
    cfg = out.parent / f"{out.name}.yaml"
    cfg.write_text(yaml.safe_dump(recipe))
    result = kh.run_forked_ranks(world, cfg, log_path=log, timeout_s=240)
    assert result["codes"] == [0] * world, log.read_text()[-6000:]


@pytest.fixture(scope="module")
def single(moe_target, tmp_path_factory):
    """``single(case)``: our single-process cache of ``case`` (the reference for ``compare``), run once."""
    root = tmp_path_factory.mktemp("eagle3_single")

    def get(case: str) -> Path:
        if not (root / case).is_dir():
            _run(moe_target, case, root / case, 1, {}, root / f"{case}.log")
        return root / case

    return get


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout, case", CELLS)
def test_layout_equals_nemo_and_single_process(moe_target, single, tmp_path, layout, case):
    world, extra = LAYOUTS[layout]
    out = tmp_path / "cache"
    _run(moe_target, case, out, world, extra, tmp_path / "run.log")
    producer = json.loads((out / ".ds_capture" / "run.json").read_text())["producer"]
    distributed = extra.get("distributed", {})
    assert (producer["world_size"], producer["tp_size"], producer["ep_size"], producer["engine"]) == (
        world, distributed.get("tp_size", 1), distributed.get("ep_size", 1), extra.get("engine", "deepspeed"))
    assert verify_cache(out, checksums=True).ok
    assert_matches_nemo(out, case, moe_target)
    report = compare_caches(out, single(case), atol=None, rtol=None)
    assert report.equal, report.format()
