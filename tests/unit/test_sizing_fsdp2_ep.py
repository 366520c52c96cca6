"""``ds-capture plan`` for FSDP2's expert-parallel layout (``engine: fsdp2``, ``distributed.ep_size`` = the world; NeMo's
families): every rank's figure is the packed routed experts / world + the FSDP2-sharded rest + the gathered root and
two decoder layers + the dequantization scratch, and ``run`` refuses what plan says does not fit, on the same path.

Counted on the release-size Kimi K3 (tests/fixtures/release_configs/kimi_k3, meta only, no weights).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_capture.errors import CaptureError
from ds_capture.recipe.config import load_config
from ds_capture.sizing import memory_model as mm
from ds_capture.sizing.command import plan_capture, refuse_if_not_fitting

pytest.importorskip("nemo_automodel")

REPO = Path(__file__).resolve().parents[2]
K3 = "recipe_args.target_model_name_or_path=tests/fixtures/release_configs/kimi_k3"


def _cfg(monkeypatch, *overrides: str):
    monkeypatch.chdir(REPO)
    return load_config(REPO / "configs" / "kimi_k3.yaml", [K3, *overrides])


def test_every_term_is_counted(monkeypatch):
    cfg = _cfg(monkeypatch)
    report = plan_capture(cfg, world_size=32, gpu_memory_gib=79.6, suggest=False, count_dataset=False)
    whole = plan_capture(_cfg(monkeypatch, "engine=deepspeed", "distributed.ep_size=1", "capture.expert_storage=dequantized"),
                         world_size=1, gpu_memory_gib=1e6, suggest=False, count_dataset=False).ranks[0]
    rank = report.ranks[0]
    # Routed experts: the release's packed bytes (0.5 + 1/32 per parameter) of E/world experts.
    experts_bf16 = whole.param_bytes_by_kind["routed experts"]
    assert rank.param_bytes_by_kind["routed experts"] == pytest.approx(experts_bf16 / 2 * (0.5 + 1 / 32) / 32)
    # The rest: FSDP2's dim-0 chunks (ceil(rows / world): at least 1/world, at most a few rows more).
    rest, rest_whole = rank.param_bytes - rank.param_bytes_by_kind["routed experts"], whole.param_bytes - experts_bf16
    assert rest_whole / 32 <= rest <= rest_whole / 32 * 1.05
    # Transients: the root and two decoder layers gathered, one layer's local experts dequantized (bf16).
    assert 0 < rank.fsdp2_gather_bytes < rest_whole / 10
    assert "dequantized" in report.activation_largest.note
    assert rank.peak_bytes == pytest.approx(rank.param_bytes + rank.activation_bytes + rank.capture_bytes
                                            + rank.fsdp2_gather_bytes + rank.reserve_bytes + rank.writer_device_bytes)
    assert report.fits and rank.peak_bytes < 79.6 * mm.GIB


def test_run_refuses_what_plan_says_does_not_fit(monkeypatch):
    import torch

    refuse_if_not_fitting(_cfg(monkeypatch, "capture.gpu_memory_gib=79.6"), world_size=32,
                          compute_dtype=torch.bfloat16)
    with pytest.raises(CaptureError, match="does NOT fit; largest consumer: routed experts"):
        refuse_if_not_fitting(_cfg(monkeypatch, "capture.gpu_memory_gib=79.6", "distributed.ep_size=16"),
                              world_size=16, compute_dtype=torch.bfloat16)


def test_ep_other_than_the_world_is_refused(monkeypatch):
    with pytest.raises(CaptureError, match="distributed.ep_size = the world size"):
        plan_capture(_cfg(monkeypatch, "distributed.ep_size=16"), world_size=32, gpu_memory_gib=79.6,
                     suggest=False, count_dataset=False)
