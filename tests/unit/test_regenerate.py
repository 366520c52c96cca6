"""regenerate without a model: what each request holds, the output rows, the journal's crash safety, identity
refusals, retries, refusals and the CLI's exit codes, against a scripted chat-completions endpoint.

The endpoint here is an ``httpx.MockTransport`` (or, for a hang, a socket that never answers): it adds the fault
cases a real server does not produce on demand. The acceptance tests against a real server (``transformers
serve``) are tests/regenerate/test_regenerate_server.py.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from pathlib import Path

import httpx
import pytest

from ds_capture.cli import main
from ds_capture.data.messages import normalize_row
from ds_capture.data.reading import open_dataset
from ds_capture.errors import RERUN_EXIT_CODE, CaptureError
from ds_capture.regenerate.client import GenerationSettings, ServerUnavailable
from ds_capture.regenerate.driver import RegenerateOptions, regenerate
from ds_capture.regenerate.journal import OutputPaths, dumps_line

URL = "http://regenerate.test/v1"
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
ROWS = [
    {"id": "a", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one"},
                             {"role": "assistant", "content": "old 1", "reasoning_content": "old thought"},
                             {"role": "user", "content": "two"}, {"role": "assistant", "content": "old 2"}]},
    {"id": "b", "conversations": [{"from": "human", "value": "sharegpt"}, {"from": "gpt", "value": "old"}],
     "score": 0.5},
    {"id": "c", "tools": TOOLS, "messages": [
        {"role": "user", "content": "look it up"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "42"},
        {"role": "assistant", "content": "old answer"}]},
    {"id": "d", "messages": [{"role": "user", "content": "LONG please"}, {"role": "assistant", "content": "x"}]},
    {"id": "e", "messages": [{"role": "user", "content": "no answer yet"}]},
] + [{"id": f"r{k}", "messages": [{"role": "user", "content": f"question {k}"},
                                  {"role": "assistant", "content": "old"}]} for k in range(7)]


def reply_to(messages: list[dict]) -> str:
    """The scripted target: a function of the whole prefix, so a wrong prefix shows in the output."""
    return "re:" + hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:12] + " \u2028."


class Endpoint:
    """A scripted /chat/completions: answers, refuses prompts holding REFUSE, fails on demand; logs requests."""

    def __init__(self, fail_after: int | None = None, fail_status: int = 503, refuse_all: bool = False):
        self.bodies: list[dict] = []
        self.fail_after = fail_after
        self.fail_status = fail_status
        self.refuse_all = refuse_all

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url == URL + "/chat/completions"
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.fail_after is not None and len(self.bodies) > self.fail_after:
            return httpx.Response(self.fail_status, json={"error": {"message": "engine overloaded"}})
        text = json.dumps(body["messages"])
        if self.refuse_all or "REFUSE" in text:
            return httpx.Response(400, json={"error": {"message": "This model's maximum context length is 8"}})
        content = reply_to(body["messages"])
        message = {"role": "assistant", "content": content, "reasoning": "thought " + content[3:9]}
        finish = "length" if "LONG" in text else "stop"
        return httpx.Response(200, json={"choices": [{"index": 0, "message": message, "finish_reason": finish}],
                                         "usage": {"completion_tokens": 5}})

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


@pytest.fixture
def dataset(tmp_path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


def options(data: Path, out: Path, **overrides) -> RegenerateOptions:
    generation = GenerationSettings(model="target", max_tokens=overrides.pop("max_tokens", 16), seed=3)
    return RegenerateOptions(data=str(data), output=out, url=URL, generation=generation, show_progress=False,
                             backoff_s=0.0, **{"concurrency": 3, "max_retries": 1, **overrides})


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_turn_is_asked_with_the_rewritten_turns_before_it(dataset, tmp_path):
    endpoint = Endpoint()
    summary = regenerate(options(dataset, tmp_path / "out.jsonl"), transport=endpoint.transport())
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert [row["id"] for row in rows] == [row["id"] for row in ROWS]  # input order, every other field kept
    assert rows[1]["score"] == 0.5 and "conversations" not in rows[1]
    assert rows[2]["tools"] == TOOLS
    for row, original in zip(rows, ROWS):
        normalize_row(row, "out")  # ds-capture run reads every row as is
        messages = row["messages"]
        source = normalize_row(original, "in")
        assert [m["role"] for m in messages] == [m["role"] for m in source]
        for j, (message, before) in enumerate(zip(messages, source)):
            if message["role"] != "assistant" or before.get("tool_calls"):
                assert message == before  # system, user, tool turns and tool-call turns as in the data
                continue
            assert message["content"] == reply_to(messages[:j])  # asked with the rewritten prefix
            assert message["reasoning_content"] == "thought " + message["content"][3:9]  # `reasoning` renamed
    # Every request: the prefix up to its turn, the settings, the row's tools.
    asked = {json.dumps(body["messages"]) for body in endpoint.bodies}
    assert len(asked) == len(endpoint.bodies) == summary.counts.turns == 2 + 1 + 1 + 1 + 0 + 7
    assert all((b["model"], b["max_tokens"], b["temperature"], b["seed"]) == ("target", 16, 0.0, 3)
               for b in endpoint.bodies)
    assert [b.get("tools") for b in endpoint.bodies if b["messages"][0]["content"] == "look it up"] == [TOOLS]
    counts = summary.counts
    assert (counts.rows, counts.refused, counts.cut, counts.kept_tool_turns, counts.tokens) == (12, 0, 1, 1, 60)
    # ASCII lines: a reply's U+2028 cannot split a line for NeMo (it splits as str.splitlines does).
    assert (tmp_path / "out.jsonl").read_bytes().isascii()
    assert dumps_line({"t": "a\u2028b\u0085"}) == b'{"t": "a\\u2028b\\u0085"}\n'
    assert "12 of 12 rows (12 turns rewritten, 1 cut at --max-tokens, 1 tool-call turns kept" in summary.format()


def test_a_killed_run_continues_to_the_same_bytes(dataset, tmp_path):
    reference = tmp_path / "reference.jsonl"
    regenerate(options(dataset, reference, concurrency=1), transport=Endpoint().transport())
    out = tmp_path / "out.jsonl"
    paths = OutputPaths(out)
    # The server fails after 6 answers (rows a..r0; e asks nothing): they stay recorded, OUT does not appear.
    with pytest.raises(ServerUnavailable) as failure:
        regenerate(options(dataset, out, concurrency=1), transport=Endpoint(fail_after=6).transport())
    message = str(failure.value)
    assert f"{URL}/chat/completions did not answer {dataset} line 7, message 2 after 2 attempt(s)" in message
    assert "HTTP 503: engine overloaded" in message
    assert f"6 of 12 rows are recorded in {paths.partial}; once the server answers again, rerun" in message
    assert not out.exists()
    # A kill mid-append leaves a torn last line: it is cut off and that row redone.
    with paths.partial.open("ab") as journal:
        journal.write(b'{"index": 7, "row": {"messages": [{"role": "us')
    endpoint = Endpoint()
    summary = regenerate(options(dataset, out, concurrency=4), transport=endpoint.transport())
    assert out.read_bytes() == reference.read_bytes()
    assert len(endpoint.bodies) == 12 - 6 and summary.new_rows == 6  # recorded rows were not asked again
    assert not paths.partial.exists() and not paths.assembling.exists()


def test_a_rerun_over_a_complete_output_changes_nothing(dataset, tmp_path):
    out = tmp_path / "out.jsonl"
    regenerate(options(dataset, out), transport=Endpoint().transport())
    before = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in tmp_path.iterdir()}
    silent = Endpoint(fail_after=0)
    summary = regenerate(options(dataset, out), transport=silent.transport())
    assert silent.bodies == [] and summary.already_complete
    assert "already complete with this input and these settings: nothing to do" in summary.format()
    assert {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in tmp_path.iterdir()} == before


def test_changed_input_or_settings_are_refused(dataset, tmp_path):
    out = tmp_path / "out.jsonl"
    with pytest.raises(ServerUnavailable):
        regenerate(options(dataset, out), transport=Endpoint(fail_after=3).transport())
    partial = OutputPaths(out).partial
    with pytest.raises(CaptureError, match=rf"{partial} holds an unfinished regenerate of other input or settings "
                                           r"\(max_tokens: was 16, now 8\)\. Rerun with the input and settings"):
        regenerate(options(dataset, out, max_tokens=8), transport=Endpoint().transport())
    dataset.write_text(dataset.read_text().replace("question 3", "question three"))
    with pytest.raises(CaptureError, match=r"\(input_rows_sha256: was '[0-9a-f]+', now '[0-9a-f]+'\)"):
        regenerate(options(dataset, out), transport=Endpoint().transport())
    partial.unlink()  # the documented way to start over
    regenerate(options(dataset, out), transport=Endpoint().transport())
    with pytest.raises(CaptureError, match=rf"{out} was regenerated from other input or settings \(max_tokens: was "
                                           r"16, now 8\)\. Choose another --output"):
        regenerate(options(dataset, out, max_tokens=8), transport=Endpoint().transport())
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text("{}\n")
    with pytest.raises(CaptureError, match="exists but has no readable foreign.jsonl.regenerate.json beside it"):
        regenerate(options(dataset, foreign), transport=Endpoint().transport())


def test_refused_rows_are_listed_and_left_out(dataset, tmp_path):
    rows = ROWS[:5] + [{"id": "bad", "messages": [{"role": "user", "content": "REFUSE me"},
                                                  {"role": "assistant", "content": "old"}]}] + ROWS[5:]
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out.jsonl"
    summary = regenerate(options(dataset, out), transport=Endpoint().transport())
    assert [row["id"] for row in read_jsonl(out)] == [row["id"] for row in rows if row["id"] != "bad"]
    assert read_jsonl(OutputPaths(out).refused) == [
        {"index": 5, "where": f"{dataset} line 6", "message": 2, "status": 400,
         "reason": "This model's maximum context length is 8"}]
    assert (summary.counts.rows, summary.counts.refused) == (12, 1)
    assert f"1 rows refused: {OutputPaths(out).refused})" in summary.format()


def test_refusing_every_request_is_a_wrong_setting_not_bad_rows(dataset, tmp_path):
    out = tmp_path / "out.jsonl"
    with pytest.raises(CaptureError, match=r"refused the first 8 requests of this run and answered none \(first: "
                                           r".* HTTP 400: This model's maximum context length is 8\)\. That is a "
                                           r"wrong --model or server setting"):
        regenerate(options(dataset, out), transport=Endpoint(refuse_all=True).transport())
    recorded = [json.loads(line) for line in OutputPaths(out).partial.read_text().splitlines()[1:]]
    assert [record["row"]["id"] for record in recorded] == ["e"]  # it asks nothing; no refusal was recorded


def test_retries_then_answers_and_wrong_urls_fail_at_once(dataset, tmp_path):
    flaky_calls = []

    def flaky(request: httpx.Request) -> httpx.Response:
        flaky_calls.append(request)
        if len(flaky_calls) % 2:  # every first attempt fails
            raise httpx.ConnectError("connection refused")
        return Endpoint()(request)

    summary = regenerate(options(dataset, tmp_path / "out.jsonl", concurrency=1), transport=httpx.MockTransport(flaky))
    assert summary.counts.rows == 12 and len(flaky_calls) == 2 * 12
    with pytest.raises(CaptureError, match=r"answered HTTP 404 for .* \(no such model\)\. Check --url .* and "
                                           r"--model 'target'") as error:
        regenerate(options(dataset, tmp_path / "other.jsonl"), transport=httpx.MockTransport(
            lambda request: httpx.Response(404, json={"detail": "no such model"})))
    assert not isinstance(error.value, ServerUnavailable)


def test_a_hanging_server_times_out(dataset, tmp_path):
    """A server that accepts and never answers: each request times out, the retries too, then the error."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                pass

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        hanging = RegenerateOptions(data=str(dataset), output=tmp_path / "out.jsonl", url=url, show_progress=False,
                                    generation=GenerationSettings(model="target"), concurrency=2, max_retries=1,
                                    timeout_s=0.3, backoff_s=0.0)
        with pytest.raises(ServerUnavailable, match=rf"{url}/chat/completions did not answer .* after 2 attempt\(s\) "
                                                    r"\(last: ReadTimeout"):
            regenerate(hanging)
    finally:
        stop.set()
        thread.join()
        for connection in accepted:
            connection.close()
        listener.close()


