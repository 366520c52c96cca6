"""The service's HTTP side under load and faults, without a model: the real app, server and queue in this process,
a stand-in loop answering each request with its own tensors and the draft vocabulary it was given.

What is judged: draft vocabularies follow the trainer's host across new connections and never cross (two live ones
on a host: a 409 naming the fix); a mapping no one used for ``idle_s`` is forgotten; a full queue holds connections
(back-pressure) and refuses (503 with Retry-After) only past the hard limit; while the target loads a request waits
with its body unread and is answered once ready; once the service stops an unanswered request is dropped (a
connection error, which NeMo's client retries; never an error status); vocabularies kept in a store come back
after a restart; a client hanging up mid-body is one log line; a cancelled future is skipped, never a crash;
``close`` resolves taken jobs too; /metrics carries the histograms and the refusal counters; the start line lists
the ports the replicas bound (``--port 0``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from ds_capture.serve.app import HttpServer, ServiceState, build_app
from ds_capture.serve.vocabularies import VocabMappings
from ds_capture.serve.metrics import ServeMetrics
from ds_capture.serve.protocol import GenerateRequest
from ds_capture.serve.scheduler import Job, Scheduler, Stopping, resolve
from ds_capture.serve.supervision import VocabMapping
from ds_capture.serve.wire import decode, encode

pytestmark = pytest.mark.timeout(60)
VOCAB = 384


class FakeService:
    """The app over a :class:`Scheduler`, answered by a thread: ``{"input_ids", "draft_ids"}`` per request."""

    def __init__(self, *, vocab_idle_s: float = 60.0, vocab_store=None, clock=None, **scheduler) -> None:
        self.state = ServiceState(
            vocab_size=VOCAB, max_seq_length=64, max_rows=8, model_info={"vocab_size": VOCAB},
            embeddings=lambda: {"weight": torch.zeros(2, 2)}, scheduler=Scheduler(max_rows=8, **scheduler),
            metrics=ServeMetrics(), max_body_bytes=1 << 20, exit_on_disconnect=False, vocab_idle_s=vocab_idle_s,
            vocab_store=vocab_store)
        if clock is not None:  # the vocabularies' idle time on a clock the test moves (no sleeps, no timing race)
            self.state.mappings = VocabMappings(vocab_idle_s, clock=clock, store=vocab_store)
        self.server = HttpServer(build_app(self.state), "127.0.0.1", 0, on_close=self.state.mappings.closed)
        self.url = f"http://127.0.0.1:{self.server.port}"
        self.running = threading.Event()
        self.running.set()
        self._parked = threading.Event()
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._answer, daemon=True)

    def __enter__(self) -> "FakeService":
        self.server.start()
        self._loop.start()
        deadline = time.monotonic() + 20
        while not self.server.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        self.state.ready.set()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.running.set()
        self.state.stopping.set()
        self.state.ready.clear()
        self.state.scheduler.close("the service is stopping")
        self._loop.join(5)
        self.server.stop()

    def _answer(self) -> None:
        scheduler = self.state.scheduler
        while not self._stop.is_set():
            if not self.running.is_set():
                self._parked.set()
                self.running.wait()
                self._parked.clear()
            jobs = scheduler.take(0.02)
            for job in jobs:
                resolve(job.future, result={"input_ids": job.request.input_ids,
                                            "draft_ids": job.mapping.selected_token_ids})
            scheduler.done()

    def pause(self) -> None:
        """Until ``running.set()``: the loop takes nothing more (returns once it is parked, nothing in hand)."""
        self.running.clear()
        assert self._parked.wait(10)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _mapping(size: int) -> bytes:
    ids = torch.arange(size)
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[ids] = True
    return encode({"selected_token_ids": ids, "selected_token_mask": mask})


def _batch(rows: int = 1, length: int = 8, seed: int = 0) -> bytes:
    ids = torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))
    ones = torch.ones(rows, length, dtype=torch.long)
    return encode({"input_ids": ids, "attention_mask": ones, "loss_mask": ones})


def _client(service: FakeService, source: str = "127.0.0.1") -> httpx.Client:
    """A keep-alive connection (as NeMo's requests.Session keeps one) leaving from ``source``."""
    return httpx.Client(base_url=service.url, timeout=30,
                        transport=httpx.HTTPTransport(local_address=source))


def _draft(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(decode(response.content)["draft_ids"].numel())


def test_a_trainers_vocabulary_follows_it_across_new_connections():
    with FakeService() as service:
        with _client(service) as trainer:
            assert trainer.post("/set_vocab_mapping", content=_mapping(96)).status_code == 200
            assert _draft(trainer.post("/generate", content=_batch())) == 96
        # The keep-alive connection closed (a blip, a timeout's retry, a restart with the same vocabulary).
        for _ in range(3):
            with _client(service) as again:
                assert _draft(again.post("/generate", content=_batch())) == 96
        # Another host has none of its own: refused, never given this host's.
        with _client(service, "127.0.0.2") as other:
            refused = other.post("/generate", content=_batch())
            assert refused.status_code == 409 and "generate before set_vocab_mapping" in refused.json()["error"]


def test_two_live_vocabularies_on_one_host_never_cross():
    with FakeService() as service, _client(service) as first, _client(service) as second:
        assert first.post("/set_vocab_mapping", content=_mapping(96)).status_code == 200
        assert second.post("/set_vocab_mapping", content=_mapping(200)).status_code == 200
        for _ in range(2):  # each on its own connection gets its own
            assert _draft(first.post("/generate", content=_batch())) == 96
            assert _draft(second.post("/generate", content=_batch())) == 200
        with _client(service) as new:  # whose? a refusal naming the fix, not a guess
            refused = new.post("/generate", content=_batch())
        assert refused.status_code == 409, refused.text
        message = refused.json()["error"]
        assert "2 different draft vocabularies" in message and "one service per draft vocabulary" in message
        assert "its own source address" in message
        # A trainer on its own source address is served its own, also on a new connection.
        with _client(service, "127.0.0.3") as third:
            assert third.post("/set_vocab_mapping", content=_mapping(50)).status_code == 200
        with _client(service, "127.0.0.3") as third:
            assert _draft(third.post("/generate", content=_batch())) == 50
        assert service.metric('ds_capture_serve_refusals_total{reason="vocab_mapping_ambiguous"}') == 1


def test_a_dead_trainers_vocabulary_is_forgotten_after_idle_s():
    now = [0.0]
    with FakeService(vocab_idle_s=60, clock=lambda: now[0]) as service:
        with _client(service) as dead:  # SIGKILLed: its connection ends, no disconnect
            assert dead.post("/set_vocab_mapping", content=_mapping(96)).status_code == 200
        with _client(service) as replacement:  # another vocabulary at once: its own connection's
            assert replacement.post("/set_vocab_mapping", content=_mapping(200)).status_code == 200
            assert _draft(replacement.post("/generate", content=_batch())) == 200
            with _client(service) as new:
                assert new.post("/generate", content=_batch()).status_code == 409  # the dead one is still live
            now[0] += 61
            assert _draft(replacement.post("/generate", content=_batch())) == 200
            with _client(service) as new:  # the dead one is forgotten; the replacement's connection is open
                assert _draft(new.post("/generate", content=_batch())) == 200
        assert service.state.mappings.count() == 1


def test_disconnect_forgets_the_vocabulary_and_a_same_vocabulary_trainer_keeps_it():
    with FakeService() as service, _client(service) as one, _client(service) as two:
        for trainer in (one, two):
            assert trainer.post("/set_vocab_mapping", content=_mapping(96)).status_code == 200
        assert one.post("/disconnect", content=b"{}").status_code == 200
        assert _draft(two.post("/generate", content=_batch())) == 96  # the same vocabulary: one entry, still held
        assert two.post("/disconnect", content=b"{}").status_code == 200
        with _client(service) as late:
            assert late.post("/generate", content=_batch()).status_code == 409


def test_a_full_queue_holds_connections_and_refuses_only_past_the_hard_limit():
    with FakeService(max_queued_rows=2, hard_limit=5) as service:
        with _client(service) as setup:
            assert setup.post("/set_vocab_mapping", content=_mapping(96)).status_code == 200
        service.pause()  # the loop stalls: the queue fills
        with ThreadPoolExecutor(8) as pool:
            held = [pool.submit(httpx.post, f"{service.url}/generate", content=_batch(seed=i), timeout=30)
                    for i in range(5)]
            deadline = time.monotonic() + 10
            while service.state.scheduler.depth() + service.state.scheduler.held() < 5:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert service.state.scheduler.depth() == 2 and service.state.scheduler.held() == 3
            assert not any(future.done() for future in held)  # held, not refused
            assert service.metric("ds_capture_serve_held") == 3
            refused = httpx.post(f"{service.url}/generate", content=_batch(seed=9), timeout=30)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
            assert "over its hard limit" in refused.json()["error"]
            service.running.set()
            answers = [future.result(30) for future in held]
        assert [answer.status_code for answer in answers] == [200] * 5
        for i, answer in enumerate(answers):
            assert torch.equal(decode(answer.content)["input_ids"], decode(_batch(seed=i))["input_ids"])
        assert service.metric('ds_capture_serve_refusals_total{reason="queue_full"}') == 1


def _raw(port: int, head: bytes, body: bytes = b"", *, read: bool = True) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head + body)
        reply = b""
        while read and not (b"\r\n\r\n" in reply and reply.endswith(b"}")):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        return reply


def test_while_loading_a_request_waits_unread_and_is_answered_once_ready():
    """A trainer retrying into a (re)starting service: no error status (NeMo's client dies of one); the body stays
    unread until every rank loaded, then the request is answered."""
    with FakeService() as service, _client(service) as trainer:
        assert trainer.post("/set_vocab_mapping", content=_mapping(96)).status_code == 200  # needs no model
        service.state.ready.clear()
        body = _batch()
        with socket.create_connection(("127.0.0.1", service.server.port), timeout=10) as sock:
            # The head only: a service that read bodies while loading would wait here for the rest in vain.
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode())
            sock.settimeout(0.5)
            with pytest.raises(socket.timeout):
                sock.recv(1)  # nothing answered while loading
            assert service.metric("ds_capture_serve_refusals_total") == 0
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(trainer.post, "/generate", content=body)
            time.sleep(0.3)
            assert not waiting.done()
            service.state.ready.set()
            assert _draft(waiting.result(10)) == 96


