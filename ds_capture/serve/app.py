"""The HTTP side of the service (each replica's first rank): NeMo's endpoints, health, metrics, client limits.

In: requests on ``host:port`` (FastAPI routes served by uvicorn in a thread of the replica's first rank). Out:
NeMo 0.7.0's answers (``{"status": "ok"}`` JSON, wire blobs) and, for a request it refuses, a 4xx JSON
``{"error": "..."}`` naming the problem; the next request is served as if nothing happened. ``generate`` hands a :class:`~ds_capture.serve.
scheduler.Job` to the lockstep loop and waits for its future; everything else is answered here.

Limits: a body larger than ``max_body_bytes`` is refused (413) before it is read whole; while the target loads a
request waits, its body unread, until every rank loaded (NeMo's client dies of an error status; its timeout is
retried); once the service stops or fails, a request not answered is dropped without a status (the connection is
reset), which NeMo's client retries against the restarted service. A client that hangs up mid-body costs one log
line, and one that hangs up mid-reply only its own answer. ``generate`` is admitted through the bounded queue
(:class:`~ds_capture.serve.scheduler.Scheduler`): a full queue holds the connection (back-pressure), and only past
the hard limit is a request refused (503 with ``Retry-After``).

Draft vocabularies (:class:`VocabMappings`): NeMo 0.7.0's client sends no trainer identity (a ``requests.Session``
per URL; headers ``Content-Type`` and requests' defaults), and the TCP source port changes with every new
connection. So a vocabulary is bound to the connection that set it, and a new connection (a keep-alive close, a
retry, a restarted trainer) gets its host's one live vocabulary; with two different live ones on the host it is
refused (409, naming the fix), never given the other trainer's. With a ``store`` directory each vocabulary is also
kept on disk (the ``set_vocab_mapping`` body) and restored when a restarted service becomes ready, live for
``idle_s``: a trainer riding through a restart (``launch/slurm.sbatch``'s requeue) keeps its vocabulary.
"""

import asyncio
import hashlib
import itertools
import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from ds_capture.durable import write_atomic
from ds_capture.errors import CaptureError
from ds_capture.serve.metrics import CONTENT_TYPE, ServeMetrics
from ds_capture.serve.protocol import BadRequest, parse_generate, parse_vocab_mapping
from ds_capture.serve.scheduler import Job, QueueFull, Scheduler, Stopping
from ds_capture.serve.supervision import VocabMapping
from ds_capture.serve.wire import encode, encode_view

OK = b'{"status": "ok"}'
RETRY_AFTER_S = 5
CONNECTION_KEY = "ds_capture.connection"
"""The ASGI scope key carrying the id of the TCP connection a request came on (:class:`HttpServer`'s protocol)."""
ABORT_KEY = "ds_capture.abort"
"""The ASGI scope key carrying a callable that resets the request's TCP connection (no answer is sent)."""
VOCAB_SUFFIX = ".vocab"
_LOG = logging.getLogger("ds_capture")


class _Entry:
    __slots__ = ("mapping", "used", "owners", "file")

    def __init__(self, mapping: VocabMapping, used: float, file: Path | None = None) -> None:
        self.mapping, self.used, self.owners, self.file = mapping, used, set(), file

    def forget_file(self) -> None:
        if self.file is not None:
            self.file.unlink(missing_ok=True)
            self.file = None


