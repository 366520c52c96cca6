"""``ds-capture regenerate`` against a real OpenAI-compatible server: ``transformers serve`` (transformers' own,
nobody here wrote it) serving the demo target on CPU, greedy decoding.

The acceptance points of the regenerate step: the regenerated turns equal direct requests to the same server for
the same prefixes; SIGKILL mid-way and a rerun give the bytes of an uninterrupted run (and a changed setting over
the unfinished output is refused); the server stopped mid-way gives one line naming the URL and the row, exit 75,
and a rerun after its restart completes to the same bytes; ``ds-capture run`` captures the regenerated dataset
and ``ds-capture verify`` says OK.

Interruptions happen at a known point: a transport around httpx's own holds every request after the first few
(the requests themselves go over the network to the real server).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from ds_capture.cli import main
from ds_capture.demo import demo_data_path
from ds_capture.errors import RERUN_EXIT_CODE
from ds_capture.regenerate import driver
from ds_capture.regenerate.client import GenerationSettings
from ds_capture.regenerate.driver import RegenerateOptions
from ds_capture.regenerate.journal import OutputPaths

SPLIT = "train[:10]"  # demo rows 1-10: one to four assistant turns, some with reasoning_content
MAX_TOKENS = 12
WAIT_S = 120.0  # bound on every wait for another process or thread (a loaded box), never a timing assertion


def command(server, out: Path, *extra: str) -> list[str]:
    return ["regenerate", "--data", "demo:conversations", "--split", SPLIT, "--output", str(out), "--url",
            server.url, "--model", server.model, "--max-tokens", str(MAX_TOKENS), "--concurrency", "2",
            "--max-retries", "1", "--no-progress", *extra]


class Gate(httpx.AsyncBaseTransport):
    """httpx's network transport, holding every request after the first ``open_for`` until ``release`` is set."""

    def __init__(self, open_for: int) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.open_for = open_for
        self.sent = 0
        self.reached = threading.Event()
        self.release = threading.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        if self.sent > self.open_for and not self.release.is_set():
            self.reached.set()
            await asyncio.to_thread(self.release.wait)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def recorded_rows(out: Path) -> int:
    partial = OutputPaths(out).partial
    return max(0, partial.read_bytes().count(b"\n") - 1) if partial.exists() else 0


@pytest.fixture(scope="module")
def reference(served_demo_target, tmp_path_factory) -> Path:
    """The uninterrupted run, through the CLI."""
    out = tmp_path_factory.mktemp("regenerate_reference") / "demo_regenerated.jsonl"
    assert main(command(served_demo_target, out, "--concurrency", "4")) == 0
    return out


def test_greedy_turns_equal_direct_requests(served_demo_target, reference):
    source = [json.loads(line) for line in demo_data_path().read_text().splitlines()[:10]]
    rows = [json.loads(line) for line in reference.read_text().splitlines()]
    assert len(rows) == len(source) == 10
    finish_reasons, tokens = [], 0
    with httpx.Client(timeout=WAIT_S) as client:
        for row, original in zip(rows, source):
            assert [m["role"] for m in row["messages"]] == [m["role"] for m in original["messages"]]
            for j, message in enumerate(row["messages"]):
                if message["role"] != "assistant":
                    assert message == original["messages"][j]
                    continue
                direct = client.post(served_demo_target.url + "/chat/completions", json={
                    "model": served_demo_target.model, "messages": row["messages"][:j], "max_tokens": MAX_TOKENS,
                    "temperature": 0.0}).json()
                # The whole turn is the server's: its content, and no reasoning_content of the dataset's.
                assert message == {"role": "assistant", "content": direct["choices"][0]["message"]["content"]}
                assert message != original["messages"][j]
                finish_reasons.append(direct["choices"][0]["finish_reason"])
                tokens += direct["usage"]["completion_tokens"]
    counts = json.loads(OutputPaths(reference).record.read_text())["counts"]
    assert counts == {"rows": 10, "refused": 0, "turns": len(finish_reasons), "cut": finish_reasons.count("length"),
                      "kept_tool_turns": 0, "tokens": tokens}


