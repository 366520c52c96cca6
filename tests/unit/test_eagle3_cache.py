"""The EAGLE-3 kind's pieces: draft-vocabulary selection, the chunked distribution against the full-logits
formula, verify's rejections of damaged caches (exact messages), inspect / compare, and resume.

The cache under test is NeMo's own recorded fixture (tests/fixtures/eagle3) or one our producer writes from
the same target; the kill tests fork a real process and SIGKILL it inside a forward.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ds_capture.cache.eagle3.draft_distribution import DraftDistribution, select_draft_vocab
from ds_capture.cache.registry import compare_caches, format_inspect, inspect_cache, verify_cache
from ds_capture.errors import CaptureError
from ds_capture.recipe.config import parse_config
from ds_capture.runner import run_capture
from tests.eagle3_support import FIXTURES, build_fixture_target, nemo_case_recipe, read_spec

SPEC = read_spec()


# ----------------------------------------------------------------------------- draft vocabulary


def test_draft_vocab_selection_order():
    counts = torch.tensor([0, 3, 1, 3, 0, 2, 0, 0, 5, 0])
    specials = [None, 9, 0, None, 9, 42]  # missing, duplicate and out-of-range specials are skipped
    # specials first (even if never counted), then by count descending with ties to the lower id, then unused ids.
    assert select_draft_vocab(counts, draft_vocab_size=6, special_token_ids=specials) == [9, 0, 8, 1, 3, 5]
    assert select_draft_vocab(counts, draft_vocab_size=8, special_token_ids=specials) == [9, 0, 8, 1, 3, 5, 2, 4]
    assert select_draft_vocab(counts, draft_vocab_size=1, special_token_ids=specials) == [9]
    assert select_draft_vocab(counts, draft_vocab_size=None, special_token_ids=specials) == list(range(10))
    assert select_draft_vocab(counts, draft_vocab_size=10, special_token_ids=specials) == list(range(10))


# ----------------------------------------------------------------------------- the distribution


def _reference(lm_head, last, loss_mask, num_tokens, selected, topk):
    """NeMo's formula on full [B, S, V] logits: shift left, argmax, draft-vocab softmax, top-k renormalised."""
    B, S = loss_mask.shape
    logits = torch.zeros(B, S, lm_head.shape[0])
    logits[:, :last.shape[1]] = last @ lm_head.T
    content = torch.arange(S)[None, :] < num_tokens[:, None]
    logits = logits * content.unsqueeze(-1)  # non-content positions: zero logits (our canonical slot)
    shifted = torch.zeros_like(logits)
    shifted[:, :-1] = logits[:, 1:]
    shifted_mask = torch.zeros_like(loss_mask)
    shifted_mask[:, :-1] = loss_mask[:, 1:]
    sel_mask = torch.zeros(lm_head.shape[0], dtype=torch.bool)
    sel_mask[selected] = True
    position_mask = (sel_mask[shifted.argmax(-1)] & shifted_mask.bool()).unsqueeze(-1)
    probs = torch.softmax(shifted[..., selected].float(), dim=-1)
    if not topk:
        return {"target_probs": probs, "position_mask": position_mask}
    values, indices = torch.topk(probs, topk, dim=-1)
    return {"target_probs_values": values / values.sum(-1, keepdim=True), "target_probs_indices": indices.int(),
            "position_mask": position_mask}


@pytest.mark.parametrize("topk", [0, 5])
def test_chunked_distribution_equals_full_logits_and_bounds_the_chunk(monkeypatch, topk):
    import ds_capture.cache.eagle3.draft_distribution as dd

    torch.manual_seed(0)
    V, H, B, S, T = 300, 16, 3, 12, 10
    lm_head, last = torch.randn(V, H), torch.randn(B, T, H)
    loss_mask = (torch.rand(B, S) < 0.6).long()
    num_tokens = torch.tensor([10, 7, 1])
    loss_mask[torch.arange(S)[None, :] >= num_tokens[:, None]] = 0
    selected = torch.randperm(V)[:200].tolist()  # most argmaxes inside, some outside
    # 3 positions per chunk: chunks cross row boundaries; the [C, V] logits never exceed 3 rows.
    monkeypatch.setattr(dd, "LOGITS_CHUNK_BYTES", 3 * V * 4)
    distribution = DraftDistribution(lm_head, selected, target_probs_topk=topk, cache_dtype=torch.float32)
    seen_rows = []
    real_logits = distribution.logits
    monkeypatch.setattr(distribution, "logits", lambda h: seen_rows.append(h.shape[0]) or real_logits(h))
    got = distribution.compute(last, loss_mask, num_tokens, S)
    expected = _reference(lm_head, last, loss_mask, num_tokens, torch.tensor(selected), topk)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-6)
    # Only content source positions (1 <= p < num_tokens) are computed, in chunks of at most 3.
    assert max(seen_rows) == 3 and sum(seen_rows) == 9 + 6 + 0
    assert got["position_mask"].any() and not got["position_mask"].all()