def test_once_stopping_an_unanswered_request_is_dropped_not_refused():
    """Queued when the service stops, or sent while it stops: the connection is reset without a status, which
    NeMo's client (requests) raises as ConnectionError and retries; a 503 would end the trainer."""
    import requests

    with FakeService() as service, _client(service) as trainer:
        assert trainer.post("/set_vocab_mapping", content=_mapping(96)).status_code == 200
        service.pause()  # the loop takes nothing: the request waits in the queue
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(trainer.post, "/generate", content=_batch())
            deadline = time.monotonic() + 5
            while service.state.scheduler.depth() == 0:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            service.state.stopping.set()
            service.state.ready.clear()
            service.state.scheduler.close("the service is stopping")
            with pytest.raises(httpx.TransportError):
                queued.result(10)
        with pytest.raises(requests.ConnectionError):  # what NeMo's client catches and retries
            requests.post(f"{service.url}/generate", data=_batch(), timeout=10)
        assert service.metric('ds_capture_serve_refusals_total{reason="stopping"}') == 2


def test_vocabularies_kept_in_a_store_come_back_after_a_restart(tmp_path):
    """A trainer riding through a restart (a requeue) keeps its vocabulary: the new service restores it from the
    store and gives it to the trainer's new connection; a disconnect forgets it, on disk too."""
    from ds_capture.serve.protocol import parse_vocab_mapping

    with FakeService(vocab_store=tmp_path) as first, _client(first) as trainer:
        assert trainer.post("/set_vocab_mapping", content=_mapping(96)).status_code == 200
    (kept,) = tmp_path.glob("*.vocab")
    assert kept.name.startswith("127.0.0.1-") and kept.read_bytes() == _mapping(96)
    with FakeService(vocab_store=tmp_path) as second:
        assert second.state.mappings.restore(lambda raw: parse_vocab_mapping(raw, vocab_size=VOCAB)) == 1
        with _client(second) as trainer:  # a new connection that set nothing: its host's one restored vocabulary
            assert _draft(trainer.post("/generate", content=_batch())) == 96
            assert trainer.post("/disconnect", content=b"{}").status_code == 200
    assert list(tmp_path.glob("*.vocab")) == []
    (tmp_path / "127.0.0.1-0123.vocab").write_bytes(b"not a mapping")
    with FakeService(vocab_store=tmp_path) as third:
        assert third.state.mappings.restore(lambda raw: parse_vocab_mapping(raw, vocab_size=VOCAB)) == 0
    assert [path.name for path in tmp_path.iterdir()] == ["127.0.0.1-0123.vocab.bad"]


