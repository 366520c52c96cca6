"""Chunked prefill under sharded layouts: ranks whose rows take different numbers of chunks stay in lockstep.

Data: 4 rows, shards of 2, micro-batch 1: DP rank 0's shard holds two rows of ~2,048 tokens (8 chunks of 256
each), DP rank 1's two short rows (one forward each), so every step the ranks agree on the most forwards any of
them needs and the short rank forwards fillers (a rank that skipped one would hang the expert all-to-all or
FSDP2's gathers). Target: tiny Qwen3-MoE (2 layers), fp32. Each layout's chunked cache (``chunked_prefill: 256``)
must equal the single process's whole-row cache: ids and masks exactly, states within 1e-5 of the tensor's
maximum (``support.max_rel_diff``); and it must finish within its timeout.
CI: EP 2 (DeepSpeed engine), for both cache kinds (EAGLE-3: a 3-layer Qwen3-MoE, its aux states, target_probs and
masks against one process's whole-row EAGLE-3 cache; measured 3.2e-7, ~5 s); with ``--full``: FSDP2 on 2 ranks,
TP 2, and Kimi K3 and DeepSeek-V4.1 (NeMo's classes, the tiny releases, their state carried by
:mod:`ds_capture.target.nemo_kda_mla_chunks` and :mod:`ds_capture.target.nemo_v41_chunks`) on EP 2 with the
DeepSpeed engine, FSDP2 and ZeRO-3 (measured: worst 2.6e-7 for K3, 1.8e-7 for V4.1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launchers import ensure_shm_op_built  # noqa: E402
from support import max_rel_diff  # noqa: E402

from tests.distributed import _kill_helpers as kh  # noqa: E402

pytestmark = [pytest.mark.distributed]
LAYOUTS = {  # name -> (engine, distributed section)
    "ep2": ("deepspeed", {"ep_size": 2}),
    "fsdp2": ("fsdp2", {}),
    "tp2": ("deepspeed", {"tp_size": 2}),
}


def _data(path: Path) -> Path:
    from ds_capture.demo import demo_data_path

    rows = [json.loads(line) for line in demo_data_path().read_text().splitlines()]
    long = [{"messages": [m for row in rows[i * 60:(i + 1) * 60] for m in row["messages"]
                          if m["role"] in ("user", "assistant")]} for i in range(2)]
    path.write_text("\n".join(json.dumps(row) for row in long + rows[200:202]) + "\n")
    return path


def _recipe(path: Path, target: Path, data: Path, out: Path, chunked_prefill, engine: str = "deepspeed",
            distributed: dict | None = None) -> Path:
    path.write_text(yaml.safe_dump({
        "engine": engine,
        "recipe_args": {"target_model_name_or_path": str(target), "train_data_path": str(data),
                        "cache_output_dir": str(out), "seq_length": 2048, "micro_batch_size": 1,
                        "cache_shard_size": 2, "cache_dtype": "fp32"},
        "capture": {"chunked_prefill": chunked_prefill},
        "distributed": distributed or {},
        "dist_env": {"timeout_minutes": 2},
    }))
    return path


@pytest.fixture(scope="module")
def whole_row_cache(tiny_target, tmp_path_factory) -> tuple[Path, Path, Path]:
    from ds_capture.recipe.config import load_config
    from ds_capture.runner import run_capture

    ensure_shm_op_built()
    root = tmp_path_factory.mktemp("chunked_layouts")
    target, data = tiny_target("qwen3_moe", num_hidden_layers=2), _data(root / "rows.jsonl")
    run_capture(load_config(str(_recipe(root / "single.yaml", target, data, root / "single", "off"))),
                show_progress=False)
    return target, data, root / "single"


@pytest.mark.parametrize("layout", [pytest.param(name, marks=() if name == "ep2" else pytest.mark.slow)
                                    for name in LAYOUTS])
def test_chunked_cache_on_two_ranks_equals_the_whole_row_single_process(whole_row_cache, tmp_path, layout):
    target, data, single = whole_row_cache
    engine, distributed = LAYOUTS[layout]
    out = tmp_path / "cache"
    result = kh.run_cli_forked(2, _recipe(tmp_path / "r.yaml", target, data, out, 256, engine, distributed),
                               timeout_s=240)
    assert result.returncode == 0, result.stdout[-6000:]
    assert not result.leftover_shm, result.leftover_shm
    assert max_rel_diff(single, out) <= 1e-5


def _eagle3_recipe(path: Path, target: Path, data: Path, out: Path, chunked_prefill, engine: str = "deepspeed",
                   distributed: dict | None = None) -> Path:
    _recipe(path, target, data, out, chunked_prefill, engine, distributed)
    raw = yaml.safe_load(path.read_text())
    raw["recipe_args"].update(aux_layer_ids=[0, 1, 2], draft_vocab_size=256)
    path.write_text(yaml.safe_dump({**raw, "cache_kind": "eagle3"}))
    return path


def test_eagle3_chunked_on_ep2_equals_the_whole_row_single_process(whole_row_cache, tiny_target, tmp_path):
    """The EAGLE-3 kind on EP 2 in chunks of 256 (the long rows' rank 8 chunks a row, the short rows' rank fillers):
    aux states, target_probs (the draft vocabulary counted over both ranks) and masks equal one process's whole
    rows (integers exactly, floats within 1e-5 of the row maximum). The target has 3 layers: EAGLE-3 takes 3."""
    from ds_capture.recipe.config import load_config
    from ds_capture.runner import run_capture
    from tests.eagle3_support import load_cache
    from tests.unit.test_chunked_prefill import assert_equal_caches

    _, data, _ = whole_row_cache
    target, single = tiny_target("qwen3_moe", num_hidden_layers=3), tmp_path / "single"
    run_capture(load_config(str(_eagle3_recipe(tmp_path / "single.yaml", target, data, single, "off"))),
                show_progress=False)
    out = tmp_path / "cache"
    recipe = _eagle3_recipe(tmp_path / "r.yaml", target, data, out, 256, *LAYOUTS["ep2"])
    result = kh.run_cli_forked(2, recipe, timeout_s=240)
    assert result.returncode == 0, result.stdout[-6000:]
    assert not result.leftover_shm, result.leftover_shm
    assert_equal_caches(load_cache(out), load_cache(single), "eagle3 ep2 chunk 256", "qwen3_moe")


NEMO_LAYOUTS = {  # name -> (engine, distributed section, extra recipe keys)
    "ep2": ("deepspeed", {"ep_size": 2}, {}),
    "fsdp2-ep2": ("fsdp2", {"ep_size": 2}, {}),
    "zero3-ep2": ("deepspeed", {"ep_size": 2}, {"deepspeed_config": {"zero_optimization": {"stage": 3}}}),
}
NEMO_LAYER_IDS = {"kimi_k3": [-1, 0, 1, 3], "deepseek_v41": [0, 2, 3, 5]}


@pytest.fixture(scope="module")
def nemo_whole_rows(tmp_path_factory):
    """family -> (its tiny release, the rows, one process's whole-row cache of them (fp32)), built once each."""
    pytest.importorskip("nemo_automodel")
    from ds_capture.demo import demo_tokenizer
    from ds_capture.recipe.config import load_config
    from ds_capture.runner import run_capture
    from tests import nemo_k3_release, nemo_v41_release

    ensure_shm_op_built()
    writers = {"kimi_k3": nemo_k3_release.write_tiny_k3_release,
               "deepseek_v41": nemo_v41_release.write_tiny_v41_release}
    built: dict[str, tuple[Path, Path, Path]] = {}

    def whole_rows(family: str) -> tuple[Path, Path, Path]:
        if family not in built:
            root = tmp_path_factory.mktemp(f"{family}_chunked_layouts")
            release = writers[family](root / family, seed=0, tokenizer=demo_tokenizer())
            data = _data(root / "rows.jsonl")
            run_capture(load_config(str(_nemo_recipe(root / "single.yaml", family, release, data, root / "single",
                                                     "off"))), show_progress=False)
            built[family] = release, data, root / "single"
        return built[family]

    return whole_rows


def _nemo_recipe(path: Path, family: str, release: Path, data: Path, out: Path, chunked_prefill,
                 engine: str = "deepspeed", distributed: dict | None = None, extra: dict | None = None) -> Path:
    _recipe(path, release, data, out, chunked_prefill, engine, distributed)
    raw = yaml.safe_load(path.read_text())
    raw["capture"]["compute_dtype"] = "fp32"
    raw["recipe_args"]["target_layer_ids"] = NEMO_LAYER_IDS[family]
    path.write_text(yaml.safe_dump({**raw, **(extra or {})}))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("family", list(NEMO_LAYER_IDS))
@pytest.mark.parametrize("layout", list(NEMO_LAYOUTS))
def test_nemo_family_chunked_on_two_ranks_equals_the_whole_row_single_process(nemo_whole_rows, tmp_path, family,
                                                                              layout):
    """Kimi K3 and DeepSeek-V4.1 (NeMo's classes; their state carried by ds_capture's carriers) on 2 ranks with
    their experts expert-parallel (V4.1's Engram tables split by rows), chunks of 256 (the long rows' rank forwards
    8 chunks a row, the short rows' rank fillers): equal to one process's whole-row cache (fp32, within 1e-5)."""
    release, data, single = nemo_whole_rows(family)
    engine, distributed, extra = NEMO_LAYOUTS[layout]
    out = tmp_path / "cache"
    recipe = _nemo_recipe(tmp_path / "r.yaml", family, release, data, out, 256, engine, distributed, extra)
    result = kh.run_cli_forked(2, recipe, timeout_s=300)
    assert result.returncode == 0, result.stdout[-6000:]
    assert not result.leftover_shm, result.leftover_shm
    worst = max_rel_diff(single, out)
    print(f"[chunked prefill] {family} {layout} chunk 256: worst {worst:.2e}")
    assert worst <= 1e-5