# ----------------------------------------------------------------------------- verify / inspect / compare


def _copy(case: str, tmp_path: Path) -> Path:
    out = tmp_path / case
    shutil.copytree(FIXTURES / case, out)
    return out


def _rewrite(path: Path, **changes) -> None:
    tensors = load_file(str(path))
    for key, change in changes.items():
        tensors[key] = change(tensors[key].clone())
    save_file(tensors, str(path))


def _set_first(value):
    def change(tensor):
        tensor.view(-1)[0] = value
        return tensor
    return change


@pytest.mark.parametrize("case", sorted(SPEC["cases"]))
def test_verify_accepts_nemo_caches(case):
    report = verify_cache(FIXTURES / case)
    assert report.ok, report.problems
    assert (report.num_samples, report.num_shards_checked) == (10, 3)


@pytest.mark.parametrize("damage, problem", [
    (lambda d: (d / "shard-000001.safetensors").unlink(),
     "missing shards: shard-000001.safetensors (expected shard-000000 .. shard-000002.safetensors)"),
    (lambda d: (d / "shard-000001.safetensors").write_bytes(b"\x00" * 64),
     "shard-000001.safetensors: unreadable safetensors file"),
    (lambda d: shutil.copy(d / "shard-000000.safetensors", d / "shard-000003.safetensors"),
     "extra shards beyond num_shards 3: shard-000003.safetensors"),
    (lambda d: _rewrite(d / "shard-000000.safetensors", position_mask=lambda t: torch.ones_like(t)),
     "shard-000000.safetensors: position_mask is set where loss_mask is 0 at "),
    (lambda d: _rewrite(d / "shard-000000.safetensors", target_probs=_set_first(0.9)),
     "shard-000000.safetensors: target_probs rows do not sum to 1 (tolerance 0.0001) at 1 positions, first at row 0 "
     "position 0"),
    (lambda d: _rewrite(d / "shard-000002.safetensors", aux_hidden_states=_set_first(float("nan"))),
     "shard-000002.safetensors: aux_hidden_states holds NaN/inf at 1 positions, first at row 0 position 0"),
    (lambda d: _rewrite(d / "shard-000000.safetensors", loss_mask=lambda t: t * 2),
     "shard-000000.safetensors: loss_mask is not 0/1 at "),
    (lambda d: _rewrite(d / "shard-000000.safetensors", target_probs=lambda t: t.to(torch.bfloat16)),
     "shard-000000.safetensors: target_probs is [4, 48, 96] bfloat16, expected [4, 48, 96] float32"),
    (lambda d: _rewrite(d / "target_embeddings.safetensors", weight=lambda t: t.half()),
     "target_embeddings.safetensors: holds {'weight': ([384, 64], 'torch.float16')}, expected exactly weight "
     "[384, 64] float32"),
    (lambda d: (d / "target_embeddings.safetensors").unlink(),
     "target_embeddings.safetensors is missing (NeMo's trainer seeds the draft's embed_tokens from it)"),
])
def test_verify_rejects_a_damaged_cache(tmp_path, damage, problem):
    cache = _copy("qwen3_full", tmp_path)
    damage(cache)
    report = verify_cache(cache)
    assert not report.ok
    assert any(p.startswith(problem) for p in report.problems), report.problems


def test_verify_rejects_bad_top_k(tmp_path):
    cache = _copy("qwen3_topk_masked", tmp_path)
    _rewrite(cache / "shard-000001.safetensors", target_probs_indices=_set_first(128))
    _rewrite(cache / "shard-000002.safetensors", target_probs_values=lambda t: t.flip(-1))
    problems = verify_cache(cache).problems
    assert problems[0].startswith("shard-000001.safetensors: target_probs_indices outside 0..127 at 1 positions")
    assert problems[1].startswith("shard-000002.safetensors: target_probs_values are not sorted descending at ")


