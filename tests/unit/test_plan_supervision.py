"""ds-capture plan knows the cache kind and the driver: EAGLE-3's aux layers, the supervising rank's whole lm_head
and its logits chunk, and ``serve`` sized as itself (``plan --serve --max-batch-rows``), as the session sizes it.

The figures are typed here from the modules' own chunk rules (draft_distribution: 64 MiB of fp32-sized logits per
chunk of positions; serve: 256 MiB per chunk of whole rows, at least one) and the published DeepSeek-V3 config
(V = 129280, H = 7168, 61 layers), not read back from the sizing code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_sizing_estimate import LiveBytes  # tests/unit is on sys.path (pytest's rootdir-relative import)

from ds_capture.cli import main
from ds_capture.errors import CaptureError
from ds_capture.parallel.dist import DistEnv
from ds_capture.recipe.config import load_config, parse_config
from ds_capture.session import plan_session
from ds_capture.sizing.command import plan_capture
from ds_capture.sizing.supervision import Supervision

REPO = Path(__file__).resolve().parents[2]
V3 = REPO / "tests" / "fixtures" / "release_configs" / "deepseek_v3"
V, H, S, B = 129280, 7168, 4096, 4  # DeepSeek-V3's vocabulary and hidden size; the recipe's S and micro-batch
BF16 = 2


def _cfg(**recipe) -> object:
    raw = _raw_dspark()
    raw = {**raw, "cache_kind": "eagle3", "recipe_args": {**raw["recipe_args"], **recipe}}
    return parse_config(raw, source="<test>", base_dir=REPO)


def test_plan_of_an_eagle3_run_counts_aux_layers_lm_head_and_logits_chunk():
    report = plan_capture(_cfg(), world_size=16, gpu_memory_gib=1000, suggest=False, count_dataset=False)
    assert report.layer_ids == [1, 29, 57]  # NeMo's aux layers [1, L//2 - 1, L - 4], not DSpark's target layers
    lm_head = V * H * BF16
    positions = (64 * 2**20) // (V * 4)  # chunk_positions(V): 129 positions
    # The chunk's logits (bf16) + the selected columns (bf16) with their fp32 copy, then its fp32 softmax (draft
    # vocabulary = the whole one: no draft_vocab_size), and the content positions' final states gathered for it.
    logits = positions * (V * BF16 + V * 8) + B * S * H * BF16
    assert (lm_head, logits) == (1_853_358_080, 401_652_224)
    assert report.to_dict()["supervision"] == {"driver": "run", "draft_vocab_size": V, "logits_positions": positions,
                                               "lm_head_bytes": lm_head, "logits_bytes": logits}
    writers = [r for r in report.ranks if r.tp_rank == 0]
    assert len(writers) == 2 and all(r.supervision_bytes == lm_head + logits for r in writers)
    assert all(r.supervision_bytes == 0 for r in report.ranks if r.tp_rank != 0)
    # Captures: the 3 aux layers held (EAGLE-3 hooks layer outputs, never the final norm's), the aux states and the
    # final state collected in the compute dtype.
    assert report.ranks[0].capture_bytes == (3 + 4) * B * S * H * BF16
    # The cache as EAGLE-3 v2 stores a row: ids and two masks (int64), the aux states, position_mask, target_probs
    # over the draft vocabulary (here the whole one), in bf16; beside target_embeddings in fp32.
    assert report.cache["bytes_per_sample"] == S * (3 * 8 + 3 * H * BF16 + 1 + V * BF16)
    assert report.cache["target_weights_bytes"] == V * H * 4
    # A draft vocabulary shrinks the softmax's columns, not the logits.
    small = plan_capture(_cfg(draft_vocab_size=32000), world_size=16, gpu_memory_gib=1000, suggest=False,
                         count_dataset=False).to_dict()["supervision"]
    assert small["logits_bytes"] == positions * (V * BF16 + 32000 * 8) + B * S * H * BF16
    # DSpark supervises nothing.
    dspark = plan_capture(parse_config(_raw_dspark(), source="<test>", base_dir=REPO), world_size=16,
                          gpu_memory_gib=79.6, suggest=False, count_dataset=False)
    assert dspark.to_dict()["supervision"] is None and all(r.supervision_bytes == 0 for r in dspark.ranks)


def _raw_dspark() -> dict:
    return {"engine": "deepspeed", "distributed": {"tp_size": 8, "ep_size": 16},
            "capture": {"expert_storage": "checkpoint"},
            "recipe_args": {"target_model_name_or_path": str(V3), "train_data_path": "/nonexistent/train.jsonl",
                            "cache_output_dir": "/nonexistent/out", "seq_length": S, "micro_batch_size": B}}


def test_plan_serve_sizes_max_batch_rows_and_the_listeners_supervision(tmp_path, capsys):
    recipe = tmp_path / "eagle3.yaml"
    recipe.write_text(json.dumps(_raw_dspark() | {"cache_kind": "eagle3"}))
    argv = ["plan", "-c", str(recipe), "--world-size", "16", "--gpu-memory-gib", "1000", "--json", "--serve",
            "--max-batch-rows", "2"]
    assert main(argv) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["driver"] == "serve" and planned["layout"]["micro_batch_size"] == 2
    assert planned["cache"] is None  # serve writes no cache
    # One row's [S, V] logits per chunk (S x V x 4 > 256 MiB): the logits and their shifted copy, then the shifted
    # logits beside their fp32 copy and its softmax over the whole vocabulary (the client's draft vocabulary).
    logits = S * V * (BF16 + 8)
    assert logits == 5_295_308_800
    assert planned["supervision"] == {"driver": "serve", "draft_vocab_size": V, "logits_positions": S,
                                      "lm_head_bytes": V * H * BF16, "logits_bytes": logits}
    listener, other = planned["per_rank"][0], planned["per_rank"][1]
    assert listener["supervision_bytes"] == V * H * BF16 + logits and other["supervision_bytes"] == 0
    assert listener["capture_bytes"] == (3 + 4) * 2 * S * H * BF16  # --max-batch-rows rows, not micro_batch_size
    # The answer on the listener's host: aux states (bf16), fp32 target_probs over V, mask, shifted ids and mask.
    assert listener["writer_host_bytes"] == 2 * S * (3 * H * BF16 + 4 * V + 1 + 16)
    # --max-batch-rows sizes serve only; serve answers EAGLE-3 only.
    assert main(["plan", "-c", str(recipe), "--max-batch-rows", "2"]) == 2
    assert "add --serve" in capsys.readouterr().err
    recipe.write_text(json.dumps(_raw_dspark()))
    assert main(["plan", "-c", str(recipe), "--world-size", "16", "--serve"]) == 2
    assert "set `cache_kind: eagle3`" in capsys.readouterr().err


def test_serve_is_refused_with_plan_serves_verdict(write_recipe, tmp_path):
    """The session sizes serve as plan --serve does: one SessionPlan, the same verdict, before anything loads."""
    recipe = write_recipe({"cache_kind": "eagle3",
                           "recipe_args": {"target_model_name_or_path": "demo:qwen3_moe_tiny",
                                           "train_data_path": "demo:conversations", "aux_layer_ids": [1, 2, 3],
                                           "cache_output_dir": str(tmp_path / "cache"), "seq_length": 512},
                           "capture": {"compute_dtype": "fp32", "chunked_prefill": "off"}})
    peak = {rows: plan_capture(load_config(recipe), world_size=1, gpu_memory_gib=1e3, count_dataset=False,
                               serve_rows=rows).worst.peak_bytes for rows in (1, 64)}
    budget = (peak[1] + peak[64]) / 2 / 2**30  # one row fits, --max-batch-rows 64 does not
    cfg = load_config(recipe, [f"capture.gpu_memory_gib={budget}"])
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_size=1, master_addr="127.0.0.1", master_port=0,
                  launcher="single")
    assert plan_session(cfg, env, serve_rows=1).micro_batch_size == 1
    expected = plan_capture(cfg, world_size=1, count_dataset=False, serve_rows=64)
    assert not expected.fits and expected.driver == "serve"
    with pytest.raises(CaptureError) as caught:
        plan_session(cfg, env, serve_rows=64)
    assert expected.reason() in str(caught.value) and "lower --max-batch-rows" in str(caught.value)


def test_serve_logits_chunk_is_what_the_supervisor_allocates():
    """serve's term against a measured Supervisor.compute (every storage it creates, op by op, on CPU in bf16): the
    [n, V]-sized tensors at their peak (logits, then beside their fp32 copy and its softmax), to within the O(n)
    rest (argmax, masks, shifted ids), which the term leaves out."""
    from ds_capture.serve.supervision import Supervisor, VocabMapping

    V, H, S, rows = 4096, 64, 128, 4
    generator = torch.Generator().manual_seed(0)
    lm_head = torch.randn(V, H, generator=generator).to(torch.bfloat16)
    last = torch.randn(rows, S, H, generator=generator).to(torch.bfloat16)
    aux = torch.randn(rows, S, 3 * H, generator=generator).to(torch.bfloat16)
    input_ids = torch.randint(0, V, (rows, S), generator=generator)
    loss_mask = torch.ones(rows, S, dtype=torch.int64)
    mapping = VocabMapping(torch.arange(V), torch.ones(V, dtype=torch.bool))  # no draft vocabulary: the whole one
    supervisor = Supervisor(lm_head)
    existing = {t.untyped_storage().data_ptr() for t in (lm_head, last, aux, input_ids, loss_mask,
                                                         mapping.selected_token_ids, mapping.selected_token_mask)}
    with torch.no_grad(), LiveBytes(existing) as tracked:
        supervisor.compute(aux, last, input_ids, loss_mask, mapping)
    estimate = Supervision("serve", vocab_size=V, draft_vocab_size=V, hidden_size=H,
                           compute_bytes=BF16).logits_chunk_bytes(rows, S)
    assert estimate == rows * S * V * (BF16 + 8)  # one chunk of all 4 rows (2 MiB each, under the 256 MiB bound)
    print(f"serve logits chunk: measured peak {tracked.peak:,} bytes, plan {estimate:,}")
    assert estimate <= tracked.peak <= 1.01 * estimate, (tracked.peak, estimate)


def test_run_logits_chunk_bounds_what_the_draft_distribution_allocates():
    """run's term against a measured DraftDistribution.compute (fp32, CPU): its chunk of logits, the draft columns
    and their softmax, and the content positions' states, beside the answer's own tensors (on the host on a GPU,
    here in the same memory): at least the measured peak, at most 2% above it."""
    from ds_capture.cache.eagle3.draft_distribution import DraftDistribution

    V, Vd, H, S, rows = 4096, 1024, 64, 128, 4
    generator = torch.Generator().manual_seed(0)
    lm_head = torch.randn(V, H, generator=generator)
    last = torch.randn(rows, S, H, generator=generator)
    loss_mask = torch.ones(rows, S, dtype=torch.int64)
    num_tokens = torch.full((rows,), S)
    distribution = DraftDistribution(lm_head, list(range(Vd)), target_probs_topk=0, cache_dtype=torch.float32)
    existing = {t.untyped_storage().data_ptr() for t in (lm_head, last, loss_mask, num_tokens, distribution.selected,
                                                         distribution.selected_mask,
                                                         *distribution._filler.values())}
    with torch.no_grad(), LiveBytes(existing) as tracked:
        distribution.compute(last, loss_mask, num_tokens, S)
    estimate = Supervision("run", vocab_size=V, draft_vocab_size=Vd, hidden_size=H,
                           compute_bytes=4).logits_chunk_bytes(rows, S)
    assert estimate == rows * S * (V * 4 + Vd * 8) + rows * S * H * 4  # all 512 positions in one chunk (< 4096)
    answer = rows * S * (Vd * 4 + 1)  # target_probs [B, S, Vd] and position_mask, on the host on a GPU
    print(f"run logits chunk: measured peak {tracked.peak:,} bytes, plan {estimate:,} + the answer {answer:,}")
    assert tracked.peak <= estimate + answer <= 1.02 * tracked.peak, (tracked.peak, estimate, answer)