class VocabMappings:
    """The trainers' draft vocabularies: exact per connection, shared per client host (module docstring).

    A ``set_vocab_mapping`` on a connection binds that connection to the mapping (replacing what the connection
    set before; equal mappings on one host are one entry). A ``generate`` on a bound connection gets its own
    mapping. On a connection that set none (a trainer's keep-alive connection replaced after a blip, a timeout's
    retry, a restart with the same vocabulary), it gets the host's one *live* mapping and is bound to it; with two
    or more live mappings on the host it is refused (409, naming the fix), never given a guess. A mapping is live
    while a connection bound to it is open or a request used it within ``idle_s``; one that is neither is
    forgotten. ``disconnect`` unbinds the connection (its mapping is forgotten when nothing else holds it).
    """

    def __init__(self, idle_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 store: Path | None = None) -> None:
        self.idle_s = idle_s
        self._clock = clock
        self.store = store
        self._hosts: dict[str, list[_Entry]] = {}
        self._bound: dict[object, _Entry] = {}  # connection -> its entry
        self._lock = threading.Lock()

    def _live(self, host: str, now: float) -> list[_Entry]:
        """The host's live entries; the others are forgotten here."""
        entries = self._hosts.get(host, [])
        live = [entry for entry in entries if entry.owners or now - entry.used < self.idle_s]
        for entry in entries:
            if entry not in live:
                entry.forget_file()
        if live:
            self._hosts[host] = live
        else:
            self._hosts.pop(host, None)
        return live

    def _bind(self, connection: object, entry: _Entry) -> None:
        old = self._bound.get(connection)
        if old is not None:
            old.owners.discard(connection)
        if connection is not None:
            entry.owners.add(connection)
            self._bound[connection] = entry

    def set(self, host: str, connection: object, mapping: VocabMapping, raw: bytes | None = None) -> None:
        """Bind ``connection`` to ``mapping`` (``raw``: its request body, kept in ``store`` when there is one)."""
        with self._lock:
            now = self._clock()
            old = self._bound.pop(connection, None)
            if old is not None:
                old.owners.discard(connection)
                if not old.owners:
                    old.used = -float("inf")  # what this connection set before is replaced
            entries = self._live(host, now)
            entry = next((entry for entry in entries if entry.mapping.same_as(mapping)), None)
            if entry is None:
                entry = _Entry(mapping, now, self._keep(host, raw))
                self._hosts.setdefault(host, []).append(entry)
            entry.used = now
            self._bind(connection, entry)

    def get(self, host: str, connection: object) -> VocabMapping:
        with self._lock:
            now = self._clock()
            entry = self._bound.get(connection)
            if entry is not None:
                entry.used = now
                return entry.mapping
            live = self._live(host, now)
            if len(live) == 1:
                live[0].used = now
                self._bind(connection, live[0])
                return live[0].mapping
        if not live:
            raise BadRequest(409, "generate before set_vocab_mapping: the trainer must send its draft vocabulary "
                                  f"first (RemoteEagle3TargetModel.set_vocab_mapping; none live from host {host})",
                             reason="no_vocab_mapping")
        raise BadRequest(409, f"generate on a new connection from host {host}, where {len(live)} different draft "
                              "vocabularies are in use: NeMo's client sends no trainer identity, so this service "
                              "cannot tell whose request this is. Run one service per draft vocabulary, or give "
                              "each trainer on a host its own source address; a vocabulary is forgotten "
                              f"{self.idle_s:g} s after its trainer's last request and connection (--vocab-idle-s)",
                         reason="vocab_mapping_ambiguous")

    def closed(self, connection: object) -> None:
        """The connection ended (its mapping stays live for ``idle_s`` after its last use)."""
        with self._lock:
            entry = self._bound.pop(connection, None)
            if entry is not None:
                entry.owners.discard(connection)

    def disconnect(self, host: str, connection: object) -> None:
        """NeMo's ``disconnect``: the trainer is done with its mapping."""
        with self._lock:
            entry = self._bound.pop(connection, None)
            if entry is None:
                live = self._live(host, self._clock())
                entry = live[0] if len(live) == 1 else None
            if entry is not None:
                entry.owners.discard(connection)
                if not entry.owners:
                    entry.used = -float("inf")
                    entry.forget_file()

    def _keep(self, host: str, raw: bytes | None) -> Path | None:
        """``raw`` written to ``store`` as ``<host>-<digest>.vocab`` (None without a store)."""
        if self.store is None or raw is None:
            return None
        self.store.mkdir(parents=True, exist_ok=True)
        path = self.store / f"{host.replace(':', '_')}-{hashlib.sha256(raw).hexdigest()[:16]}{VOCAB_SUFFIX}"
        write_atomic(path, lambda tmp: tmp.write_bytes(raw))
        return path

    def restore(self, parse: Callable[[bytes], VocabMapping]) -> int:
        """The vocabularies kept in ``store`` by a previous run of this replica, each live for ``idle_s`` from now
        (a file that no longer parses is set aside, with one log line); returns how many."""
        if self.store is None or not self.store.is_dir():
            return 0
        restored = 0
        with self._lock:
            now = self._clock()
            for path in sorted(self.store.glob(f"*{VOCAB_SUFFIX}")):
                host = path.name[: -len(VOCAB_SUFFIX)].rsplit("-", 1)[0]
                try:
                    mapping = parse(path.read_bytes())
                except (BadRequest, OSError) as error:
                    _LOG.warning("ds-capture serve: %s is not a draft vocabulary (%s); set aside as %s.bad", path,
                                 getattr(error, "message", error), path.name)
                    path.replace(path.with_name(path.name + ".bad"))
                    continue
                entries = self._hosts.setdefault(host, [])
                if not any(entry.mapping.same_as(mapping) for entry in entries):
                    entries.append(_Entry(mapping, now, path))
                    restored += 1
        return restored

    def count(self) -> int:
        with self._lock:
            return sum(len(entries) for entries in self._hosts.values())


