"""The DeepSpeed engine equals the single-process Hugging Face forward, per layout, with real gloo ranks.

Layouts: EP=2 and TP=2 on 2 ranks, TP=2 x EP=2 on 4 ranks (forked gloo ranks), tiny random-init Qwen3-MoE and
DeepSeek-V3 targets (sharded safetensors), different data per DP rank (EP peers in different DP groups
see different tokens). Compared: the embedding output, every decoder layer's output, the post-norm last
hidden state (hooked on the final norm), the logits, and every router's selected experts.

Tolerances:
* fp32, every layout: |diff| <= 1e-5 everywhere (measured: EP <= 1.7e-6, TP <= 3.9e-6 with values up to ~11)
  and identical routes.
* bf16, EP only: bit-identical (0.0) and identical routes: the EP layer runs the model's own expert math
  and combines in its own order and dtypes.
* bf16 with TP: not bit-identical by construction: each row-parallel layer (o_proj, down_proj) rounds its
  partial sum to bf16 on every rank before the all-reduce adds them (and rounds again), where one process
  rounds the full sum once. So every layer up to the first MoE layer must agree within 8 bf16 ulps of the
  tensor's magnitude (8 * 2**(floor(log2 max|x|) - 7); measured 2-3 ulps), as must the first MoE layer's
  output when its routes are identical, and a router may flip at most 5% of the tokens (measured: at most
  1 of 41, at near-ties that the ulp-level perturbation decides); later layers are not compared, since a
  flipped token changes its row through attention.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.distributed import _kill_helpers as kh  # noqa: E402

WORKER = str(Path(__file__).resolve().parent / "_engine_worker.py")
MODEL_TYPES = ("qwen3_moe", "deepseek_v3")


def _run(tmp_path: Path, nproc: int, cases: list[dict]) -> list[list[dict]]:
    """Run the cases on ``nproc`` forked gloo ranks; per rank, the list of case results."""
    cases_file = tmp_path / "cases.json"
    cases_file.write_text(json.dumps(cases))
    result = kh.run_script_forked(nproc, [WORKER, cases_file, tmp_path], timeout_s=170)
    assert result.returncode == 0, result.stdout[-6000:]
    assert not result.leftover_shm, result.leftover_shm
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(nproc)]


def _cases(targets: dict[str, Path], tp_size: int, ep_size: int) -> list[dict]:
    return [{"target": str(targets[model_type]), "model_type": model_type, "dtype": dtype, "tp_size": tp_size,
             "ep_size": ep_size} for model_type in MODEL_TYPES for dtype in ("fp32", "bf16")]


def _bf16_ulp(magnitude: float) -> float:
    return 2.0 ** (math.floor(math.log2(magnitude)) - 7)


def _check(result: dict) -> None:
    label = f"{result['model_type']} {result['dtype']} tp={result['tp_size']} ep={result['ep_size']} rank={result['rank']}"
    diffs = result["hidden_max_diff"]
    assert result["num_routers"] > 0, label
    if result["dtype"] == "fp32":
        assert max(diffs) <= 1e-5 and result["logits_max_diff"] <= 1e-5, (label, diffs, result["logits_max_diff"])
        assert result["routes_equal"], (label, result["routes_mismatched"])
    elif result["tp_size"] == 1:
        assert max(diffs) == 0.0 and result["logits_max_diff"] == 0.0, (label, diffs)
        assert result["routes_equal"], (label, result["routes_mismatched"])
    else:
        mismatched = result["routes_mismatched"]
        assert max(mismatched) <= 0.05 * result["num_real_tokens"], (label, mismatched)
        # hidden_states[i] is the input of layer i: compare up to the first MoE layer's input, and its
        # output too when no token's experts flipped there.
        first_moe = result["first_moe_layer"]
        for index in range(first_moe + (2 if mismatched[0] == 0 else 1)):
            tolerance = 8 * _bf16_ulp(result["hidden_max_abs"][index])
            assert diffs[index] <= tolerance, (label, index, diffs[index], tolerance)


def _targets(tiny_target) -> dict[str, Path]:
    return {model_type: tiny_target(model_type, num_hidden_layers=3) for model_type in MODEL_TYPES}


def _expert_and_attention_bytes(target: Path) -> tuple[int, int]:
    from safetensors import safe_open

    experts = attention = 0
    for file in target.glob("*.safetensors"):
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                view = handle.get_slice(key)
                num_bytes = math.prod(view.get_shape()) * {"F32": 4, "BF16": 2}[view.get_dtype()]
                experts += num_bytes if ".mlp.experts." in key else 0
                attention += num_bytes if key.endswith("self_attn.o_proj.weight") else 0
    return experts, attention


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_ep2_and_tp2_on_two_ranks_equal_single_process(tiny_target, tmp_path):
    targets = _targets(tiny_target)
    per_rank = _run(tmp_path, 2, _cases(targets, tp_size=1, ep_size=2) + _cases(targets, tp_size=2, ep_size=1))
    for results in per_rank:
        for result in results:
            _check(result)
    # EP=2: the two ranks are two DP ranks and saw different tokens; TP=2: one DP rank, the same tokens.
    ep_fp32 = [results[0] for results in per_rank]
    assert ep_fp32[0]["input_ids_sum"] != ep_fp32[1]["input_ids_sum"]

    # Loading: each rank read its share of the routed experts (EP) / of the row-parallel o_proj (TP).
    for model_type in MODEL_TYPES:
        expert_bytes, o_proj_bytes = _expert_and_attention_bytes(targets[model_type])
        for results in per_rank:
            for result in results:
                if result["model_type"] != model_type or result["dtype"] != "fp32":
                    continue
                read = result["bytes_by_param"]
                read_experts = sum(n for name, n in read.items() if ".mlp.experts." in name)
                read_o_proj = sum(n for name, n in read.items() if name.endswith("self_attn.o_proj.weight"))
                if result["ep_size"] == 2:
                    assert read_experts == expert_bytes // 2, (model_type, read_experts, expert_bytes)
                    assert read_o_proj == o_proj_bytes
                else:
                    assert read_experts == expert_bytes
                    assert read_o_proj == o_proj_bytes // 2, (model_type, read_o_proj, o_proj_bytes)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_tp2_x_ep2_on_four_ranks_equals_single_process(tiny_target, tmp_path):
    targets = _targets(tiny_target)
    per_rank = _run(tmp_path, 4, _cases(targets, tp_size=2, ep_size=2))
    for results in per_rank:
        for result in results:
            _check(result)
    # Ranks 0,1 form DP rank 0 and ranks 2,3 DP rank 1: TP peers share a batch, DP ranks differ.
    sums = [results[0]["input_ids_sum"] for results in per_rank]
    assert sums[0] == sums[1] and sums[2] == sums[3] and sums[0] != sums[2]
    for results in per_rank:
        for result in results:
            read = result["bytes_by_param"]
            expert_bytes, o_proj_bytes = _expert_and_attention_bytes(Path(result["target"]))
            assert sum(n for name, n in read.items() if ".mlp.experts." in name) == expert_bytes // 2
            assert sum(n for name, n in read.items() if name.endswith("self_attn.o_proj.weight")) == o_proj_bytes // 2