def test_a_client_hanging_up_mid_body_is_one_log_line(caplog):
    with FakeService() as service, caplog.at_level(logging.WARNING):
        body = _batch()
        _raw(service.server.port, b"POST /generate HTTP/1.1\r\nHost: x\r\n"
             + f"Content-Length: {len(body)}\r\n\r\n".encode(), body[:10], read=False)
        deadline = time.monotonic() + 5
        while service.metric('ds_capture_serve_refusals_total{reason="client_gone"}') < 1:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
        with _client(service) as next_client:
            assert next_client.post("/set_vocab_mapping", content=_mapping(96)).status_code == 200
            assert _draft(next_client.post("/generate", content=_batch())) == 96
    lines = [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(lines) == 1 and "hung up after 10 bytes of its body" in lines[0].getMessage(), caplog.text
    assert "Traceback" not in caplog.text and lines[0].exc_info is None


def _job(rows: int = 1) -> Job:
    ids = torch.zeros(rows, 4, dtype=torch.long)
    mapping = VocabMapping(torch.arange(4), torch.ones(4, dtype=torch.bool))
    return Job(request=GenerateRequest(ids, ids + 1, ids + 1), mapping=mapping, nbytes=100)


def test_a_cancelled_future_is_skipped_never_raised():
    scheduler = Scheduler(max_rows=8)
    cancelled, kept = _job(), _job()
    scheduler.submit(cancelled)
    scheduler.submit(kept)
    assert cancelled.future.cancel()  # what a middleware or a graceful-shutdown timeout would do
    assert scheduler.take(0.01) == [kept] and scheduler.depth() == 0
    assert not kept.future.cancel()  # taken: running, no longer cancellable
    assert resolve(cancelled.future, result={"x": 1}) is False  # the loop answering it: nothing raised
    assert resolve(kept.future, result={"x": 1}) and kept.future.result() == {"x": 1}
    assert resolve(kept.future, error=RuntimeError("late")) is False  # resolved once
    scheduler.done()
    # A job cancelled after it was taken (set_running_or_notify_cancel was called: cancel() is refused).
    late = _job()
    scheduler.submit(late)
    assert scheduler.take(0.01) == [late]
    assert late.future.cancel() is False and resolve(late.future, result=1) and late.future.result() == 1


def test_close_resolves_queued_and_taken_jobs():
    scheduler = Scheduler(max_rows=8)
    taken, queued = _job(), _job()
    scheduler.submit(taken)
    assert scheduler.take(0.01) == [taken]
    scheduler.submit(queued)
    scheduler.close("the service is stopping")
    for job in (taken, queued):
        with pytest.raises(Stopping, match="the service is stopping"):
            job.future.result(0)
    assert scheduler.try_admit(_job()).exception(0).args == ("the service is stopping",)


def test_batching_is_opt_in():
    alone, batched = Scheduler(max_rows=8), Scheduler(max_rows=8, batch=True)
    for scheduler in (alone, batched):
        for _ in range(3):
            scheduler.submit(_job())
    assert len(alone.take(0.01)) == 1 and len(batched.take(0.01)) == 3


def test_metrics_have_histograms_and_refusal_counters():
    with FakeService() as service, _client(service) as trainer:
        assert trainer.post("/set_vocab_mapping", content=_mapping(96)).status_code == 200
        assert trainer.post("/generate", content=_batch()).status_code == 200
        text = trainer.get("/metrics").text
    for name in ("ds_capture_serve_request_seconds_bucket", "ds_capture_serve_queue_wait_seconds_bucket",
                 "ds_capture_serve_forward_time_seconds_bucket", "ds_capture_serve_batch_rows_bucket",
                 'ds_capture_serve_refusals_total{reason="queue_full"} 0.0',
                 'ds_capture_serve_refusals_total{reason="stopping"} 0.0'):
        assert name in text, name
    assert 'ds_capture_serve_request_seconds_count 1.0' in text


def test_connections_reset_by_clients_are_freed():
    """Clients that close with part of the answer unread (the kernel then resets the connection): uvicorn 0.55
    kept each one's protocol, request and buffers alive for the keep-alive hour (RSS grew under hostile clients);
    here every one is freed at once."""
    import gc

    def alive() -> int:
        gc.collect()
        return sum(type(o).__name__ == "ConnectionTracking" for o in gc.get_objects())

    with FakeService() as service:
        for _ in range(20):
            _raw(service.server.port, b"POST /heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", read=0)
            with socket.create_connection(("127.0.0.1", service.server.port), timeout=5) as sock:
                sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nxyz")
                sock.recv(10)  # the rest of the 400 unread: closing resets the connection
        deadline = time.monotonic() + 10
        while alive() > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert alive() == 0


def test_the_start_line_lists_the_ports_every_replica_bound(caplog):
    """Under ``--port 0`` each replica's listener binds a free port of its own: the start line lists those, not
    ``port + replica`` of its own port."""
    from types import SimpleNamespace

    from ds_capture.serve.loop import ServeOptions, _announce

    plan = SimpleNamespace(rank=1, dp_rank=1, dp_size=2, world_size=2, tp_size=1, ep_size=1)
    session = SimpleNamespace(target=SimpleNamespace(path="target", vocab_size=VOCAB), plan=plan, layer_ids=[1, 2])
    service = FakeService()
    try:
        with caplog.at_level(logging.WARNING, logger="ds_capture"):
            _announce(service.state, session, ServeOptions(port=0), [40007, 40001])
    finally:
        service.server.sock.close()
    assert service.state.ready.is_set()
    (line,) = [record.getMessage() for record in caplog.records]
    assert "replica 1 of 2 on http://127.0.0.1:40001" in line, line
    assert line.endswith("remote_urls: [http://127.0.0.1:40007, http://127.0.0.1:40001]"), line


def test_a_request_head_is_bounded():
    """httptools sets no bound on a request's head: past 64 KiB of URL and headers a request gets 400, and a header
    that never ends is cut; a 20 KB header is served."""
    def first_line(head: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", service.server.port), timeout=10) as sock:
            sock.sendall(head)
            return sock.recv(64).split(b"\r\n")[0]

    with FakeService() as service:
        get = b"GET /health HTTP/1.1\r\nHost: x\r\n"
        assert first_line(get + b"X: " + b"a" * 20_000 + b"\r\n\r\n") == b"HTTP/1.1 200 OK"
        assert first_line(get + b"X: " + b"a" * 200_000 + b"\r\n\r\n") == b"HTTP/1.1 400 Bad Request"
        many = b"".join(b"X%d: %s\r\n" % (i, b"a" * 1000) for i in range(100))
        assert first_line(get + many + b"\r\n") == b"HTTP/1.1 400 Bad Request"
        with socket.create_connection(("127.0.0.1", service.server.port), timeout=10) as sock:
            sock.sendall(get + b"X: ")
            for _ in range(200):  # 2 MB of one header value, never ended
                try:
                    sock.sendall(b"a" * 10_000)
                except OSError:
                    break
            reply = sock.recv(64)
        assert reply.split(b"\r\n")[0] == b"HTTP/1.1 400 Bad Request"
        assert first_line(get + b"\r\n") == b"HTTP/1.1 200 OK"  # the service goes on