class ServiceState:
    """What the HTTP threads share with the loop: readiness, the draft vocabularies, the queue, the counters."""

    def __init__(self, *, vocab_size: int, max_seq_length: int, max_rows: int, model_info: dict,
                 embeddings: Callable[[], dict], scheduler: Scheduler, metrics: ServeMetrics,
                 max_body_bytes: int, exit_on_disconnect: bool, vocab_idle_s: float = 60.0,
                 vocab_store: Path | None = None) -> None:
        self.vocab_size = vocab_size
        self.max_seq_length = max_seq_length
        self.max_rows = max_rows
        self.model_info = model_info
        self._embeddings = embeddings
        self._embeddings_body: bytes | None = None
        self.scheduler = scheduler
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.exit_on_disconnect = exit_on_disconnect
        self.ready = threading.Event()
        """Set once every rank loaded the target; cleared when the service stops."""
        self.stopping = threading.Event()
        """Set when the service stops or fails: requests not answered are dropped (NeMo's client retries)."""
        self.disconnected = threading.Event()
        """A client said ``disconnect`` (the loop stops on it only with ``exit_on_disconnect``)."""
        self.mappings = VocabMappings(vocab_idle_s, store=vocab_store)
        self._lock = threading.Lock()

    def embeddings_body(self) -> bytes:
        with self._lock:
            if self._embeddings_body is None:
                self._embeddings_body = encode(self._embeddings())
            return self._embeddings_body


class ClientGone(Exception):
    """The client hung up before its body was read whole."""


class Dropped(Exception):
    """The service stops or failed before answering: the connection is reset, no status sent (NeMo's client retries
    a connection error; it dies of an error status)."""


