"""DeepSeek-V4.1's row-parallel Engram tables without a process group: the loader reads a table's rows alone, and
``ds-capture plan`` counts 1/world of the tables per rank.

The tiny release is ``tests.nemo_v41_release``'s (its Engram tables FP8 with row-wise 1 x 32 scales, or bf16); the
plan runs on the release's published sizes (tests/fixtures/release_configs/deepseek_v41, config.json only).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("nemo_automodel")

from ds_capture.target import quant  # noqa: E402
from ds_capture.target.nemo_release import read_release_tensor  # noqa: E402
from tests.nemo_v41_release import write_tiny_v41_release  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RELEASE_CONFIG = REPO / "tests" / "fixtures" / "release_configs" / "deepseek_v41"
TABLE = "layers.1.engram.embed.weight"


@pytest.mark.parametrize("quantized", [True, False], ids=["fp8_rowwise", "bf16"])
def test_table_rows_read_alone_equal_the_whole_tables_rows(tmp_path, quantized):
    release = write_tiny_v41_release(tmp_path / "release", seed=0, quantized=quantized)
    weight_map = json.loads((release / "model.safetensors.index.json").read_text())["weight_map"]
    files = {key: release / name for key, name in weight_map.items()}
    headers = quant.read_headers(set(files.values()))
    logical, _parts = quant.logical_keys(files, headers)
    planned = quant.plan_quantized(files, headers, quant.load_quant_config(release), [TABLE])
    assert (TABLE in planned) == quantized and (not quantized or planned[TABLE].block == (1, 32))
    whole, whole_bytes = read_release_tensor(TABLE, logical, planned, torch.bfloat16)
    for start, count in ((0, 86), (86, 86), (172, 84), (255, 1)):  # 256 rows over 3 owners, and a last row
        rows, num_bytes = read_release_tensor(TABLE, logical, planned, torch.bfloat16, rows=(start, count))
        assert rows.dtype == whole.dtype and torch.equal(rows, whole[start:start + count]), (start, count)
        assert num_bytes * whole.shape[0] == whole_bytes * count  # only those rows (and their scales) were read


def _plan_params(world_size: int) -> dict[str, float]:
    """The worst rank's parameter GiB by kind under ``ds-capture plan`` at world = ep = ``world_size``."""
    from ds_capture.recipe.config import parse_config
    from ds_capture.sizing.command import plan_capture

    cfg = parse_config({
        "distributed": {"tp_size": 1, "ep_size": world_size}, "capture": {"compute_dtype": "bf16"},
        "recipe_args": dict(target_model_name_or_path=str(RELEASE_CONFIG), train_data_path="demo:conversations",
                            cache_output_dir="unused", seq_length=4096, micro_batch_size=1, cache_shard_size=8,
                            target_layer_ids=[1, 13, 26, 39])}, source="plan.yaml", base_dir=REPO)
    report = plan_capture(cfg, world_size=world_size, compute_dtype="bf16", suggest=False, count_dataset=False)
    worst = max(report.ranks, key=lambda rank: rank.peak_bytes)
    return {kind: value / 2**30 for kind, value in worst.param_bytes_by_kind.items()}


@pytest.mark.timeout(300)
def test_plan_counts_one_world_of_the_engram_tables_per_rank():
    # Two [384,006,168, 256] bf16 tables (~183 GiB each) that every rank held whole (367 GiB of "other" at any
    # world): now ceil(rows / world) rows each, the rest of "other" (norms, routers, hyper-connections) under 1 GiB.
    for world_size in (8, 16, 32):
        table_gib = 2 * -(-384_006_168 // world_size) * 256 * 2 / 2**30
        params = _plan_params(world_size)
        print(f"world {world_size}, ep {world_size}:", {kind: round(gib, 1) for kind, gib in params.items()},
              f"total {sum(params.values()):.1f} GiB")
        assert table_gib < params["other"] < table_gib + 1.0, (world_size, params)


def test_the_engram_model_is_built_once_per_config_and_handed_out_as_copies(tmp_path):
    """V4.1's build spends ~1 s on Engram's tokenizer map, so ``plan`` (many layouts of one target) builds it once per
    config and hands out copies: each caller gets a model of its own, and a changed config.json is built anew."""
    from ds_capture.target import nemo_models
    from ds_capture.target.families import read_target_info
    from ds_capture.target.loading import build_meta_model

    release = tmp_path / "deepseek_v41"
    release.mkdir()
    (release / "config.json").write_bytes((RELEASE_CONFIG / "config.json").read_bytes())
    target = read_target_info(release)
    first = build_meta_model(target, dtype=torch.bfloat16, attn_implementation=None)
    second = build_meta_model(target, dtype=torch.bfloat16, attn_implementation=None)
    assert first is not second and len(nemo_models._BUILT_ONCE) == 1
    assert [(k, v.shape, v.dtype) for k, v in first.state_dict().items()] == [
        (k, v.shape, v.dtype) for k, v in second.state_dict().items()]
    del first.model.layers["1"]  # a caller shards or trims its copy in place: the next caller's is whole
    third = build_meta_model(target, dtype=torch.bfloat16, attn_implementation=None)
    assert len(first.model.layers) == 39 and len(third.model.layers) == len(second.model.layers) == 40

    config = json.loads((release / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = 41
    (release / "config.json").write_text(json.dumps(config))
    rebuilt = build_meta_model(read_target_info(release), dtype=torch.bfloat16, attn_implementation=None)
    assert len(rebuilt.model.layers) == 41
