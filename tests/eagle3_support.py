"""Helpers shared by the EAGLE-3 tests and the fixture generator (tools/nemo_oracle/make_eagle3_fixtures.py).

``build_fixture_target(spec, name, out)`` rebuilds a target of ``tests/fixtures/eagle3/spec.json``
deterministically (a small-vocabulary tokenizer trained on the demo conversations, then
``ds_capture.demo.build_tiny_target``); ``load_cache(dir)`` reads a cache's shards concatenated per key.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "eagle3"


def read_spec() -> dict:
    return json.loads((FIXTURES / "spec.json").read_text())


def build_fixture_target(spec: dict, name: str, out: Path) -> Path:
    from ds_capture.demo import _conversation_texts, build_tiny_target, demo_data_path, train_tokenizer

    entry = spec["targets"][name]
    tokenizer = train_tokenizer(_conversation_texts(demo_data_path()), vocab_size=spec["tokenizer_vocab_size"])
    return build_tiny_target(Path(out), entry["model_type"], seed=entry["seed"], tokenizer=tokenizer,
                             **entry["overrides"])


def load_cache(cache_dir: Path) -> dict[str, torch.Tensor]:
    """Every shard's tensors, concatenated along rows, per key."""
    from safetensors.torch import load_file

    shards = [load_file(str(path)) for path in sorted(Path(cache_dir).glob("shard-*.safetensors"))]
    return {key: torch.cat([shard[key] for shard in shards]) for key in shards[0]}


def nemo_case_recipe(case: str, target: Path, out_dir: Path) -> dict:
    """Our YAML mapping for a fixture case: NeMo's recorded argv mapped one to one (``recipe_from_nemo_argv``),
    the paths of this machine, and NeMo's CPU compute dtype (fp32)."""
    from ds_capture.cache.eagle3.kind import recipe_from_nemo_argv

    argv = json.loads((FIXTURES / f"{case}.nemo_args.json").read_text())["argv"]
    raw = recipe_from_nemo_argv(argv)
    raw["recipe_args"].update(target_model_name_or_path=str(target), train_data_path=str(FIXTURES / "data.jsonl"),
                              cache_output_dir=str(out_dir))
    raw["capture"] = {"compute_dtype": "fp32"}
    raw["dist_env"] = {"timeout_minutes": 3}
    return raw


def content_lengths(target: Path, manifest: dict) -> torch.Tensor:
    """num_tokens per fixture row (our own tokenisation; its ids and masks are checked equal to NeMo's)."""
    from transformers import AutoTokenizer

    from ds_capture.data.tokenization import read_conversations, resolve_chat_template, tokenize_conversations

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    rows = tokenize_conversations(
        read_conversations(str(FIXTURES / "data.jsonl"), split=None, shuffle_seed=42), tokenizer,
        chat_template=resolve_chat_template(tokenizer, None), seq_length=manifest["seq_length"],
        mask_reasoning_content=manifest["mask_reasoning_content"],
        mask_generation_prompt=manifest["mask_generation_prompt"])
    return rows.num_tokens


def assert_matches_nemo(ours: Path, case: str, target: Path) -> None:
    """Our cache against NeMo's for ``case``: manifest text (paths aside), file set and modes, embeddings and
    integer tensors exactly; aux_hidden_states at content positions and target_probs / top-k where the next
    position is content within fp32 1e-5 (bf16: 1e-2); the zero-logit slot S-1 exactly (top-k tie order too)."""
    import stat

    from safetensors.torch import load_file

    reference = FIXTURES / case
    manifest = json.loads((reference / "manifest.json").read_text())
    expected_text = json.dumps({**manifest, "target_model": str(target), "input_data": str(FIXTURES / "data.jsonl")},
                               indent=2, sort_keys=True)
    assert (ours / "manifest.json").read_text() == expected_text
    assert sorted(p.name for p in ours.iterdir() if p.name != ".ds_capture") == sorted(
        p.name for p in reference.iterdir())
    # NeMo's files are 0600 (safetensors' default; EAGLE3_CACHE.md §1). Not read off the fixtures: git checks
    # them out with the umask's mode.
    for name in ["target_embeddings.safetensors"] + [p.name for p in reference.glob("shard-*")]:
        assert stat.S_IMODE((ours / name).stat().st_mode) == 0o600, name
    ours_embed = load_file(ours / "target_embeddings.safetensors")
    nemo_embed = load_file(reference / "target_embeddings.safetensors")
    assert ours_embed.keys() == nemo_embed.keys() == {"weight"}
    assert torch.equal(ours_embed["weight"], nemo_embed["weight"])

    a, b = load_cache(ours), load_cache(reference)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
    for key in ("input_ids", "attention_mask", "loss_mask", "position_mask"):
        assert torch.equal(a[key], b[key]), key
    assert int(b["position_mask"].sum()) > 0  # the comparisons below cover real supervision
    S = manifest["seq_length"]
    num_tokens = content_lengths(target, manifest)
    positions = torch.arange(S)[None, :]
    aux_content, next_content = positions < num_tokens[:, None], positions + 1 < num_tokens[:, None]
    atol = 1e-5 if manifest["dtype"] == "fp32" else 1e-2
    torch.testing.assert_close(a["aux_hidden_states"][aux_content].float(), b["aux_hidden_states"][aux_content].float(),
                               atol=atol * 10, rtol=atol)
    if "target_probs" in a:
        keys = ("target_probs",)
        torch.testing.assert_close(a["target_probs"][next_content].float(), b["target_probs"][next_content].float(),
                                   atol=atol, rtol=0)
    else:
        keys = ("target_probs_values", "target_probs_indices")
        assert_same_topk(a["target_probs_values"][next_content], a["target_probs_indices"][next_content],
                         b["target_probs_values"][next_content], b["target_probs_indices"][next_content])
        torch.testing.assert_close(a["target_probs_values"][next_content].float(),
                                   b["target_probs_values"][next_content].float(), atol=atol, rtol=0)
    for key in keys:
        assert torch.equal(a[key][:, S - 1], b[key][:, S - 1]), key


def assert_same_topk(values_a: torch.Tensor, indices_a: torch.Tensor, values_b: torch.Tensor,
                     indices_b: torch.Tensor) -> None:
    """Top-k rows equal in their indices, except that indices whose stored values tie may come in either order.

    ``torch.topk`` orders exactly equal values by the kernel's own traversal, which differs between CPUs (measured:
    1 row of 443 of the bf16 case swaps two indices of an equal 0.0408 on an AVX512-BF16 Xeon). Each row is
    reordered by its own values, then index, before the indices are compared: a tie permuted is equal, anything
    else is not (the values themselves are compared within tolerance by the caller).
    """
    def canonical(values, indices):
        order = torch.argsort(indices, dim=-1, stable=True)
        values, indices = values.gather(-1, order), indices.gather(-1, order)
        order = torch.argsort(values.float(), dim=-1, descending=True, stable=True)
        return values.gather(-1, order), indices.gather(-1, order)

    assert torch.equal(canonical(values_a, indices_a)[1], canonical(values_b, indices_b)[1])
