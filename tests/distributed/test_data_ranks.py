"""Data and reduced depth over real ranks (torchrun, gloo):

- a bad row anywhere is every rank's error: streaming validation reads every row on every rank, and a row that
  only rank 1 tokenises (a template that rewrites earlier turns) stops the job before rank 0 writes anything;
  the message is printed once, exit 2;
- ``target_num_hidden_layers`` at EP=2 gives the single process's reduced cache (ids and masks exact, states
  within fp32 round-off) and the same reduced-depth bookkeeping.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launchers import ensure_shm_op_built, run_launcher  # noqa: E402
from support import max_rel_diff  # noqa: E402

pytestmark = [pytest.mark.distributed]

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
# Qwen3's stock rule, cut down: reasoning is shown only after the last user message.
REWRITING = (
    "{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = "
    "loop.index0 %}{%- endif %}{%- endfor %}{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last %}{{ '<think>' + (m.reasoning_content or '') + "
    "'</think>' }}{%- endif %}{{ m.content + '<|im_end|>\\n' }}{%- endfor %}"
)
TWO_TURNS = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b",
             "reasoning_content": "r"}, {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}


def _recipe(path: Path, target: Path, data: Path, out: Path, **extra) -> Path:
    distributed = extra.pop("distributed", None)
    recipe = {"recipe_args": {"target_model_name_or_path": str(target), "train_data_path": str(data),
                              "cache_output_dir": str(out), "seq_length": 32, "micro_batch_size": 2,
                              "cache_shard_size": 2, "cache_dtype": "fp32", **extra},
              "dist_env": {"timeout_minutes": 2},
              "capture": {"cpu_threads": 1}}  # one thread per rank whatever the world: the count is part of the bits
    if distributed:
        recipe["distributed"] = distributed
    path.write_text(yaml.safe_dump(recipe))
    return path


def _errors(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("ds-capture run: error:")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [pytest.param("bad_role_in_rank1_range", marks=pytest.mark.slow),
                                  "rewriting_template_in_rank1_range"])
def test_a_bad_row_in_rank_1s_range_stops_every_rank_before_anything_is_written(tiny_target, tmp_path, case):
    ensure_shm_op_built()
    rows = [GOOD] * 8
    if case == "bad_role_in_rank1_range":
        rows[6] = {"messages": [{"role": "robot", "content": "x"}]}
        extra, expected = {}, "line 7: message 1 has unknown role 'robot'. Valid roles: system, user, assistant, tool."
    else:
        rows[6] = TWO_TURNS
        extra = {"chat_template": REWRITING}
        expected = ("line 7: rendering its first 2 message(s) alone does not reproduce the start of the whole rendered "
                    "conversation")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    recipe = _recipe(tmp_path / "recipe.yaml", tiny_target("qwen3"), data, out, **extra)
    result = run_launcher("torchrun", 2, ["-m", "ds_capture", "run", "-c", str(recipe), "--no-progress"],
                          timeout_s=300)
    # Each rank exits 2 (a user error); torchrun reports a failed rank as its own exit code 1.
    assert result.returncode == 1, result.stdout[-3000:]
    errors = _errors(result.stdout)
    assert len(errors) == 1 and errors[0].startswith(f"ds-capture run: error: {data} {expected}"), result.stdout[-3000:]
    assert "ds_capture/" not in result.stdout.split("torch/distributed/elastic")[0]  # no traceback of ours
    assert "Traceback" not in result.stdout.split("torch/distributed/elastic")[0]
    assert not out.exists()  # rank 0 waited for rank 1's rows before touching the output directory


@pytest.mark.timeout(600)
def test_reduced_depth_at_ep2_equals_the_single_process(tiny_target, tmp_path):
    from safetensors.torch import load_file

    from ds_capture.recipe.config import load_config
    from ds_capture.runner import run_capture

    ensure_shm_op_built()
    target = tiny_target("qwen3_moe")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i} " * (i + 1)},
                                                     {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
                            for i in range(6)))
    single = tmp_path / "single"
    run_capture(load_config(_recipe(tmp_path / "single.yaml", target, data, single, target_num_hidden_layers=2)),
                show_progress=False)
    ep2 = tmp_path / "ep2"
    recipe = _recipe(tmp_path / "ep2.yaml", target, data, ep2, target_num_hidden_layers=2,
                     distributed={"ep_size": 2})
    result = run_launcher("torchrun", 2, ["-m", "ds_capture", "run", "-c", str(recipe), "--no-progress"],
                          timeout_s=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Reducing the target from 4 to 2 layers" in result.stdout
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (ep2, single))
    assert a["num_hidden_layers"] == b["num_hidden_layers"] == 2
    assert a["reduced_depth"] == b["reduced_depth"] and a["target_layer_ids"] == b["target_layer_ids"]
    assert a["producer"]["ep_size"] == 2 and b["producer"]["ep_size"] == 1
    for name in sorted(p.name for p in single.glob("shard-*.safetensors")):
        x, y = load_file(str(ep2 / name)), load_file(str(single / name))
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
    assert max_rel_diff(ep2, single) < 1e-5
