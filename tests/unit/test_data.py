"""read_conversations: formats, ShareGPT / list-of-parts normalisation, split + shuffle semantics, and
the exact error text for every bad input. No tokenizer needed; runs in a few seconds."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from ds_capture.data.tokenization import read_conversations
from ds_capture.errors import CaptureError


def _row(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}


def _write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _user_texts(conversations) -> list[str]:
    return [c[0]["content"] for c in conversations]


@pytest.fixture()
def jsonl10(tmp_path) -> str:
    return _write_jsonl(tmp_path / "d.jsonl", [_row(i) for i in range(10)])


# ----------------------------------------------------------------------------- local JSON / JSONL


def test_jsonl_keeps_file_order_and_ignores_seed(jsonl10):
    for seed in (0, 42):
        got = read_conversations(jsonl10, split=None, shuffle_seed=seed)
        assert _user_texts(got) == [f"q{i}" for i in range(10)]
    assert got[3] == _row(3)["messages"]


@pytest.mark.parametrize(
    "split, expected",
    [
        ("train", list(range(10))),
        ("train[2:5]", [2, 3, 4]),
        ("train[:3]", [0, 1, 2]),
        ("train[7:]", [7, 8, 9]),
        ("train[:30%]", [0, 1, 2]),
        ("train[-2:]", [8, 9]),
    ],
)
def test_jsonl_split_slices_in_file_order(jsonl10, split, expected):
    got = read_conversations(jsonl10, split=split, shuffle_seed=42)
    assert _user_texts(got) == [f"q{i}" for i in expected]


def test_a_slice_of_a_local_file_warns_that_nemo_ignores_it(jsonl10, caplog):
    with caplog.at_level("WARNING", logger="ds_capture.data.reading"):
        read_conversations(jsonl10, split="train[2:5]", shuffle_seed=42)
    assert [r.getMessage() for r in caplog.records] == [
        f"{jsonl10}: train_split 'train[2:5]' selects 3 of its 10 rows. NeMo AutoModel 0.7.0 ignores train_split "
        "for local JSON/JSONL files (its precompute would capture all 10); this cache holds the 3 selected."]
    caplog.clear()
    with caplog.at_level("WARNING", logger="ds_capture.data.reading"):
        read_conversations(jsonl10, split="train", shuffle_seed=42)
    assert not caplog.records


def test_regenerate_words_the_slice_of_a_local_file_for_a_dataset(jsonl10, caplog):
    from ds_capture.data.reading import open_dataset

    with caplog.at_level("INFO", logger="ds_capture.data.reading"):
        open_dataset(jsonl10, split="train[2:5]", shuffle_seed=42, selected_for="regenerate")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", f"{jsonl10}: --split 'train[2:5]' selects 3 of its 10 rows (in file order); the regenerated dataset "
                 "holds only the 3 selected.")]


def test_jsonl_unknown_split_name(jsonl10):
    with pytest.raises(CaptureError) as err:
        read_conversations(jsonl10, split="test[:2]", shuffle_seed=42)
    assert str(err.value).startswith(f"{jsonl10}: cannot apply split 'test[:2]' (")
    assert str(err.value).endswith(
        "Available splits: ['train']; use a split expression such as 'train', 'train[:100]', "
        "'train[10:20]' or 'train[:10%]'."
    )


def test_json_list_and_blank_lines(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([_row(0), _row(1)]), encoding="utf-8")
    assert _user_texts(read_conversations(str(path), split=None, shuffle_seed=1)) == ["q0", "q1"]
    blank = tmp_path / "b.jsonl"
    blank.write_text(json.dumps(_row(0)) + "\n\n   \n" + json.dumps(_row(1)) + "\n", encoding="utf-8")
    assert _user_texts(read_conversations(str(blank), split=None, shuffle_seed=1)) == ["q0", "q1"]


def test_sharegpt_and_list_of_parts_are_normalised(tmp_path):
    rows = [
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello", "weight": 1},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]},
                {"role": "assistant", "content": "ok", "reasoning_content": "think"},
                {"role": "user", "content": "again"},
                {"role": "assistant", "content": "done", "reasoning_content": None},
            ]
        },
    ]
    got = read_conversations(_write_jsonl(tmp_path / "d.jsonl", rows), split=None, shuffle_seed=0)
    assert got == [
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},  # NeMo keeps only role and content of a ShareGPT turn
        ],
        [
            {"role": "user", "content": "two parts"},
            {"role": "assistant", "content": "ok", "reasoning_content": "think"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "done", "reasoning_content": ""},
        ],
    ]


# ----------------------------------------------------------------------------- Hugging Face datasets

# Dataset.shuffle(seed=7) of 10 rows, as `datasets` 5.2 computes it (numpy default_rng permutation).
SEED7_ORDER = datasets.Dataset.from_dict({"i": list(range(10))}).shuffle(seed=7)["i"]


def test_seed7_order_is_a_real_shuffle():
    assert sorted(SEED7_ORDER) == list(range(10)) and SEED7_ORDER != list(range(10))


@pytest.fixture()
def parquet10(tmp_path) -> str:
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list([_row(i) for i in range(10)]).to_parquet(str(path))
    return str(path)


@pytest.mark.parametrize(
    "split, oracle",
    [
        (None, lambda order: order),
        ("train", lambda order: order),
        ("train[2:5]", lambda order: order[2:5]),  # shuffle the base split, then slice
        ("train[:4]", lambda order: order[:4]),
    ],
)
def test_parquet_shuffled_then_sliced(parquet10, split, oracle):
    got = read_conversations(parquet10, split=split, shuffle_seed=7)
    assert _user_texts(got) == [f"q{i}" for i in oracle(SEED7_ORDER)]
    # The same rows NeMo gets: load_dataset(base split).shuffle(seed) then select the slice.
    reference = datasets.load_dataset("parquet", data_files=parquet10, split="train").shuffle(seed=7)
    picked = oracle(list(range(10)))
    assert got == [reference[i]["messages"] for i in picked]


def test_parquet_percent_split_selects_then_shuffles(parquet10):
    # NeMo passes a non-`[a:b]` expression to load_dataset (which slices) and shuffles afterwards.
    got = read_conversations(parquet10, split="train[:50%]", shuffle_seed=7)
    reference = datasets.load_dataset("parquet", data_files=parquet10, split="train[:50%]").shuffle(seed=7)
    assert _user_texts(got) == [r["messages"][0]["content"] for r in reference]
    assert sorted(_user_texts(got)) == [f"q{i}" for i in range(5)]


def test_save_to_disk_dataset_dict(tmp_path):
    train = datasets.Dataset.from_list([_row(i) for i in range(10)])
    test = datasets.Dataset.from_list([_row(100 + i) for i in range(3)])
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    got = read_conversations(str(tmp_path / "dd"), split="train[1:3]", shuffle_seed=7)
    assert _user_texts(got) == [f"q{i}" for i in SEED7_ORDER[1:3]]
    got = read_conversations(str(tmp_path / "dd"), split="test", shuffle_seed=7)
    test_order = datasets.Dataset.from_dict({"i": [0, 1, 2]}).shuffle(seed=7)["i"]
    assert _user_texts(got) == [f"q{100 + i}" for i in test_order]


def test_save_to_disk_single_dataset_is_train(tmp_path):
    datasets.Dataset.from_list([_row(i) for i in range(10)]).save_to_disk(str(tmp_path / "ds"))
    got = read_conversations(str(tmp_path / "ds"), split="train[:3]", shuffle_seed=7)
    assert _user_texts(got) == [f"q{i}" for i in SEED7_ORDER[:3]]


def test_parquet_missing_struct_fields_are_dropped(tmp_path):
    # Arrow unifies message structs, so a field present in one message is None in the others.
    rows = [
        {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]},
        {"messages": [{"role": "user", "content": "v"}, {"role": "assistant", "content": "b"}]},
    ]
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    got = read_conversations(str(path), split="train[:2]", shuffle_seed=0)
    by_user = {c[0]["content"]: c for c in got}
    assert by_user["u"] == [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    # NeMo renders an assistant's null reasoning_content as "".
    assert by_user["v"] == [{"role": "user", "content": "v"}, {"role": "assistant", "content": "b", "reasoning_content": ""}]


def test_bad_row_in_parquet_names_the_row(tmp_path):
    rows = [_row(0), _row(1), {"messages": [{"role": "robot", "content": "x"}]}]
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    with pytest.raises(CaptureError) as err:
        read_conversations(str(path), split=None, shuffle_seed=3)
    assert str(err.value) == f"{path} row 3: message 1 has unknown role 'robot'. Valid roles: system, user, assistant, tool."


# ----------------------------------------------------------------------------- bad inputs, exact text

U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "yo"}
S = {"role": "system", "content": "sys"}
TC = {"function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({"text": "hi"}, "line 2: row has neither a `messages` list (OpenAI format) nor a `conversations` list "
         "(ShareGPT format). Add one of them, or remove the row."),
        ({"messages": []}, "line 2: `messages` is empty. Every row needs at least one message; fill it in or "
         "remove the row."),
        ({"messages": "hi"}, "line 2: `messages` must be a list of messages, got str."),
        ([1, 2], "line 2: expected a JSON object with a `messages` list, got list. Each row must be an object "
         "such as {\"messages\": [{\"role\": \"user\", \"content\": \"...\"}]}."),
        ({"messages": [U, {"role": "wizard", "content": "x"}]}, "line 2: message 2 has unknown role 'wizard'. "
         "Valid roles: system, user, assistant, tool."),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "line 2: message 1 has unknown role 'alien'. "
         "Valid ShareGPT roles: assistant, bot, chatgpt, gpt, human, model, system, user (NeMo AutoModel converts "
         "plain-chat turns only; write tool-calling rows as OpenAI `messages`)."),
        ({"conversations": [{"from": "tool", "value": "x"}]}, "line 2: message 1 has unknown role 'tool'. "
         "Valid ShareGPT roles: assistant, bot, chatgpt, gpt, human, model, system, user (NeMo AutoModel converts "
         "plain-chat turns only; write tool-calling rows as OpenAI `messages`)."),
        ({"messages": [S, U, S, A]}, "line 2: message 3 is a second system message. NeMo AutoModel supports one "
         "system message per conversation; merge the system messages into one."),
        ({"messages": [U, {"role": "user", "content": [{"type": "text", "text": None}]}]}, "line 2: message 2 "
         "(user): content part 1 has `text` of type NoneType; a part's text must be a string (drop the `text` key "
         "from non-text parts, e.g. Arrow-unified image parts)."),
        ({"messages": [U, {"role": "assistant", "content": "a", "reasoning_content": ["r"]}]}, "line 2: message 2 "
         "(assistant) has reasoning_content of type list; it must be a string. Convert it to text."),
        ({"messages": [U, {"role": "assistant", "content": None, "tool_calls": None}]}, "line 2: message 2 "
         "(assistant): `tool_calls` must be a list of tool calls, got null. Remove the key from messages without "
         "tool calls (NeMo AutoModel refuses a null `tool_calls`)."),
        ({"messages": [U, {"role": "assistant", "tool_calls": [[1]]}]}, "line 2: message 2 (assistant): "
         "`tool_calls[0]` must be an object, got list."),
        ({"messages": [U, {"role": "assistant", "tool_calls": [{"id": 7, "function": {}}]}]}, "line 2: message 2 "
         "(assistant): `tool_calls[0].id` must be a string when given, got int."),
        ({"messages": [U, {"role": "assistant", "tool_calls": [{"type": 1, "function": {}}]}]}, "line 2: message 2 "
         "(assistant): `tool_calls[0].type` must be a string when given, got int."),
        ({"messages": [U, {"role": "assistant", "tool_calls": [{"name": "f", "arguments": "{}"}]}]}, "line 2: "
         "message 2 (assistant): `tool_calls[0].function` must be an object with `name` and `arguments`, got null."),
        ({"messages": [U, {"role": "assistant", "tool_calls": [TC, {"function": {"name": "", "arguments": "{}"}}]}]},
         "line 2: message 2 (assistant): `tool_calls[1].function.name` must be a non-empty string, got ''."),
        ({"messages": [U, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]}, "line 2: message 2 "
         "(assistant): `tool_calls[0].function.arguments` is required (use \"{}\" for a call without arguments)."),
        ({"messages": [U, {"role": "assistant", "tool_calls": [TC]}, {"role": "tool", "content": "4"}]}, "line 2: "
         "message 3 (tool): `tool_call_id` must be a non-empty string, got null. Set it to the `id` of the "
         "assistant tool call this message answers."),
        ({"messages": [U, A], "tools": "[{"}, "line 2: `tools` is a string but not valid JSON (Expecting property "
         "name enclosed in double quotes at column 3). Store the tool definitions as a list, or as the JSON text of "
         "one."),
        ({"messages": [U, A], "tools": {"name": "f"}}, "line 2: `tools` must be a list of tool definitions (or the "
         "JSON text of one), got dict."),
        ({"messages": [U, "hello"]}, "line 2: message 2 must be an object with `role` and `content`, got str."),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, bad_row, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", [_row(0), bad_row, _row(2)])
    with pytest.raises(CaptureError) as err:
        read_conversations(path, split=None, shuffle_seed=42)
    assert str(err.value) == f"{path} {message}"


def test_malformed_json_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_row(0)) + "\n\n{\"messages\": [\n", encoding="utf-8")
    with pytest.raises(CaptureError) as err:
        read_conversations(str(path), split=None, shuffle_seed=42)
    assert str(err.value) == (
        f"{path} line 3: not valid JSON (Expecting value at column 15). Each line of a JSONL file must be one "
        "JSON object; fix or delete this line."
    )


def test_bad_row_in_json_list_names_the_row(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([_row(0), {"messages": []}]), encoding="utf-8")
    with pytest.raises(CaptureError) as err:
        read_conversations(str(path), split=None, shuffle_seed=42)
    assert str(err.value).startswith(f"{path} row 2: `messages` is empty.")


def test_json_that_is_not_a_list(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text(json.dumps(_row(0)), encoding="utf-8")
    with pytest.raises(CaptureError) as err:
        read_conversations(str(path), split=None, shuffle_seed=42)
    assert str(err.value) == (
        f"{path}: a .json dataset must be a JSON list of rows, got a JSON dict. Wrap the rows in a list, or "
        "write one row per line as .jsonl."
    )


def test_malformed_json_document_names_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"messages": []},\n  {"messages": [}\n]\n', encoding="utf-8")
    with pytest.raises(CaptureError) as err:
        read_conversations(str(path), split=None, shuffle_seed=42)
    assert str(err.value) == (
        f"{path}: not valid JSON (Expecting value at line 3 column 17). A .json dataset must be one JSON list of "
        "rows; fix the file or convert it to JSONL."
    )


HINT = (
    "Use a .jsonl/.ndjson file (one row per line), a .json file (a list of rows), a .parquet file, or a "
    "directory written by datasets' save_to_disk / holding parquet files."
)


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.jsonl")
    with pytest.raises(CaptureError) as err:
        read_conversations(path, split=None, shuffle_seed=42)
    assert str(err.value) == f"{path}: dataset not found. Point train_data_path at an existing file or directory. {HINT}"


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(CaptureError) as err:
        read_conversations(str(path), split=None, shuffle_seed=42)
    assert str(err.value) == f"{path}: unsupported dataset file type '.csv'. {HINT}"


def test_empty_dataset(tmp_path):
    path = _write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(CaptureError) as err:
        read_conversations(path, split=None, shuffle_seed=42)
    assert str(err.value) == f"{path}: the dataset has no rows. Add rows to the dataset or widen the split."
    full = _write_jsonl(tmp_path / "two.jsonl", [_row(0), _row(1)])
    with pytest.raises(CaptureError) as err:
        read_conversations(full, split="train[5:]", shuffle_seed=42)
    assert str(err.value) == (
        f"{full}: the dataset has no rows after applying split 'train[5:]'. Add rows to the dataset or widen "
        "the split."
    )


def test_raw_unicode_line_separator_splits_the_line_as_nemo_does(tmp_path):
    # NeMo reads JSONL with str.splitlines(), which also ends a line at U+2028: such a row is not valid JSON there.
    path = tmp_path / "d.jsonl"
    row = json.dumps({"messages": [{"role": "user", "content": "a\u2028b"}, A]}, ensure_ascii=False)
    path.write_text(json.dumps(_row(0)) + "\n" + row + "\n", encoding="utf-8")
    with pytest.raises(CaptureError) as err:
        read_conversations(str(path), split=None, shuffle_seed=0)
    assert str(err.value) == (
        f"{path} line 2: not valid JSON (Unterminated string starting at column 43). Each line of a JSONL file "
        "must be one JSON object; fix or delete this line. The line holds a raw Unicode line break (U+2028, "
        "U+2029, U+0085, form feed, ...), where NeMo AutoModel splits JSONL lines as Python's str.splitlines "
        "does; write those characters escaped (json.dumps with ensure_ascii=True writes \\u2028)."
    )
    escaped = tmp_path / "e.jsonl"
    escaped.write_text(json.dumps({"messages": [{"role": "user", "content": "a\u2028b"}, A]}) + "\n")
    assert read_conversations(str(escaped), split=None, shuffle_seed=0)[0][0]["content"] == "a\u2028b"


def _row(n: int) -> dict:
    return {"messages": [{"role": "user", "content": f"q{n}"}, {"role": "assistant", "content": f"a{n}"}]}


@pytest.mark.parametrize("fmt, split", [("jsonl", None), ("jsonl", "train[1:5]"), ("json", None)])
def test_skip_keeps_the_valid_rows_in_order_and_names_the_others(tmp_path, fmt, split):
    """``invalid_rows="skip"``: the valid rows, in the order ``refuse`` reads a file of only them; each invalid
    row is listed with the message ``refuse`` raises for it (a split selects first, then invalid rows drop)."""
    from ds_capture.data.reading import open_dataset

    rows = [_row(0), {"messages": [{"role": "robot", "content": "x"}]}, _row(2), {"text": "no messages"}, _row(4),
            _row(5)]
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        path.write_text(json.dumps(rows))
    skipping = open_dataset(str(path), split=split, shuffle_seed=0, invalid_rows="skip")
    selected = range(1, 5) if split else range(6)
    valid = [n for n in selected if n not in (1, 3)]
    assert [c.where for c in skipping.conversations()] == [
        f"{path} {'line' if fmt == 'jsonl' else 'row'} {n + 1}" for n in valid]
    assert [c.where for c in skipping.conversations(1, 2)] == [skipping.conversations()[1].where]
    unit = "line" if fmt == "jsonl" else "row"
    expected = []
    for n in (1, 3):
        lone = tmp_path / f"lone{n}.json"
        lone.write_text(json.dumps([rows[n]]))
        with pytest.raises(CaptureError) as refusal:
            open_dataset(str(lone), split=None, shuffle_seed=0)
        expected.append({unit: n + 1, "where": f"{path} {unit} {n + 1}",
                         "reason": str(refusal.value).replace(f"{lone} row 1", f"{path} {unit} {n + 1}")})
    assert [row.to_json() for row in skipping.skipped] == expected
    with pytest.raises(CaptureError, match=rf"{path} {unit} 2: message 1 has unknown role 'robot'"):
        open_dataset(str(path), split=split, shuffle_seed=0)
