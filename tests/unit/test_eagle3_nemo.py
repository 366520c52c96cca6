"""The EAGLE-3 cache against NeMo AutoModel 0.7.0's own producer (recorded fixtures, no NeMo needed).

``tests/fixtures/eagle3/`` holds caches written by NeMo's ``precompute_eagle3`` on CPU (its loader swapped for
transformers', as NeMo's own CPU test does; regenerate with tools/nemo_oracle/make_eagle3_fixtures.py). Each
case runs our producer, single process, with the same settings mapped through ``recipe_from_nemo_argv`` and
compares: the manifest text byte for byte (the two paths aside), target_embeddings exactly, the integer
tensors exactly, aux_hidden_states at content positions and target_probs / top-k where the next position is
content (fp32: 1e-5; bf16: one ulp), and the zero-logit slot S-1 exactly (top-k tie order included).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
import torch

from ds_capture.config import parse_config
from ds_capture.data import read_conversations, resolve_chat_template, tokenize_conversations
from ds_capture.eagle3 import recipe_from_nemo_argv
from ds_capture.runner import run_capture
from tests.eagle3_support import FIXTURES, build_fixture_target, load_cache, read_spec

SPEC = read_spec()
CASES = sorted(SPEC["cases"])


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    """The fixture targets, rebuilt; their bytes must be the ones NeMo's caches were made from."""
    root = tmp_path_factory.mktemp("eagle3_targets")
    recorded = json.loads((FIXTURES / "targets.json").read_text())
    built = {}
    for name in SPEC["targets"]:
        path = build_fixture_target(SPEC, name, root / name)
        found = {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
                 for p in sorted(path.rglob("*")) if p.is_file()}
        assert found == recorded[name], f"target {name} no longer rebuilds byte-identically: regenerate the fixtures"
        built[name] = path
    return built


def nemo_case_config(case: str, target: Path, out_dir: Path, **extra):
    """Our config for a fixture case: NeMo's recorded argv mapped one to one, plus ``extra`` top-level keys."""
    argv = json.loads((FIXTURES / f"{case}.nemo_args.json").read_text())["argv"]
    raw = recipe_from_nemo_argv(argv)
    raw["recipe_args"].update(target_model_name_or_path=str(target), train_data_path=str(FIXTURES / "data.jsonl"),
                              cache_output_dir=str(out_dir))
    raw.setdefault("capture", {})["compute_dtype"] = "fp32"  # NeMo on CPU computes in fp32
    for key, value in extra.items():
        raw.setdefault(key, {}).update(value) if isinstance(value, dict) else raw.__setitem__(key, value)
    return parse_config(raw, source=f"{case}.yaml", base_dir=Path("."))


def content_lengths(target: Path, manifest: dict) -> torch.Tensor:
    """num_tokens per row (our own tokenisation; its ids and masks are checked equal to NeMo's below)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    rows = tokenize_conversations(
        read_conversations(str(FIXTURES / "data.jsonl"), split=None, shuffle_seed=42), tokenizer,
        chat_template=resolve_chat_template(tokenizer, None), seq_length=manifest["seq_length"],
        mask_reasoning_content=manifest["mask_reasoning_content"],
        mask_generation_prompt=manifest["mask_generation_prompt"])
    return rows.num_tokens


def assert_matches_nemo(ours: Path, case: str, target: Path) -> None:
    reference = FIXTURES / case
    manifest = json.loads((reference / "manifest.json").read_text())
    expected_text = json.dumps({**manifest, "target_model": str(target), "input_data": str(FIXTURES / "data.jsonl")},
                               indent=2, sort_keys=True)
    assert (ours / "manifest.json").read_text() == expected_text
    assert sorted(p.name for p in ours.iterdir() if p.name != ".ds_capture") == sorted(
        p.name for p in reference.iterdir())
    for name in ["target_embeddings.safetensors"] + [p.name for p in reference.glob("shard-*")]:
        assert stat.S_IMODE((ours / name).stat().st_mode) == stat.S_IMODE((reference / name).stat().st_mode), name
    from safetensors.torch import load_file

    ours_embed, nemo_embed = load_file(ours / "target_embeddings.safetensors"), load_file(
        reference / "target_embeddings.safetensors")
    assert ours_embed.keys() == nemo_embed.keys() == {"weight"} and torch.equal(ours_embed["weight"], nemo_embed["weight"])

    a, b = load_cache(ours), load_cache(reference)
    assert a.keys() == b.keys()
    for key in ("input_ids", "attention_mask", "loss_mask", "position_mask"):
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert int(b["position_mask"].sum()) > 0  # the cells below compare real supervision
    S = manifest["seq_length"]
    num_tokens = content_lengths(target, manifest)
    positions = torch.arange(S)[None, :]
    aux_content = positions < num_tokens[:, None]
    next_content = positions + 1 < num_tokens[:, None]
    atol = 1e-5 if manifest["dtype"] == "fp32" else 1e-2
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
    torch.testing.assert_close(a["aux_hidden_states"][aux_content].float(), b["aux_hidden_states"][aux_content].float(),
                               atol=atol * 10, rtol=atol)
    if "target_probs" in a:
        torch.testing.assert_close(a["target_probs"][next_content].float(), b["target_probs"][next_content].float(),
                                   atol=atol, rtol=0)
        keys = ("target_probs",)
    else:
        assert torch.equal(a["target_probs_indices"][next_content], b["target_probs_indices"][next_content])
        torch.testing.assert_close(a["target_probs_values"][next_content].float(),
                                   b["target_probs_values"][next_content].float(), atol=atol, rtol=0)
        keys = ("target_probs_values", "target_probs_indices")
    for key in keys:  # the zero-logit slot: exactly NeMo's bytes (backend tie order of top-k included)
        assert torch.equal(a[key][:, S - 1], b[key][:, S - 1]), key


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_single_process_equals_nemo(case, targets, tmp_path):
    target = targets[SPEC["cases"][case]["target"]]
    summary = run_capture(nemo_case_config(case, target, tmp_path / "cache"), show_progress=False)
    assert summary.shards_written == 3
    assert_matches_nemo(tmp_path / "cache", case, target)


