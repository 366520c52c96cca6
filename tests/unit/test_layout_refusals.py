"""Bad parallel layouts are refused by ``run_capture`` before any process group or weight exists.

Each case sets a launcher environment (RANK / WORLD_SIZE / LOCAL_*, as ``torchrun`` would) in this one
process and calls the real ``run_capture``: the plan is validated from the environment and the target's
``config.json`` alone, so the refusal comes before ``distributed_session`` (spied on: never entered),
no ``torch.distributed`` group is created, no weights are loaded (``build_model`` spied on) and the
output directory is never created. Messages are asserted exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed

import ds_capture.runner as runner
import ds_capture.session as session
from ds_capture.errors import CaptureError
from ds_capture.recipe.config import load_config


@pytest.fixture
def no_side_effects(monkeypatch):
    """Spies that fail the test if a process group or a model would be built."""
    calls: list[str] = []

    def forbidden(name):
        def spy(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called before the layout was validated")
        return spy

    # The process group is opened by the target session every driver shares (ds_capture/session.py).
    monkeypatch.setattr(session, "distributed_session", forbidden("distributed_session"))
    monkeypatch.setattr(runner, "build_model", forbidden("build_model"))
    return calls


def _launch_env(monkeypatch, world_size: int, rank: int = 0) -> None:
    for key, value in {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world_size,
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29999}.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.delenv("LOCAL_SIZE", raising=False)


def _refused(cfg_path: Path, out: Path, calls: list[str], overrides: list[str] = ()) -> str:
    with pytest.raises(CaptureError) as caught:
        runner.run_capture(load_config(str(cfg_path), list(overrides)), show_progress=False)
    assert calls == []
    assert not torch.distributed.is_initialized()
    assert not out.exists(), "nothing may be written for a refused layout"
    return str(caught.value)


@pytest.fixture
def recipe(tiny_target, write_recipe, tmp_path):
    """``recipe(**distributed) -> (yaml path, output dir)`` for the tiny Qwen3-MoE (4 heads, 2 kv heads, 8 experts)."""
    target = tiny_target("qwen3_moe")

    def make(deepspeed_config: str | None = None, **distributed):
        out = tmp_path / "cache"
        body = {"recipe_args": {"target_model_name_or_path": str(target), "train_data_path": "demo:conversations",
                                "cache_output_dir": str(out), "seq_length": 32},
                "distributed": distributed}
        if deepspeed_config is not None:
            body["deepspeed_config"] = deepspeed_config
        return write_recipe(body), out

    return make


@pytest.mark.parametrize("world_size,distributed,message", [
    (3, {"tp_size": 3},
     "tp_size 3 does not divide num_attention_heads 4: AutoTP splits attention by heads. "
     "Use a tp_size that divides 4."),
    (4, {"tp_size": 4},
     "tp_size 4 does not divide num_key_value_heads 2: AutoTP splits the key/value heads too. "
     "Use a tp_size that divides 2."),
    (3, {"ep_size": 3},
     "ep_size 3 does not divide num_experts 8: every expert-parallel rank holds the same number of experts. "
     "Use an ep_size that divides 8."),
    (3, {"tp_size": 2},
     "world_size 3 is not a multiple of tp_size 2: every data-parallel rank needs a full tensor-parallel "
     "group. Launch a multiple of 2 ranks or set distributed.tp_size / distributed.ep_size in the YAML "
     "(or the DeepSpeed JSON)."),
    (2, {"ep_size": 4},
     "ep_size 4 does not divide world_size 2: expert-parallel groups are consecutive ranks and must tile "
     "the world. Launch a multiple of 4 ranks or set distributed.tp_size / distributed.ep_size in the YAML "
     "(or the DeepSpeed JSON)."),
])
@pytest.mark.parametrize("rank", [0, 1])
def test_bad_degrees_refused_before_any_group(recipe, monkeypatch, no_side_effects, world_size, distributed,
                                              message, rank):
    cfg, out = recipe(**distributed)
    _launch_env(monkeypatch, world_size, rank)
    assert _refused(cfg, out, no_side_effects) == message


def test_yaml_and_deepspeed_json_contradiction(recipe, monkeypatch, no_side_effects, tmp_path):
    ds_json = tmp_path / "ds_tp4.json"
    ds_json.write_text(json.dumps({"tensor_parallel": {"autotp_size": 4}}))
    cfg, out = recipe(deepspeed_config=str(ds_json), tp_size=2)
    _launch_env(monkeypatch, 4)
    loaded = load_config(str(cfg), [])
    assert _refused(cfg, out, no_side_effects) == (
        f"contradicting parallel degrees: {loaded.source}: distributed.tp_size = 2 but "
        f"{loaded.deepspeed_config_source}: tensor_parallel.autotp_size = 4. Set the degree in one place only "
        "(or make them equal).")
    assert str(cfg) in loaded.source and str(ds_json) in loaded.deepspeed_config_source


def test_contradiction_from_a_cli_override(recipe, monkeypatch, no_side_effects, tmp_path):
    """``--set distributed.ep_size=2`` against a DeepSpeed JSON that says 4: the same refusal."""
    ds_json = tmp_path / "ds_ep4.json"
    ds_json.write_text(json.dumps({"expert_parallel": {"autoep_size": 4}}))
    cfg, out = recipe(deepspeed_config=str(ds_json))
    _launch_env(monkeypatch, 4)
    message = _refused(cfg, out, no_side_effects, overrides=["distributed.ep_size=2"])
    assert message.startswith("contradicting parallel degrees: ")
    assert "distributed.ep_size = 2 but " in message and "expert_parallel.autoep_size = 4." in message


def test_cli_prints_the_refusal_without_traceback(recipe, monkeypatch, no_side_effects, capsys):
    from ds_capture.cli import main

    cfg, out = recipe(tp_size=3)
    _launch_env(monkeypatch, 3)
    code = main(["run", "-c", str(cfg), "--no-progress"])
    captured = capsys.readouterr()
    assert code != 0
    assert "tp_size 3 does not divide num_attention_heads 4" in captured.err + captured.out
    assert "Traceback" not in captured.err + captured.out
    assert no_side_effects == [] and not out.exists()
