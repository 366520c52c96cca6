"""DeepSeek-V4.1's Engram tables split by row owner over every rank (ds_capture/parallel/engram_parallel.py).

(a) The row-parallel table alone on 2 and 3 real gloo ranks, each rank with ids of its own shape (and one call
    with none), equals the whole table's lookup bit for bit in fp32 and bf16 (a -0.0 and a NaN row included).
(b) The tiny V4.1 release (FP8 row-wise Engram tables) captured through the real CLI with 2 DP ranks and with
    ep_size 2 (tables split over both ranks in each) writes the single-process cache bit for bit.
(``ds-capture plan``'s count of the split tables and the sliced table reads: tests/unit/test_engram_tables.py.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("nemo_automodel")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launchers import run_cli, run_launcher  # noqa: E402

pytestmark = pytest.mark.distributed
TABLE_WORKER = str(Path(__file__).resolve().parent / "_engram_table_worker.py")
LAYER_IDS = [0, 1, 2, 5]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("nproc", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_row_parallel_table_equals_whole_table_bitwise(tmp_path, nproc):
    run = run_launcher("torchrun", nproc, [TABLE_WORKER, str(tmp_path)], None, 150)
    assert run.returncode == 0, run.stdout[-4000:]
    rows = [row for rank in range(nproc) for row in json.loads((tmp_path / f"table_rank{rank}.json").read_text())]
    assert len(rows) == 2 * nproc and all(row["equal"] and row["calls"] == 3 for row in rows), rows
    owned = sorted({tuple(row["rows"]) for row in rows})
    assert owned[0][0] == 0 and sum(count for _, count in owned) == 101  # every row owned once, padding past it


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    from ds_capture.demo import demo_tokenizer
    from tests.nemo_v41_release import write_tiny_v41_release

    return write_tiny_v41_release(tmp_path_factory.mktemp("v41") / "release", seed=0, tokenizer=demo_tokenizer())


def _capture(release: Path, out: Path, nproc: int, ep_size: int):
    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text(yaml.safe_dump({
        "distributed": {"tp_size": 1, "ep_size": ep_size}, "capture": {"compute_dtype": "fp32", "cpu_threads": 1},
        "recipe_args": dict(target_model_name_or_path=str(release), train_data_path="demo:conversations",
                            train_split="train[:8]", cache_output_dir=str(out), seq_length=32, micro_batch_size=2,
                            cache_shard_size=2, cache_dtype="fp32", target_layer_ids=LAYER_IDS)}))
    return run_cli(nproc, recipe, {"TORCHDYNAMO_DISABLE": "1"}, 300)


@pytest.fixture(scope="module")
def single_cache(release, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("v41_single") / "cache"
    result = _capture(release, out, 1, 1)
    assert result.returncode == 0, result.stdout[-4000:]
    return out


@pytest.mark.timeout(400)
# ep: slow (tests/distributed/test_nemo_family_layouts.py's V4.1 EP cell in CI runs the split tables through the CLI).
@pytest.mark.parametrize("layout, ep_size", [("dp", 1), pytest.param("ep", 2, marks=pytest.mark.slow)])
def test_v41_capture_with_split_engram_equals_single_process_bitwise(release, single_cache, tmp_path, layout,
                                                                    ep_size):
    from safetensors.torch import load_file

    out = tmp_path / "cache"
    result = _capture(release, out, 2, ep_size)
    assert result.returncode == 0, result.stdout[-6000:]
    assert json.loads((out / "manifest.json").read_text())["complete"] is True
    names = sorted(p.name for p in single_cache.glob("*.safetensors"))
    assert names == sorted(p.name for p in out.glob("*.safetensors")) and len(names) == 5  # 4 shards + weights
    for name in names:
        ours, reference = load_file(out / name), load_file(single_cache / name)
        assert ours.keys() == reference.keys(), name
        for key in reference:
            assert torch.equal(ours[key], reference[key]), (layout, name, key,
                                                            (ours[key] - reference[key]).abs().max().item())
