"""The facts docs/nemo_families_notes.md records about NeMo AutoModel 0.7.0's DeepSeek-V4.1 and Kimi K3 classes,
held as tests so the integration's assumptions fail loudly if NeMo (or transformers) changes under them.

Runs tools/nemo_oracle/probe_v41_k3.py once in a subprocess (it needs ``TORCHDYNAMO_DISABLE=1`` before torch is
imported: NeMo's expert activations are ``torch.compile(fullgraph=True)``, which fails once Dynamo is disabled
later in a process) and checks its ``FACT`` lines. Needs the nemo extra; skipped with the reason otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("nemo_automodel") is None,
                                reason="nemo_automodel (the nemo extra) is not installed")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def facts() -> dict[str, list[dict]]:
    """fact name -> its values, one per run of that probe (V4.1 fp32 then bf16; K3 with, then without, attn res)."""
    result = subprocess.run([sys.executable, str(REPO / "tools" / "nemo_oracle" / "probe_v41_k3.py")],
                            capture_output=True, text=True, timeout=280,
                            env={**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-4000:]
    found: dict[str, list[dict]] = {}
    for line in result.stdout.splitlines():
        if line.startswith("FACT "):
            entry = json.loads(line[5:])
            found.setdefault(entry.pop("fact"), []).append(entry)
    assert not [name for name in found if name.endswith(".FAILED")], found
    return found


def test_v41_features_are_attn_hc_inputs_and_minus_one_is_refused(facts):
    for run in facts["v41.feature_modules"]:
        assert run["names"] == ["model.layers.0.attn_hc", "model.layers.2.attn_hc", "model.layers.5.attn_hc"]
    assert all(run["rejected"] for run in facts["v41.rejects_minus_one"])
    for name in ("v41.id0_vs_embedding", "v41.id2_vs_layer1_output_mean", "v41.id5_vs_layer4_output_mean",
                 "v41.last_vs_return_hidden_states"):
        assert [run["max_diff"] for run in facts[name]] == [0.0, 0.0], name


def test_v41_engram_layers_capture_after_their_own_update(facts):
    assert facts["v41.engram_id2_vs_layer1_output_mean"][0]["max_diff"] == 0.0  # no Engram at layer 2
    for name in ("v41.engram_id1_vs_layer0_output_mean", "v41.engram_id3_vs_layer2_output_mean"):
        assert facts[name][0]["max_diff"] > 1e-3, name


def test_v41_rows_must_be_computed_at_nemo_width(facts):
    for run in facts["v41.width_12_vs_8_first_8_tokens"]:
        assert run["last_max_diff"] > 1e-3
    # A row inside a batch vs the same row alone at the same width: only the kernels' batch-size-dependent
    # rounding (0.0 on one box, 3.7e-9 on an AVX-512 EPYC), three orders below the width effect.
    for run in facts["v41.batch_row_vs_row_alone_same_width"]:
        assert run["max_diff"] <= 1e-6 and run["last_max_diff"] <= 1e-6


def test_meta_builds_need_engram_hash_init_weights_and_nothing_else(facts):
    (v41,) = facts["v41.meta_build_load_state_dict"]
    assert v41["nonpersistent_buffers"] == [f"model.engram_hash.{n}"
                                            for n in ("multipliers", "offsets", "primes", "token_map")]
    assert v41["restored_by_init_weights"] == ["model.engram_hash"] and v41["logits_max_diff_after_restore"] == 0.0
    (k3,) = facts["k3.meta_build_load_state_dict"]
    assert k3["nonpersistent_buffers"] == [] and k3["logits_max_diff_after_restore"] == 0.0


def test_k3_features_are_layer_outputs0_and_last_id_is_final_norm(facts):
    with_res, plain = facts["k3.layer_outputs"]
    assert with_res["kinds"]["0"][0] == "tuple" and plain["kinds"]["0"][0] == "Tensor"
    assert not any(run["has_feature_provider"] for run in facts["k3.built"])
    assert [run["max_diff"] for run in facts["k3.id0_is_layer0_outputs0"]] == [0.0, 0.0]
    assert [run["max_diff"] for run in facts["k3.last_id_is_final_norm"]] == [0.0, 0.0]
    assert all(run["max_diff"] <= 1e-6 for run in facts["k3.padded_vs_row_alone_logits"])


def test_adapters_round_trip_and_k3_release_shapes(facts):
    for name in ("v41.adapter_roundtrip", "k3.adapter_roundtrip"):
        assert all(run["same_keys"] and run["max_diff"] == 0.0 for run in facts[name]), name
    shapes = facts["k3.state_dict"][0]["hf_kda_shapes"]
    assert shapes["q_conv1d.weight"] == [32, 1, 4] and shapes["A_log"] == [128] and shapes["o_norm.weight"] == [16]
