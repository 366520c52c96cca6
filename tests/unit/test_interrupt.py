"""interrupt: SIGTERM / SIGINT stop a run at the next micro-batch boundary, exit 75, and the rerun finishes the cache.

Single process here (no process group): the handler's two-signal rule, the vote's decision, and a real capture
signalled from inside its k-th forward (the lockstep of several ranks is ``tests/distributed/test_preemption.py``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import yaml

import ds_capture.runner as runner
from ds_capture.capture.interrupt import Interrupted, StopOnSignal, StopVote, _exit_for_rerun
from ds_capture.cli import main
from ds_capture.errors import RERUN_EXIT_CODE
from tests.unit.test_runner import capture, hash_cache


def test_first_signal_is_recorded_and_the_previous_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopOnSignal(announce=False) as stop:
        assert stop.received is None
        os.kill(os.getpid(), signal.SIGTERM)  # handled in this (main) thread before kill returns to Python code
        assert stop.received == signal.SIGTERM
        # The next one is the kernel's default action: the process would end at once.
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_second_signal_ends_the_process_at_once() -> None:
    pid = os.fork()
    if pid == 0:  # the child: two signals in a row never get back to Python
        try:
            with StopOnSignal(announce=False):
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
                os._exit(0)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT, status


def test_alone_the_vote_stops_at_the_step_after_the_signal() -> None:
    with StopOnSignal(announce=False) as stop:
        vote = StopVote(stop)
        assert [vote.should_stop() for _ in range(3)] == [False] * 3
        os.kill(os.getpid(), signal.SIGINT)
        assert vote.should_stop() and vote.reason() == "SIGINT on 1 of 1 rank"
        vote.close()


def test_outside_the_main_thread_no_handler_is_installed() -> None:
    import threading

    seen = []
    thread = threading.Thread(target=lambda: seen.append(StopOnSignal(announce=False).__enter__()._previous))
    thread.start()
    thread.join()
    assert seen == [{}]


@pytest.fixture(scope="module")
def reference(tiny_target, tmp_path_factory):
    """An uninterrupted capture (tiny qwen3, 10 demo rows: shards of 4, 4, 2 rows, 5 forwards of 2) and its args."""
    root = tmp_path_factory.mktemp("interrupt_reference")
    args = dict(target_model_name_or_path=str(tiny_target("qwen3")), train_data_path="demo:conversations",
                train_split="train[:10]", cache_output_dir=str(root / "cache"), seq_length=32, micro_batch_size=2,
                cache_shard_size=4, cache_dtype="fp32")
    capture(root, **args)
    return root / "cache", args


def signal_in_forward(monkeypatch, k: int, sig: int) -> list[int]:
    """Send ``sig`` to this process from inside its k-th forward (1-based); returns the forward count so far."""
    build_model, forwards = runner.build_model, []

    def build_and_arm(*args, **kwargs):
        model = build_model(*args, **kwargs)

        def count(*_):
            forwards.append(1)
            if len(forwards) == k:
                os.kill(os.getpid(), sig)

        model.register_forward_pre_hook(count)
        return model

    monkeypatch.setattr(runner, "build_model", build_and_arm)
    return forwards


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_run_stops_at_the_next_boundary_and_the_rerun_completes_the_same_bytes(
        reference, tmp_path: Path, monkeypatch, capfd, sig) -> None:
    cache, args = reference
    out = tmp_path / "cache"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"recipe_args": {**args, "cache_output_dir": str(out)}}))
    forwards = signal_in_forward(monkeypatch, 3, sig)  # the 3rd forward is shard 1's first micro-batch
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)

    try:
        code = main(["run", "-c", str(recipe), "--no-progress"])
        # After a stop, a further signal (a launcher ending the ranks still tearing down) still exits 75.
        assert signal.getsignal(signal.SIGTERM) is signal.getsignal(signal.SIGINT) is _exit_for_rerun
    finally:
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])

    err = capfd.readouterr().err
    assert code == RERUN_EXIT_CODE == 75
    # Stopped before the 4th forward: shard 0 (forwards 1-2) finished with its sidecar, shard 1 half done is gone.
    assert len(forwards) == 3
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-000000.safetensors"]
    assert (out / ".ds_capture" / "checksums" / "shard-000000.checksum").is_file()
    assert not list(out.rglob("*.tmp")) and not (out / ".ds_capture" / "lock").exists()
    name = signal.Signals(sig).name
    assert err.count("rerun the same command to continue") == 1, err
    assert f"stopped by {name} on 1 of 1 rank after 3 of 5 steps: 1 of 3 shards are finished" in err, err
    assert err.count(f"{name} received; stopping every rank") == 1, err

    monkeypatch.undo()
    summary = capture(tmp_path, **{**args, "cache_output_dir": str(out)})
    assert (summary.shards_written, summary.shards_skipped) == (2, 1)
    assert hash_cache(out) == hash_cache(cache)


def test_interrupted_is_a_system_exit_with_the_rerun_code() -> None:
    # Outside the CLI (a library caller) an uncaught stop still exits 75, and no `except Exception` swallows it.
    stop = Interrupted("stopped")
    assert isinstance(stop, SystemExit) and not isinstance(stop, Exception) and stop.code == RERUN_EXIT_CODE