def build_app(state: ServiceState):
    """The FastAPI application over ``state``."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import ClientDisconnect

    app = FastAPI(title="ds-capture serve", docs_url=None, redoc_url=None, openapi_url=None)

    def error(endpoint: str, status: int, message: str, reason: str, headers: dict | None = None) -> Response:
        state.metrics.count_request(endpoint, status)
        state.metrics.refuse(reason)
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    def answer(endpoint: str, body: bytes, media_type: str = "application/json") -> Response:
        state.metrics.count_request(endpoint, 200)
        return Response(body, media_type=media_type)

    async def read_body(request: Request, endpoint: str) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > state.max_body_bytes:
            raise BadRequest(413, f"{endpoint}: body of {int(declared):,} bytes exceeds this service's limit of "
                                  f"{state.max_body_bytes:,} (--max-body-mib)")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > state.max_body_bytes:
                    raise BadRequest(413, f"{endpoint}: body exceeds this service's limit of "
                                          f"{state.max_body_bytes:,} bytes (--max-body-mib)")
                chunks.append(chunk)
        except ClientDisconnect as gone:
            raise ClientGone(f"{endpoint}: {host_of(request)} hung up after {size:,} bytes of its body") from gone
        return b"".join(chunks)

    def host_of(request: Request) -> str:
        return request.client.host if request.client else "unknown"

    def connection_of(request: Request) -> object:
        return request.scope.get(CONNECTION_KEY)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> Response:
        return error(request.url.path.lstrip("/"), exc.status, exc.message, exc.reason, exc.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        _LOG.warning("ds-capture serve: %s (nothing answered)", exc)  # one line, no traceback
        state.metrics.refuse("client_gone")
        return Response(status_code=400)  # nobody reads it

    @app.exception_handler(Dropped)
    async def dropped(request: Request, exc: Dropped) -> Response:
        abort = request.scope.get(ABORT_KEY)
        if abort is not None:
            abort()
        state.metrics.refuse("stopping")
        return Response(status_code=503)  # not sent: the connection is gone

    @app.get("/health")
    async def health() -> Response:
        if not state.ready.is_set():
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return Response(OK, media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.queue_depth.set(state.scheduler.depth())
        state.metrics.held.set(state.scheduler.held())
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    async def wait_ready() -> None:
        """Before the body is read: while the target loads the request waits (the client's timeout is retried);
        once the service stops it is dropped."""
        while not state.ready.is_set():
            if state.stopping.is_set():
                raise Dropped()
            await asyncio.sleep(0.02)
        if state.stopping.is_set():
            raise Dropped()

    @app.post("/model_info")
    async def model_info(request: Request) -> Response:
        await wait_ready()
        await read_body(request, "model_info")
        return answer("model_info", json.dumps(state.model_info).encode())

    @app.post("/input_embeddings")
    async def input_embeddings(request: Request) -> Response:
        await wait_ready()
        await read_body(request, "input_embeddings")
        body = await run_in_threadpool(state.embeddings_body)
        return answer("input_embeddings", body, "application/octet-stream")

    @app.post("/set_vocab_mapping")
    async def set_vocab_mapping(request: Request) -> Response:
        raw = await read_body(request, "set_vocab_mapping")
        mapping = await run_in_threadpool(parse_vocab_mapping, raw, vocab_size=state.vocab_size)
        await run_in_threadpool(state.mappings.set, host_of(request), connection_of(request), mapping, raw)
        return answer("set_vocab_mapping", OK)

    async def admit(job: Job):
        """The job's future once the queue has room: the connection is held meanwhile (back-pressure)."""
        scheduler = state.scheduler
        try:
            scheduler.hold(job.nbytes)
        except QueueFull as full:
            raise BadRequest(503, f"generate: the service is over its hard limit ({full}); retry after "
                                  f"{RETRY_AFTER_S} s", reason="queue_full",
                             headers={"Retry-After": str(RETRY_AFTER_S)}) from full
        try:
            while True:
                future = scheduler.try_admit(job)
                if future is not None:
                    return future
                await asyncio.sleep(0.005)
        finally:
            scheduler.unhold(job.nbytes)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        started = time.perf_counter()
        await wait_ready()
        raw = await read_body(request, "generate")
        parsed = await run_in_threadpool(parse_generate, raw, vocab_size=state.vocab_size,
                                         max_seq_length=state.max_seq_length, max_rows=state.max_rows)
        mapping = state.mappings.get(host_of(request), connection_of(request))
        future = await admit(Job(request=parsed, mapping=mapping, nbytes=len(raw)))
        del raw
        state.metrics.queue_depth.set(state.scheduler.depth())
        state.metrics.in_flight.inc()
        try:
            result = await asyncio.wrap_future(future)
        except Stopping as stopped:
            raise Dropped() from stopped
        except Exception as failed:  # noqa: BLE001 - this request's answer failed; the client hears why
            return error("generate", 500, f"generate: {type(failed).__name__}: {failed}", "failed")
        finally:
            state.metrics.in_flight.dec()
        body = await run_in_threadpool(encode_view, result)
        state.metrics.latency.observe(time.perf_counter() - started)
        return answer("generate", body, "application/octet-stream")

    @app.post("/init_nccl")
    async def init_nccl(request: Request) -> Response:
        await read_body(request, "init_nccl")
        return answer("init_nccl", b'{"status": "disabled"}')

    @app.post("/heartbeat")
    async def heartbeat(request: Request) -> Response:
        await read_body(request, "heartbeat")
        return answer("heartbeat", OK)

    @app.post("/disconnect")
    async def disconnect(request: Request) -> Response:
        await read_body(request, "disconnect")
        state.mappings.disconnect(host_of(request), connection_of(request))
        state.disconnected.set()
        return answer("disconnect", OK)

    return app


class HttpServer:
    """uvicorn serving ``app`` from a thread, on a socket bound here (a busy port is a clear error at once).

    uvicorn's h11 protocol, told which connection each request came on (``scope[CONNECTION_KEY]``) and calling
    ``on_close(connection)`` when one ends: draft vocabularies are bound to connections (:class:`VocabMappings`).
    """

    def __init__(self, app, host: str, port: int, on_close: Callable[[object], None] | None = None) -> None:
        import uvicorn

        self.sock = _bind(host, port)
        self.port = self.sock.getsockname()[1]
        # A long keep-alive: NeMo's client keeps one connection per server; uvicorn's default 5 s would make
        # every idle trainer reconnect. A bounded graceful shutdown: a client trickling its body does not hold
        # the ranks' exit.
        config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=3600, access_log=False,
                                lifespan="off", timeout_graceful_shutdown=2, http=_tracking_protocol(on_close))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="ds_capture-http", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()


def _tracking_protocol(on_close: Callable[[object], None] | None):
    from uvicorn.protocols.http.h11_impl import H11Protocol

    ids = itertools.count(1)

    class ConnectionTracking(H11Protocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.connection_id = next(ids)
            app, connection, protocol = self.app, self.connection_id, self

            async def tagged(scope, receive, send):
                scope[CONNECTION_KEY] = connection
                scope[ABORT_KEY] = lambda: protocol.transport.abort()
                await app(scope, receive, send)

            self.app = tagged

        def connection_lost(self, exc) -> None:
            super().connection_lost(exc)
            # uvicorn 0.55 cancels the keep-alive timer only for a clean close (exc None): after a reset (a client
            # SIGKILLed or hanging up with data unread) the timer kept this protocol, its request and buffers alive
            # for timeout_keep_alive (an hour here). Measured: RSS grew ~1.5 MiB a minute under hostile clients.
            self._unset_keepalive_if_required()
            if on_close is not None:
                on_close(self.connection_id)

    return ConnectionTracking


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise CaptureError(f"ds-capture serve cannot listen on {host}:{port}: {error.strerror or error}. Choose "
                           "another --port (0 picks a free one) or stop what holds it.") from error
    sock.listen(128)
    sock.set_inheritable(True)
    return sock
