"""Quantized release checkpoints in every distributed layout equal their reference dequantisation, bit for bit.

Fixtures: ``tests/unit/quant_release.py`` (tiny release-layout checkpoints per family x scheme, ragged dims,
scales in another shard, a quantized MTP block; the reference: the same weights dequantized by independent
references, fp32, stale ``quantization_config``). Layout names as in ``test_family_layouts.py``: dp, tp, ep,
tp_x_ep, fsdp2.

- ``test_layout_loads_bit_identical`` (one launch of 2 or 4 forked ranks per cell, ``_quant_worker.py``): every rank
  builds both checkpoints with the engine's own builder; every local parameter / buffer and the hidden states and
  logits of one batch must be bitwise equal, and each rank reads its share of the quantized bytes (less than
  half the reference's bytes for every quantized tensor, identical bytes for the rest; EP ranks' expert bytes
  add up to the checkpoint's). The same launch also builds the quantized checkpoint with ``expert_storage:
  checkpoint`` (not FSDP2, which refuses it) and holds it to the same equalities. Representative cut in CI:
  deepseek_v3 FP8 at TP=2 x EP=2 and FSDP2, DeepSeek-V4 FP8 + FP4 at EP=2; the rest ``slow``.
- ``test_cli_caches_byte_identical`` (``slow``): the real CLI captures both checkpoints in the layout; the
  caches are byte-identical. ``test_cli_checkpoint_storage_cache_byte_identical`` (``slow``): the same for
  ``expert_storage: checkpoint`` against ``dequantized`` on the quantized checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launchers import REPO_ROOT  # noqa: E402
from support import safetensors_digests  # noqa: E402

from tests.distributed import _kill_helpers as kh  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "tests" / "unit"))
import quant_release as qr  # noqa: E402

WORKER = str(Path(__file__).resolve().parent / "_quant_worker.py")
LAYOUTS = {"dp": (2, 1, 1), "tp": (2, 2, 1), "ep": (2, 1, 2), "tp_x_ep": (4, 2, 2), "fsdp2": (2, 1, 1)}
FAMILY_LAYOUTS = {  # (model_type, scheme) -> the layouts the family supports
    ("deepseek_v3", "fp8"): ("dp", "tp", "ep", "tp_x_ep", "fsdp2"),
    ("deepseek_v4", "fp8_fp4"): ("dp", "ep", "fsdp2"),
    ("kimi_k25", "int4"): ("dp", "tp", "ep", "tp_x_ep", "fsdp2"),
    ("qwen3_moe", "fp8"): ("dp", "tp", "ep", "tp_x_ep", "fsdp2"),
    ("glm_moe_dsa", "fp8"): ("dp", "ep", "fsdp2"),
}
FAST = {("deepseek_v3", "fp8", "tp_x_ep"), ("deepseek_v3", "fp8", "fsdp2"), ("deepseek_v4", "fp8_fp4", "ep")}
CELLS = [pytest.param(m, s, layout, id=f"{m}-{s}-{layout}", marks=() if (m, s, layout) in FAST else (pytest.mark.slow,))
         for (m, s), layouts in FAMILY_LAYOUTS.items() for layout in layouts]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_layout_pairs")
    built: dict[tuple[str, str], tuple[Path, Path]] = {}

    def make(model_type: str, scheme: str) -> tuple[Path, Path]:
        if (model_type, scheme) not in built:
            built[model_type, scheme] = qr.build_release_pair(root / f"{model_type}-{scheme}", model_type, scheme)
        return built[model_type, scheme]

    return make


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("model_type, scheme, layout", CELLS)
def test_layout_loads_bit_identical(pairs, tmp_path, model_type, scheme, layout):
    quantized, reference = pairs(model_type, scheme)
    nproc, tp_size, ep_size = LAYOUTS[layout]
    storages = ["dequantized"] if layout == "fsdp2" else ["dequantized", "checkpoint"]  # fsdp2: refused (unit test)
    case = {"quantized": str(quantized), "reference": str(reference), "tp_size": tp_size, "ep_size": ep_size,
            "engine": "fsdp2" if layout == "fsdp2" else "deepspeed", "storages": storages}
    (tmp_path / "case.json").write_text(json.dumps(case))
    result = kh.run_script_forked(nproc, [WORKER, tmp_path / "case.json", tmp_path], timeout_s=350)
    assert result.returncode == 0, result.stdout[-6000:]
    assert not result.leftover_shm, result.leftover_shm
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    for storage in storages:
        expert_bytes = 0
        for rank in (r[storage] for r in ranks):
            assert rank["num_compared"] > 20 and not rank["tensors_differ"], (storage, rank["tensors_differ"])
            assert rank["num_outputs"] > 4 and not rank["outputs_differ"], (storage, rank["outputs_differ"])
            if storage == "dequantized":
                assert not rank["only_reference"]
            else:  # the routed experts are resident quantized: their dense parameters are gone
                assert rank["only_reference"] and all(".experts." in n for n in rank["only_reference"])
            ours, theirs = rank["bytes_by_param"]["quantized"], rank["bytes_by_param"]["reference"]
            assert sorted(ours) == sorted(theirs)
            quantized_names = [n for n in ours if ours[n] != theirs[n]]
            assert quantized_names and all(ours[n] < theirs[n] / 2 for n in quantized_names)  # FP8: ~1/4 of fp32
            assert rank["bytes_read"]["quantized"] == sum(ours.values())
            expert_bytes += sum(n for name, n in ours.items() if ".experts." in name)
        if layout in ("ep", "tp_x_ep"):  # each EP rank read its own experts: once over the EP group (x TP replicas)
            on_disk = qr.checkpoint_bytes(quantized, lambda key: ".experts." in key and not _mtp(key))
            assert expert_bytes == on_disk * (2 if layout == "tp_x_ep" else 1), storage


def _mtp(key: str) -> bool:
    return key.startswith("mtp.") or ".layers.4." in key


def _capture(target: Path, out: Path, layout: str, storage: str = "dequantized") -> Path:
    nproc, tp_size, ep_size = LAYOUTS[layout]
    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text(yaml.safe_dump({
        "engine": "fsdp2" if layout == "fsdp2" else "deepspeed",
        "distributed": {"tp_size": tp_size, "ep_size": ep_size},
        "capture": {"expert_storage": storage, "cpu_threads": 1},  # the CPU thread count is part of the bits
        "recipe_args": dict(target_model_name_or_path=str(target), train_data_path="demo:conversations",
                            train_split="train[:8]", cache_output_dir=str(out), seq_length=32, micro_batch_size=2,
                            cache_shard_size=4, cache_dtype="fp32", target_layer_ids=[-1, 0, 1, 2, 3])}))
    result = kh.run_cli_forked(nproc, recipe, timeout_s=250)
    assert result.returncode == 0, result.stdout[-6000:]
    assert not result.leftover_shm, result.leftover_shm
    return out


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_type, scheme, layout",
                         [pytest.param(m, s, layout, id=f"{m}-{s}-{layout}")
                          for (m, s), layouts in FAMILY_LAYOUTS.items() for layout in layouts])
def test_cli_caches_byte_identical(pairs, tmp_path, model_type, scheme, layout):
    quantized, reference = pairs(model_type, scheme)
    ours = safetensors_digests(_capture(quantized, tmp_path / "quantized", layout))
    theirs = safetensors_digests(_capture(reference, tmp_path / "reference", layout))
    assert ours and ours == theirs


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_type, scheme, layout", [("deepseek_v4", "fp8_fp4", "ep"), ("kimi_k25", "int4", "tp_x_ep")],
                         ids=["deepseek_v4-fp8_fp4-ep", "kimi_k25-int4-tp_x_ep"])
def test_cli_checkpoint_storage_cache_byte_identical(pairs, tmp_path, model_type, scheme, layout):
    quantized, _ = pairs(model_type, scheme)
    resident = safetensors_digests(_capture(quantized, tmp_path / "checkpoint", layout, "checkpoint"))
    assert resident and resident == safetensors_digests(_capture(quantized, tmp_path / "dequantized", layout))