def test_inspect_and_compare(tmp_path):
    info = inspect_cache(FIXTURES / "qwen3_topk_masked")
    assert (info["kind"], info["complete"], info["target_probs"], info["draft_vocab_size"]) == ("eagle3", True,
                                                                                            "top-8", 128)
    assert info["layers"] == [5, 1, 7] and info["supervised_tokens"] == 51
    assert "target_probs top-8 over a draft vocabulary of 128" in format_inspect(info)
    copy = _copy("qwen3_full", tmp_path)
    assert compare_caches(copy, FIXTURES / "qwen3_full", atol=None, rtol=None).equal
    _rewrite(copy / "shard-000001.safetensors", position_mask=lambda t: ~t)
    report = compare_caches(copy, FIXTURES / "qwen3_full", atol=None, rtol=None)
    assert not report.equal and report.failing_shards == ["shard-000001.safetensors"]
    with pytest.raises(CaptureError, match="caches of different kinds"):
        compare_caches(copy, Path(__file__).parent, atol=None, rtol=None)


# ----------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    return build_fixture_target(SPEC, "qwen3", tmp_path_factory.mktemp("eagle3_resume") / "qwen3")


def _config(target: Path, out: Path, case: str = "qwen3_topk_masked", **recipe_args):
    raw = nemo_case_recipe(case, target, out)
    raw["recipe_args"].update(recipe_args)
    raw["capture"]["writer_buffer_mib"] = 0  # synchronous: a kill after forward k leaves exactly the shards before it
    return parse_config(raw, source="resume.yaml", base_dir=Path("."))


def _digests(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


@pytest.mark.timeout(300)
def test_resume_after_a_kill_is_byte_identical(qwen3, tmp_path):
    import yaml

    from tests.distributed import _kill_helpers as kh

    reference = tmp_path / "reference"
    run_capture(_config(qwen3, reference), show_progress=False)
    killed = tmp_path / "killed"
    recipe = nemo_case_recipe("qwen3_topk_masked", qwen3, killed)
    recipe["capture"]["writer_buffer_mib"] = 0
    cfg_path = tmp_path / "killed.yaml"
    cfg_path.write_text(yaml.safe_dump(recipe))
    # SIGKILL inside forward 4 of 5: shard 0 (forwards 1-2) is written, shard 1 is half written in its .tmp.
    result = kh.run_forked_ranks(1, cfg_path, kill="forward:4:all", log_path=tmp_path / "killed.log", timeout_s=120)
    assert result["signals"] == [9]
    assert sorted(p.name for p in killed.glob("shard-*")) == ["shard-000000.safetensors", "shard-000001.safetensors.tmp"]
    report = verify_cache(killed)
    assert report.problems[0].startswith(".ds_capture/complete.json is missing or names another manifest")
    (killed / "shard-000001.safetensors.tmp").write_bytes(b"half a shard")  # what a kill mid-save leaves

    # A changed vocabulary is refused before anything is written: its columns are target_probs'.
    with pytest.raises(CaptureError, match=r"holds a different EAGLE-3 cache: draft_vocab_size is 128 there, 100 in "
                                           r"this run; selected_token_ids is \[2, 0, "):
        run_capture(_config(qwen3, killed, draft_vocab_size=100), show_progress=False)

    summary = run_capture(_config(qwen3, killed), show_progress=False)
    assert (summary.shards_written, summary.shards_skipped) == (2, 1)
    assert _digests(killed) == _digests(reference)
    assert verify_cache(killed, checksums=True).ok
    again = run_capture(_config(qwen3, killed), show_progress=False)
    assert not again.published and _digests(killed) == _digests(reference)


def test_a_dspark_cache_is_not_resumed_as_eagle3(qwen3, tmp_path, nemo_fixtures):
    out = tmp_path / "cache"
    shutil.copytree(nemo_fixtures / "cache_fp32", out)
    with pytest.raises(CaptureError, match=r"manifest\.json: format_version is 1, an EAGLE-3 cache is format 2 "
                                           r"\(DSpark caches are format 1\)"):
        run_capture(_config(qwen3, out), show_progress=False)
