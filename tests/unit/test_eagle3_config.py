"""cache_kind and the EAGLE-3 recipe keys: parsing, NeMo's argument checks, and the keys refused under the other kind."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from ds_capture.errors import CaptureError
from ds_capture.recipe.config import KIND_ONLY_KEYS, parse_config

BASE = {"recipe_args": {"target_model_name_or_path": "t", "train_data_path": "d.jsonl", "cache_output_dir": "out",
                        "seq_length": 16}}


def _parse(cache_kind: str | None, **recipe_args):
    raw = copy.deepcopy(BASE)
    if cache_kind is not None:
        raw["cache_kind"] = cache_kind
    raw["recipe_args"].update(recipe_args)
    return parse_config(raw, source="r.yaml", base_dir=Path("."))


def test_default_kind_is_dspark_and_eagle3_keys_parse():
    assert _parse(None).cache_kind == "dspark"
    cfg = _parse("eagle3", draft_vocab_size=32, target_probs_topk=8, aux_layer_ids=[5, 1, 7])
    args = cfg.recipe_args
    assert (cfg.cache_kind, args.draft_vocab_size, args.target_probs_topk, args.aux_layer_ids) == ("eagle3", 32, 8, (5, 1, 7))
    absent = _parse("eagle3").recipe_args
    assert (absent.draft_vocab_size, absent.target_probs_topk, absent.aux_layer_ids) == (None, None, None)


@pytest.mark.parametrize("key, value, other", [
    ("draft_vocab_size", 32, "dspark"), ("target_probs_topk", 8, "dspark"), ("aux_layer_ids", [1, 2, 3], "dspark"),
    ("target_layer_ids", [1, 2], "eagle3"), ("draft_num_hidden_layers", 3, "eagle3"),
    ("chat_template", "{{ x }}", "eagle3"),
])
def test_keys_of_one_kind_are_refused_under_the_other(key, value, other):
    kind, reason = KIND_ONLY_KEYS[key]
    with pytest.raises(CaptureError) as caught:
        _parse(None if other == "dspark" else other, **{key: value})
    assert str(caught.value) == (
        f"r.yaml: `recipe_args.{key}` applies only to cache_kind: {kind}, and this run writes the {other} cache: "
        f"{reason}. Remove the key, or set cache_kind: {kind}.")


def test_exact_refusal_text_for_one_key():
    with pytest.raises(CaptureError, match=r"^r\.yaml: `recipe_args\.draft_vocab_size` applies only to cache_kind: "
                       r"eagle3, and this run writes the dspark cache: it sizes the draft vocabulary of EAGLE-3's "
                       r"target_probs; the DSpark cache stores hidden states and no target distribution\. Remove "
                       r"the key, or set cache_kind: eagle3\.$"):
        _parse("dspark", draft_vocab_size=8)


@pytest.mark.parametrize("recipe_args, message", [
    ({"draft_vocab_size": 0}, "r.yaml: `recipe_args.draft_vocab_size` must be >= 1 or absent (absent: the full target "
                              "vocabulary), got 0."),
    ({"target_probs_topk": -1}, "r.yaml: `recipe_args.target_probs_topk` must be >= 0 (0: target_probs stored in full), "
                                "got -1."),
    ({"aux_layer_ids": [1, 2]}, "r.yaml: `recipe_args.aux_layer_ids` must be exactly 3 distinct decoder layer ids >= 0 "
                                "(EAGLE-3 concatenates 3 layers, matching the draft's num_aux_hidden_states), got [1, 2]."),
    ({"aux_layer_ids": [1, 1, 2]}, "r.yaml: `recipe_args.aux_layer_ids` must be exactly 3 distinct decoder layer ids "
                                   ">= 0 (EAGLE-3 concatenates 3 layers, matching the draft's num_aux_hidden_states), "
                                   "got [1, 1, 2]."),
])
def test_nemo_argument_checks(recipe_args, message):
    with pytest.raises(CaptureError) as caught:
        _parse("eagle3", **recipe_args)
    assert str(caught.value) == message


def test_unknown_cache_kind():
    with pytest.raises(CaptureError, match=r"^r\.yaml: `cache_kind` must be one of dspark, eagle3, got 'medusa'\.$"):
        _parse("medusa")


@pytest.mark.parametrize("aux_layer_ids, message", [
    (None, "r.yaml: the target has 4 decoder layers, too shallow for NeMo's default EAGLE-3 aux layers [1, 1, 0] "
           "([1, L//2 - 1, L - 4] needs L >= 7). Set `recipe_args.aux_layer_ids` to 3 distinct ids in 0..3, matching "
           "the draft's num_aux_hidden_states."),
    ([0, 2, 4], "r.yaml: `recipe_args.aux_layer_ids` [0, 2, 4] has ids outside 0..3 (4); the target has 4 decoder "
                "layers (id i is the output of decoder layer i, before the final norm)."),
])
def test_aux_layer_ids_against_the_target(tiny_target, tmp_path, aux_layer_ids, message):
    from ds_capture.runner import run_capture

    extra = {} if aux_layer_ids is None else {"aux_layer_ids": aux_layer_ids}
    raw = copy.deepcopy(BASE)
    raw["cache_kind"] = "eagle3"
    raw["recipe_args"].update(target_model_name_or_path=str(tiny_target("qwen3")),
                              cache_output_dir=str(tmp_path / "out"), **extra)
    with pytest.raises(CaptureError) as caught:
        run_capture(parse_config(raw, source="r.yaml", base_dir=Path(".")), show_progress=False)
    assert str(caught.value) == message
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_nemo_precompute_eagle3_argv_maps_one_to_one():
    from ds_capture.cache.eagle3.kind import recipe_from_nemo_argv

    argv = ["--target-model", "m", "--input-data", "d.jsonl", "--output-dir", "o", "--draft-vocab-size", "8192",
            "--target-probs-topk", "64", "--shard-size", "128", "--dtype", "fp32", "--device", "cpu", "--split",
            "train[:10]", "--shuffle-seed", "7", "--aux-layer-ids", "9", "2", "30", "--mask-reasoning-content",
            "--mask-generation-prompt", "--trust-remote-code", "--num-workers", "2", "--resume", "--log-level", "INFO"]
    recipe = recipe_from_nemo_argv(argv)
    assert recipe == {"cache_kind": "eagle3", "recipe_args": {
        "seq_length": 2048, "micro_batch_size": 4,  # NeMo's defaults where ours differ
        "target_model_name_or_path": "m", "train_data_path": "d.jsonl", "cache_output_dir": "o",
        "draft_vocab_size": 8192, "target_probs_topk": 64, "cache_shard_size": 128, "cache_dtype": "fp32",
        "train_split": "train[:10]", "shuffle_seed": 7, "aux_layer_ids": [9, 2, 30], "mask_reasoning_content": True,
        "mask_generation_prompt": True, "trust_remote_code": True, "num_workers": 2}}
    assert parse_config(recipe, source="r.yaml", base_dir=Path(".")).recipe_args.aux_layer_ids == (9, 2, 30)
    with pytest.raises(CaptureError, match=r"precompute_eagle3 flag '--chat-template' has no ds_capture key"):
        recipe_from_nemo_argv(["--chat-template", "x"])


def test_the_example_recipe_parses():
    from ds_capture.recipe.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "demo_eagle3.yaml")
    assert (cfg.cache_kind, cfg.recipe_args.aux_layer_ids, cfg.recipe_args.draft_vocab_size) == ("eagle3", (1, 2, 3), 1024)
