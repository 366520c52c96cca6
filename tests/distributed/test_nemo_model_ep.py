"""Whole tiny NeMo AutoModel 0.7.0 models with their routed experts split over 2 gloo ranks (EP=2).

DeepSeek-V4.1 (with Engram at layers 1 and 3; CSA2 compressed / indexed layers; NeMo's generic MoE calling
``GroupedExperts``) and Kimi K3 (KDA layers on ds_capture.target.nemo_fla, MLA, attention residuals; eval-mode
``KimiK3MoE._forward_reference_order``), fp32 and bf16, different rows per rank: the logits and NeMo's own
DSpark capture (``HFDSparkTargetModel.generate_batch``) equal each rank's single-process forward bit for bit.
Needs the nemo extra (skipped with the reason otherwise).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launchers import run_launcher  # noqa: E402

# slow: tests/distributed/test_nemo_family_layouts.py checks EP of both whole families through the CLI in CI (the
# cache's bytes equal one process's, fp32 and bf16); this lower-level check runs with --full.
pytestmark = [pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("nemo_automodel") is None,
                                 reason="nemo_automodel (the nemo extra) is not installed")]
WORKER = str(Path(__file__).resolve().parent / "_nemo_model_ep_worker.py")
CASES = [f"{name}-{dtype}" for name in ("v41_engram", "k3_attn_res") for dtype in ("float32", "bfloat16")]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("nemo_model_ep")
    run = run_launcher("torchrun", 2, [WORKER, str(out)], {"TORCHDYNAMO_DISABLE": "1"}, 280)
    assert run.returncode == 0, run.stdout[-4000:]
    return [row for rank in (0, 1) for row in json.loads((out / f"rank{rank}.json").read_text())]


@pytest.mark.parametrize("case", CASES)
def test_nemo_model_ep_equals_one_process_bitwise(results, case):
    rows = [r for r in results if r["case"] == case]
    assert sorted(r["rank"] for r in rows) == [0, 1], rows
    for row in rows:
        assert row["local_experts"] == [2], row  # 4 routed experts per MoE layer, 2 kept per rank
        if case.startswith("k3"):
            assert row["fp32_holder_dtypes"] == ["torch.float32"], row  # NeMo keeps the KDA holders fp32
        assert row["equal"], row
