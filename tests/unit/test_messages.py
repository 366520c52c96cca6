"""Message normalisation = NeMo AutoModel 0.7.0's ChatDataset rules (ds_capture.data.messages), on rows read from disk.

The expected values follow NeMo's `chat_dataset._normalize_messages` for the same rows; test_released_templates
compares whole rows (normalised, rendered, masked) against NeMo's own recorded outputs."""

from __future__ import annotations

import json
import logging

from ds_capture.data.messages import Conversation, normalize_row
from ds_capture.data.tokenization import read_conversations


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return str(path)


U = {"role": "user", "content": "weather?"}


def test_openai_tool_call_turn_with_null_content_and_mapping_arguments(tmp_path):
    row = {
        "messages": [
            U,
            {"role": "assistant", "content": None, "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Zürich", "units": ["c", 1]}}},
                {"id": "abc", "type": "function", "function": {"name": "now", "arguments": "{}"}},
            ]},
            {"role": "tool", "tool_call_id": "call_0", "content": {"temp": 3}},
            {"role": "assistant", "content": "3 °C", "reasoning_content": None},
        ],
        "tools": json.dumps([{"type": "function", "function": {"name": "get_weather"}}]),
    }
    [got] = read_conversations(_write_jsonl(tmp_path / "d.jsonl", [row]), split=None, shuffle_seed=0)
    assert got == [
        U,
        {"role": "assistant", "content": "", "tool_calls": [
            # json.dumps with default arguments: ", " and ": " separators, non-ASCII escaped.
            {"id": "call_0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Z\\u00fcrich", "units": ["c", 1]}'}},
            {"id": "abc", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "call_0", "content": "{'temp': 3}"},  # NeMo: str(value)
        {"role": "assistant", "content": "3 °C", "reasoning_content": ""},
    ]
    assert isinstance(got, Conversation)
    assert got.tools == [{"type": "function", "function": {"name": "get_weather"}}]
    assert got.where.endswith("d.jsonl line 1")


def test_non_text_parts_dropped_with_one_warning_per_run(tmp_path, caplog):
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, image,
                                                   {"type": "text", "text": "here"}]}, {"role": "assistant", "content": "ok"}]},
        {"messages": [{"role": "user", "content": [image, "loose string", {"type": "text", "text": "x"}]},
                      {"role": "assistant", "content": [{"text": "y"}]}]},
    ]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="ds_capture"):
        got = read_conversations(path, split=None, shuffle_seed=0)
    assert [c[0]["content"] for c in got] == ["look here", "x"]
    assert got[1][1]["content"] == "y"
    warnings = [r.getMessage() for r in caplog.records if "non-text" in r.getMessage()]
    assert warnings == [
        f"dropped 3 non-text content part(s) (first: {path} line 1: message 1 (user) content part 2, 'image_url'); "
        "NeMo AutoModel keeps only the text of content parts, so images and other media never reach the chat "
        "template."
    ]


def test_scalar_content_and_a_late_system_message_follow_nemo():
    got = normalize_row({"messages": [U, {"role": "system", "content": 7}, {"role": "assistant", "content": True}]},
                        "f line 1")
    # NeMo: str(value) for non-list content; one system message anywhere is accepted (only a second is refused).
    assert got == [U, {"role": "system", "content": "7"}, {"role": "assistant", "content": "True"}]
    assert got.tools is None


def test_empty_tools_and_null_keys():
    got = normalize_row({"messages": [{"role": "user", "content": "q", "name": None, "tool_calls": None}],
                         "tools": []}, "f row 1")
    # tool_calls is only checked on assistant messages; None-valued keys are dropped (transformers drops them too).
    assert got == [{"role": "user", "content": "q"}] and got.tools is None