def test_sigkill_mid_way_then_rerun_equals_uninterrupted(served_demo_target, reference, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    options = RegenerateOptions(
        data=str(demo_data_path()), split=SPLIT, output=out, url=served_demo_target.url, concurrency=2,
        generation=GenerationSettings(model=served_demo_target.model, max_tokens=MAX_TOKENS), show_progress=False)
    child = os.fork()
    if child == 0:  # the run, held after 5 requests until it is killed
        try:
            driver.regenerate(options, transport=Gate(open_for=5))
        finally:
            os._exit(1)
    try:
        deadline = time.monotonic() + WAIT_S
        while recorded_rows(out) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert 2 <= recorded_rows(out) < 10 and not out.exists()
    capsys.readouterr()
    assert main(command(served_demo_target, out, "--max-tokens", "13")) == 2
    error = capsys.readouterr().err
    assert "holds an unfinished regenerate of other input or settings (max_tokens: was 12, now 13)" in error
    assert main(command(served_demo_target, out)) == 0
    assert out.read_bytes() == reference.read_bytes()
    assert not OutputPaths(out).partial.exists()


@pytest.mark.slow  # CI cut: tests/unit/test_regenerate.py covers an unreachable server (exit 75, nothing lost)
def test_server_stopped_mid_way_then_rerun_after_restart(served_demo_target, reference, tmp_path, capsys,
                                                         monkeypatch):
    out = tmp_path / "out.jsonl"
    gate = Gate(open_for=4)
    monkeypatch.setattr(driver, "regenerate", functools.partial(driver.regenerate, transport=gate))
    stopped_url = served_demo_target.url
    codes: list[int] = []
    run = threading.Thread(target=lambda: codes.append(main(command(served_demo_target, out))))
    run.start()
    try:
        assert gate.reached.wait(WAIT_S), "the run never sent its fifth request"
        served_demo_target.stop()
    finally:
        gate.release.set()
        run.join(WAIT_S)
        if served_demo_target.pid is None:
            served_demo_target.start()  # for this test's rerun and the tests after it
    assert not run.is_alive() and codes == [RERUN_EXIT_CODE]
    error = capsys.readouterr().err.strip()
    recorded = recorded_rows(out)
    assert "\n" not in error and "Traceback" not in error and 1 <= recorded < 10
    assert error.startswith(f"ds-capture regenerate: error: {stopped_url}/chat/completions did not answer "
                            f"{demo_data_path()} line ")
    assert "after 2 attempt(s) (last: " in error
    assert error.endswith(f"{recorded} of 10 rows are recorded in {OutputPaths(out).partial}; once the server "
                          "answers again, rerun the same command to continue.")
    monkeypatch.undo()
    assert main(command(served_demo_target, out)) == 0  # the restarted server, on its new URL
    assert out.read_bytes() == reference.read_bytes()


def test_regenerated_dataset_is_captured_and_verifies(reference, write_recipe, tmp_path, capsys):
    cache = tmp_path / "cache"
    recipe = write_recipe({"recipe_args": {
        "target_model_name_or_path": "demo:qwen3_moe_tiny", "train_data_path": str(reference),
        "cache_output_dir": str(cache), "seq_length": 128, "micro_batch_size": 2, "cache_shard_size": 4,
        "cache_dtype": "fp32"}})
    assert main(["run", "-c", str(recipe), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["verify", str(cache)]) == 0
    assert f"{cache}: OK: 10 samples in 3/3 shards checked" in capsys.readouterr().out
    manifest = json.loads((cache / "manifest.json").read_text())
    assert (manifest["train_data_path"], manifest["num_samples"], manifest["complete"]) == (str(reference), 10, True)
