"""config: YAML recipe -> frozen RunConfig; every validation with its exact message (DESIGN §7)."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from ds_capture.errors import CaptureError
from ds_capture.recipe.config import RecipeArgs, load_config

# The valid keys a message must list: every field of the section's dataclass, sorted.
RECIPE_ARGS_KEYS = ", ".join(sorted(f.name for f in dataclasses.fields(RecipeArgs)))
NEMO_RECIPE_KEYS = {"target_model_name_or_path", "train_data_path", "train_split", "seq_length", "micro_batch_size",
                    "num_workers", "shuffle_seed", "trust_remote_code", "cache_output_dir", "cache_dtype",
                    "cache_shard_size", "target_layer_ids", "draft_num_hidden_layers", "chat_template",
                    "mask_reasoning_content", "mask_generation_prompt", "target_attn_implementation"}


def base_recipe(**recipe_args) -> dict:
    args = dict(target_model_name_or_path="some/target", train_data_path="data.jsonl", cache_output_dir="out",
                seq_length=64)
    args.update(recipe_args)
    return {"recipe_args": args}


def refusal(write_recipe, recipe, overrides=()) -> tuple[str, str]:
    path = write_recipe(recipe)
    with pytest.raises(CaptureError) as caught:
        load_config(path, overrides)
    return str(caught.value), str(path)


def test_minimal_recipe_gets_documented_defaults(write_recipe):
    path = write_recipe(base_recipe())
    cfg = load_config(path)
    args = cfg.recipe_args
    assert (args.target_model_name_or_path, args.train_data_path, args.cache_output_dir, args.seq_length) == (
        "some/target", "data.jsonl", "out", 64)
    assert (args.micro_batch_size, args.cache_shard_size, args.cache_dtype, args.shuffle_seed) == (1, 256, "bf16", 42)
    assert (args.target_layer_ids, args.draft_num_hidden_layers, args.train_split) == (None, 5, None)
    assert (args.mask_reasoning_content, args.mask_generation_prompt, args.chat_template) == (False, False, None)
    assert (cfg.engine, cfg.deepspeed_config, cfg.source) == ("deepspeed", None, str(path))
    assert (cfg.distributed.tp_size, cfg.distributed.ep_size, cfg.distributed.pp_size) == (None, None, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.seq_length = 128  # type: ignore[misc]


def test_all_values_are_read(write_recipe):
    recipe = base_recipe(micro_batch_size=4, cache_shard_size=8, cache_dtype="fp32", target_layer_ids=[-1, 2, 3],
                         mask_generation_prompt=True, train_split="train[:8]", shuffle_seed=7)
    recipe.update(engine="fsdp2", dist_env={"backend": "gloo", "timeout_minutes": 5},
                  distributed={"tp_size": 2, "ep_size": 1, "strategy": "fsdp2"})
    cfg = load_config(write_recipe(recipe))
    assert cfg.recipe_args.target_layer_ids == (-1, 2, 3)
    assert (cfg.recipe_args.micro_batch_size, cfg.recipe_args.cache_shard_size) == (4, 8)
    assert (cfg.recipe_args.cache_dtype, cfg.recipe_args.mask_generation_prompt) == ("fp32", True)
    assert (cfg.recipe_args.train_split, cfg.recipe_args.shuffle_seed) == ("train[:8]", 7)
    assert (cfg.engine, cfg.dist_env.backend, cfg.dist_env.timeout_minutes) == ("fsdp2", "gloo", 5)
    assert (cfg.distributed.tp_size, cfg.distributed.ep_size, cfg.distributed.strategy) == (2, 1, "fsdp2")


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(CaptureError) as caught:
        load_config(tmp_path / "nope.yaml")
    assert str(caught.value) == (
        f"config file {tmp_path / 'nope.yaml'} does not exist. Pass the path of a YAML recipe, e.g. configs/demo.yaml.")


def test_one_missing_required_key(write_recipe):
    recipe = base_recipe()
    del recipe["recipe_args"]["seq_length"]
    message, path = refusal(write_recipe, recipe)
    assert message == f"{path}: required key `recipe_args.seq_length` missing. Add it under `recipe_args:`."


def test_several_missing_required_keys_are_all_named(write_recipe):
    message, path = refusal(write_recipe, {"recipe_args": {"seq_length": 64}})
    assert message == (
        f"{path}: required keys `recipe_args.target_model_name_or_path`, `recipe_args.train_data_path`, "
        "`recipe_args.cache_output_dir` missing. Add them under `recipe_args:`.")


def test_missing_recipe_args_section(write_recipe):
    message, path = refusal(write_recipe, {"engine": "deepspeed"})
    assert message.startswith(f"{path}: required keys `recipe_args.target_model_name_or_path`, ")


def test_section_must_be_a_mapping(write_recipe):
    message, path = refusal(write_recipe, {**base_recipe(), "distributed": [1, 2]})
    assert message == f"{path}: `distributed` must be a mapping, got list."


@pytest.mark.parametrize("key, value, expected", [
    ("seq_length", "64", "`recipe_args.seq_length` must be an integer, got '64'."),
    ("seq_length", 64.0, "`recipe_args.seq_length` must be an integer, got 64.0."),
    # bool is an int subclass in Python: a YAML `true` must still not pass as a size.
    ("seq_length", True, "`recipe_args.seq_length` must be an integer, got True."),
    ("micro_batch_size", False, "`recipe_args.micro_batch_size` must be an integer, got False."),
    ("mask_generation_prompt", 1, "`recipe_args.mask_generation_prompt` must be true or false, got 1."),
    ("mask_reasoning_content", "yes please", "`recipe_args.mask_reasoning_content` must be true or false, "
                                             "got 'yes please'."),
    ("train_data_path", 5, "`recipe_args.train_data_path` must be a string, got 5."),
    ("target_layer_ids", 3, "`recipe_args.target_layer_ids` must be a list, got 3."),
    ("target_layer_ids", [1, "2"], "`recipe_args.target_layer_ids[1]` must be an integer, got '2'."),
    ("target_layer_ids", [1, True], "`recipe_args.target_layer_ids[1]` must be an integer, got True."),
])
def test_types_are_checked_with_the_yaml_path(write_recipe, key, value, expected):
    message, path = refusal(write_recipe, base_recipe(**{key: value}))
    assert message == f"{path}: {expected}"


def test_distributed_degrees_refuse_bools(write_recipe):
    message, path = refusal(write_recipe, {**base_recipe(), "distributed": {"tp_size": True}})
    assert message == f"{path}: `distributed.tp_size` must be an integer, got True."


@pytest.mark.parametrize("key, value, expected", [
    ("cache_dtype", "float32", "`recipe_args.cache_dtype` must be one of bf16, fp16, fp32, got 'float32'."),
    ("cache_dtype", "BF16", "`recipe_args.cache_dtype` must be one of bf16, fp16, fp32, got 'BF16'."),
    ("seq_length", 1, "`recipe_args.seq_length` must be >= 2, got 1."),
    ("seq_length", 0, "`recipe_args.seq_length` must be >= 2, got 0."),
    ("micro_batch_size", 0, "`recipe_args.micro_batch_size` must be >= 1, got 0."),
    ("cache_shard_size", 0, "`recipe_args.cache_shard_size` must be >= 1, got 0."),
    ("draft_num_hidden_layers", 0, "`recipe_args.draft_num_hidden_layers` must be >= 1, got 0."),
    ("target_layer_ids", [], "`recipe_args.target_layer_ids` must be a non-empty, strictly increasing list, got []."),
    ("target_layer_ids", [1, 3, 2],
     "`recipe_args.target_layer_ids` must be a non-empty, strictly increasing list, got [1, 3, 2]."),
    ("target_layer_ids", [1, 1],
     "`recipe_args.target_layer_ids` must be a non-empty, strictly increasing list, got [1, 1]."),
])
def test_values_are_range_checked(write_recipe, key, value, expected):
    message, path = refusal(write_recipe, base_recipe(**{key: value}))
    assert message == f"{path}: {expected}"


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_each_cache_dtype_is_accepted(write_recipe, dtype):
    assert load_config(write_recipe(base_recipe(cache_dtype=dtype))).recipe_args.cache_dtype == dtype


def test_seq_length_two_is_the_smallest_accepted(write_recipe):
    assert load_config(write_recipe(base_recipe(seq_length=2))).recipe_args.seq_length == 2


def test_shard_size_must_be_a_multiple_of_micro_batch(write_recipe):
    message, path = refusal(write_recipe, base_recipe(cache_shard_size=10, micro_batch_size=4))
    assert message == (
        f"{path}: `recipe_args.cache_shard_size` (10) must be a multiple of micro_batch_size (4) so shards align "
        "to micro-batch boundaries.")
    cfg = load_config(write_recipe(base_recipe(cache_shard_size=12, micro_batch_size=4)))
    assert cfg.recipe_args.cache_shard_size == 12


def test_pipeline_parallelism_is_refused_with_the_reason(write_recipe):
    message, path = refusal(write_recipe, {**base_recipe(), "distributed": {"pp_size": 2}})
    assert message == (
        f"{path}: `distributed.pp_size` pipeline parallelism is not supported (got 2): the capture hooks every "
        "decoder layer of one module. Set pp_size: 1 and shard a large target with tp_size / ep_size.")


def test_context_parallelism_is_refused_with_the_reason(write_recipe):
    message, path = refusal(write_recipe, {**base_recipe(), "distributed": {"cp_size": 4}})
    assert message == (
        f"{path}: `distributed.cp_size` context parallelism is not supported (got 4): each sequence must be "
        "forwarded whole to capture its hidden states. Set cp_size: 1.")


def test_unknown_engine(write_recipe):
    message, path = refusal(write_recipe, {**base_recipe(), "engine": "megatron"})
    assert message == f"{path}: `engine` must be one of deepspeed, fsdp2, got 'megatron'."


def test_unknown_recipe_key_names_file_key_and_valid_keys(write_recipe):
    message, path = refusal(write_recipe, base_recipe(seq_lenght=64))
    assert message == (
        f"{path}: unknown key `recipe_args.seq_lenght`. Valid keys under `recipe_args`: {RECIPE_ARGS_KEYS}. "
        "Fix the spelling or remove the key.")


def test_recipe_args_accepts_every_nemo_precompute_key():
    assert NEMO_RECIPE_KEYS <= {f.name for f in dataclasses.fields(RecipeArgs)}


def test_unknown_top_level_key(write_recipe):
    message, path = refusal(write_recipe, {**base_recipe(), "engin": "deepspeed"})
    prefix, suffix = f"{path}: unknown key `engin`. Valid keys: ", ". Fix the spelling or remove the key."
    assert message.startswith(prefix) and message.endswith(suffix)
    listed = message[len(prefix):-len(suffix)].split(", ")
    assert listed == sorted(listed)
    assert {"deepspeed_config", "dist_env", "distributed", "engine", "recipe_args"} <= set(listed)
    assert "engin" not in listed


def test_unknown_dist_env_key(write_recipe):
    message, path = refusal(write_recipe, {**base_recipe(), "dist_env": {"timeout": 3}})
    assert message == (
        f"{path}: unknown key `dist_env.timeout`. Valid keys under `dist_env`: backend, heartbeat_timeout_seconds, "
        "timeout_minutes. "
        "Fix the spelling or remove the key.")


def test_nemo_backend_keys_warn_once_each_and_are_ignored(write_recipe, caplog):
    recipe = base_recipe(target_dispatcher="deepep", target_experts="te")
    recipe["distributed"] = {"tp_size": 1, "moe": {"x": 1}, "sequence_parallel": False}
    recipe["model"] = {"_target_": "x"}
    path = write_recipe(recipe)
    with caplog.at_level(logging.WARNING, logger="ds_capture"):
        cfg = load_config(path)
    warned = sorted(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert warned == sorted(
        f"{path}: `{key}` is a NeMo backend setting; it does not apply to ds_capture and is ignored."
        for key in ("recipe_args.target_dispatcher", "recipe_args.target_experts", "distributed.moe",
                    "distributed.sequence_parallel", "model"))
    assert cfg.distributed.tp_size == 1


def test_nemo_key_in_the_wrong_section_is_still_an_error(write_recipe):
    message, path = refusal(write_recipe, base_recipe(moe={"x": 1}))
    assert message.startswith(f"{path}: unknown key `recipe_args.moe`. Valid keys under `recipe_args`: ")


def test_set_overrides_are_parsed_as_yaml_and_type_checked(write_recipe):
    path = write_recipe(base_recipe())
    cfg = load_config(path, ["recipe_args.seq_length=128", "recipe_args.target_layer_ids=[-1, 3]",
                             "recipe_args.mask_generation_prompt=true", "distributed.tp_size=2", "engine=fsdp2"])
    assert cfg.recipe_args.seq_length == 128
    assert cfg.recipe_args.target_layer_ids == (-1, 3)
    assert cfg.recipe_args.mask_generation_prompt is True
    assert (cfg.distributed.tp_size, cfg.engine) == (2, "fsdp2")
    # The later --set wins, and an empty value is null.
    cfg = load_config(path, ["recipe_args.seq_length=16", "recipe_args.seq_length=32", "recipe_args.train_split="])
    assert (cfg.recipe_args.seq_length, cfg.recipe_args.train_split) == (32, None)


@pytest.mark.parametrize("override, expected", [
    ("recipe_args.seq_length=abc", "{path}: `recipe_args.seq_length` must be an integer, got 'abc'."),
    ("recipe_args.seq_length=true", "{path}: `recipe_args.seq_length` must be an integer, got True."),
    ("recipe_args.cache_dtype=fp8", "{path}: `recipe_args.cache_dtype` must be one of bf16, fp16, fp32, got 'fp8'."),
    ("recipe_args.seqq=3", "{path}: unknown key `recipe_args.seqq`. Valid keys under `recipe_args`: "
                           f"{RECIPE_ARGS_KEYS}. Fix the spelling or remove the key."),
    ("recipe_args.seq_length", "--set 'recipe_args.seq_length': expected dotted.key=value, e.g. "
                               "--set recipe_args.seq_length=512."),
    ("recipe_args.seq_length.x=3", "--set 'recipe_args.seq_length.x=3': `seq_length` in {path} is not a section."),
])
def test_bad_set_overrides(write_recipe, override, expected):
    message, path = refusal(write_recipe, base_recipe(), [override])
    assert message == expected.format(path=path)


def test_deepspeed_config_path_is_relative_to_the_yaml(write_recipe, tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2}}
    (tmp_path / "ds_configs").mkdir()
    (tmp_path / "ds_configs" / "tp2.json").write_text(json.dumps(ds))
    path = write_recipe({**base_recipe(), "deepspeed_config": "../ds_configs/tp2.json"}, name="configs/run.yaml")
    cfg = load_config(path)
    assert dict(cfg.deepspeed_config) == ds
    assert cfg.deepspeed_config_source == str(tmp_path / "configs" / ".." / "ds_configs" / "tp2.json")
    with pytest.raises(TypeError):
        cfg.deepspeed_config["x"] = 1  # read-only mapping


def test_inline_deepspeed_config(write_recipe):
    path = write_recipe({**base_recipe(), "deepspeed_config": {"tensor_parallel": {"autotp_size": 2}}})
    cfg = load_config(path)
    assert dict(cfg.deepspeed_config) == {"tensor_parallel": {"autotp_size": 2}}
    assert cfg.deepspeed_config_source == f"{path} (inline deepspeed_config)"


def test_missing_deepspeed_config_file(write_recipe, tmp_path):
    message, path = refusal(write_recipe, {**base_recipe(), "deepspeed_config": "ds/missing.json"})
    assert message == (
        f"{path}: `deepspeed_config` 'ds/missing.json' does not exist (looked for {tmp_path / 'ds' / 'missing.json'}; "
        "paths are relative to the YAML file). Point it into ds_configs/, e.g. ../ds_configs/tp2.json.")


def test_deepspeed_config_must_be_a_json_object(write_recipe, tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text("{not json")
    message, _ = refusal(write_recipe, {**base_recipe(), "deepspeed_config": "list.json"})
    assert message == f"{tmp_path / 'list.json'}: a DeepSpeed config must be a JSON object."
    message, _ = refusal(write_recipe, {**base_recipe(), "deepspeed_config": "bad.json"})
    assert message.startswith(f"{tmp_path / 'bad.json'}: not valid JSON (")
    message, path = refusal(write_recipe, {**base_recipe(), "deepspeed_config": 3})
    assert message == f"{path}: `deepspeed_config` must be a path or a mapping, got 3."


def test_yaml_that_is_not_a_mapping(write_recipe):
    message, path = refusal(write_recipe, "- a\n- b\n")
    assert message == f"{path}: the top level must be a mapping of sections, got list."
    message, path = refusal(write_recipe, "recipe_args: [\n")
    assert message.startswith(f"{path}: not valid YAML (")
