"""Expert parallelism for NeMo's GroupedExperts (ds_capture/parallel/grouped_experts.py) on 2 real gloo ranks.

Each rank has its own tokens (41 and 29, 15% masked out); the split module (4 experts per rank, all-to-all
dispatch) must equal that rank's unsplit single-process forward bit for bit, in fp32 and bf16, for NeMo's
combine variants: router weight inside the activation (DeepSeek-V4.1 style, with its clamped SwiGLU) and after
the down projection (Kimi K3's config), with expert biases, and with a routing skew that leaves one rank with no
rows to compute; and Kimi K3's eval-mode MoE path (``KimiK3MoE._forward_reference_order``, which bypasses
``experts.forward``), with NeMo installed also its whole MoE block (router, latent projections, shared expert).
With nemo_automodel installed the worker uses NeMo's own class (under TORCHDYNAMO_DISABLE=1,
as the model runs on CPU); without it, the faithful copy in _grouped_experts_reference.py (so CI runs it too).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launchers import run_launcher  # noqa: E402

# slow: the CLI-level EP cells of tests/distributed/test_nemo_family_layouts.py (bytes equal to one process, fp32
# and bf16) run this layer in CI; its own cases (every GroupedExperts option) run with --full.
pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = str(Path(__file__).resolve().parent / "_grouped_experts_worker.py")
CASES = [
    {"name": f"{dtype}-{variant}", "dtype": dtype, **options}
    for dtype in ("float32", "bfloat16")
    for variant, options in {
        "weight_in_activation": {"after_down": False, "swiglu_limit": 0.0, "expert_bias": False, "skew": False},
        "v41_clamped_swiglu": {"after_down": False, "swiglu_limit": 10.0, "expert_bias": False, "skew": False},
        "k3_after_down": {"after_down": True, "swiglu_limit": 0.0, "expert_bias": False, "skew": False},
        "bias": {"after_down": False, "swiglu_limit": 0.0, "expert_bias": True, "skew": False},
        "bias_after_down": {"after_down": True, "swiglu_limit": 0.0, "expert_bias": True, "skew": False},
        "skew_empty_rank": {"after_down": False, "swiglu_limit": 0.0, "expert_bias": False, "skew": True},
    }.items()
] + [
    {"name": f"{dtype}-k3_reference_order{'-skew' if skew else ''}", "dtype": dtype, "k3_block": True, "skew": skew}
    for dtype in ("float32", "bfloat16") for skew in (False, True)
]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("grouped_experts")
    (root / "cases.json").write_text(json.dumps(CASES))
    run = run_launcher("torchrun", 2, [WORKER, str(root / "cases.json"), str(root)], {"TORCHDYNAMO_DISABLE": "1"}, 240)
    assert run.returncode == 0, run.stdout[-4000:]
    return [row for rank in (0, 1) for row in json.loads((root / f"rank{rank}.json").read_text())]


@pytest.mark.parametrize("case", [case["name"] for case in CASES])
def test_grouped_experts_ep_equals_one_process_bitwise(results, case):
    rows = [r for r in results if r["case"] == case]
    assert sorted(r["rank"] for r in rows) == [0, 1], rows
    expected = "nemo" if importlib.util.find_spec("nemo_automodel") else "copy"
    for row in rows:
        assert row["source"] == expected and row["local_experts"] == 4
        assert row["equal"], row