def test_rows_are_refused_with_runs_message_before_any_request(dataset, tmp_path):
    dataset.write_text(dataset.read_text() + json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(CaptureError) as run_refusal:
        open_dataset(str(dataset), split=None, shuffle_seed=42)
    endpoint = Endpoint()
    with pytest.raises(CaptureError) as refusal:
        regenerate(options(dataset, tmp_path / "out.jsonl"), transport=endpoint.transport())
    assert str(refusal.value) == str(run_refusal.value) and "line 13: message 1 has unknown role 'robot'" in str(
        refusal.value)
    assert endpoint.bodies == [] and not OutputPaths(tmp_path / "out.jsonl").partial.exists()


def test_cli_unreachable_server_one_line_and_exit_75(dataset, tmp_path, capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
    # Nothing listens on the port now (a bound, closed socket: connection refused).
    code = main(["regenerate", "--data", str(dataset), "--output", str(tmp_path / "out.jsonl"), "--url",
                 f"http://127.0.0.1:{port}/v1", "--model", "target", "--max-retries", "0", "--no-progress"])
    error = capsys.readouterr().err.strip()
    assert code == RERUN_EXIT_CODE
    assert error.startswith(f"ds-capture regenerate: error: http://127.0.0.1:{port}/v1/chat/completions did not "
                            f"answer {dataset} line 1, message 3 after 1 attempt(s) (last: ConnectError")
    assert "\n" not in error and "Traceback" not in error
    assert main(["regenerate", "--data", str(dataset), "--output", str(tmp_path / "out.json"), "--url", URL,
                 "--model", "target"]) == 2
    assert "the regenerated dataset is JSONL; name it with a .jsonl or .ndjson suffix" in capsys.readouterr().err


def test_a_second_run_on_the_same_output_is_refused(dataset, tmp_path):
    from ds_capture.regenerate.journal import Journal

    paths = OutputPaths(tmp_path / "out.jsonl")
    with Journal(paths, {"x": 1}, 3, {}):
        with pytest.raises(CaptureError, match="is held by another ds-capture regenerate"):
            Journal(paths, {"x": 1}, 3, {})


def test_a_failed_completion_record_leaves_no_tmp_behind(tmp_path, monkeypatch):
    """A rename that fails (a full or read-only filesystem) leaves neither the record nor its ``.tmp``; the journal
    stays, so a rerun finishes the output."""
    import os

    from ds_capture.regenerate.journal import Journal

    paths = OutputPaths(tmp_path / "out.jsonl")
    replace = os.replace

    def failing_replace(src, dst):
        if str(src).endswith(".regenerate.json.tmp"):
            raise OSError(30, "Read-only file system", str(dst))
        replace(src, dst)

    with Journal(paths, {"x": 1}, 1, {}) as journal:
        journal.record({"index": 0, "row": {"messages": []}, "turns": 1, "cut": 0, "kept_tool_turns": 0,
                        "tokens": 2})
        monkeypatch.setattr(os, "replace", failing_replace)
        with pytest.raises(OSError, match="Read-only file system"):
            journal.finish({"x": 1})
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out.jsonl.partial", "out.jsonl.tmp"]
