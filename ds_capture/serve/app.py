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

Draft vocabularies: :class:`~ds_capture.serve.vocabularies.VocabMappings` (bound to connections, per host).
"""

import asyncio
import itertools
import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from ds_capture.errors import CaptureError
from ds_capture.serve.metrics import CONTENT_TYPE, ServeMetrics
from ds_capture.serve.protocol import BadRequest, parse_generate, parse_vocab_mapping
from ds_capture.serve.scheduler import Job, QueueFull, Scheduler, Stopping
from ds_capture.serve.vocabularies import VocabMappings
from ds_capture.serve.wire import encode, encode_pieces

OK = b'{"status": "ok"}'
RETRY_AFTER_S = 5
CONNECTION_KEY = "ds_capture.connection"
"""The ASGI scope key carrying the id of the TCP connection a request came on (:class:`HttpServer`'s protocol)."""
ABORT_KEY = "ds_capture.abort"
"""The ASGI scope key carrying a callable that resets the request's TCP connection (no answer is sent)."""
_LOG = logging.getLogger("ds_capture")
_MAX_HEAD_BYTES = 64 << 10  # a request's URL and headers (ConnectionTracking)
_PIECE_BYTES = 1 << 20  # a generate answer's largest write (measured on 35 MB: 256 KiB pieces 1.2x the time, assembled first 2.4x)


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


class _Http:
    """What the routes share: the service's state and the answers, refusals and waits every route is built from."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state

    def error(self, endpoint: str, status: int, message: str, reason: str, headers: dict | None = None):
        """A refusal: ``{"error": message}`` with ``status``, counted under ``reason``."""
        from fastapi.responses import JSONResponse

        self.state.metrics.count_request(endpoint, status)
        self.state.metrics.refuse(reason)
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    def answer(self, endpoint: str, body: bytes, media_type: str = "application/json"):
        from fastapi.responses import Response

        self.state.metrics.count_request(endpoint, 200)
        return Response(body, media_type=media_type)

    def stream(self, endpoint: str, size: int, pieces: list):
        """A binary answer written from ``pieces`` as they are (views of the answer's tensors, never assembled), at
        most :data:`_PIECE_BYTES` per write: the transport then sends each mostly straight from the tensor."""
        from fastapi.responses import StreamingResponse

        async def slices():
            for piece in pieces:
                view = memoryview(piece)
                for lo in range(0, len(view), _PIECE_BYTES):
                    yield view[lo:lo + _PIECE_BYTES]

        self.state.metrics.count_request(endpoint, 200)
        return StreamingResponse(slices(), media_type="application/octet-stream",
                                 headers={"content-length": str(size)})

    async def read_body(self, request, endpoint: str) -> bytes:
        """The whole body, refused (413) past ``max_body_bytes`` before it is read whole; :class:`ClientGone` if the
        client hangs up meanwhile."""
        from starlette.requests import ClientDisconnect

        limit = self.state.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(413, f"{endpoint}: body of {int(declared):,} bytes exceeds this service's limit of "
                                  f"{limit:,} (--max-body-mib)")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BadRequest(413, f"{endpoint}: body exceeds this service's limit of {limit:,} bytes "
                                          "(--max-body-mib)")
                chunks.append(chunk)
        except ClientDisconnect as gone:
            raise ClientGone(f"{endpoint}: {self.host_of(request)} hung up after {size:,} bytes of its body") from gone
        return b"".join(chunks)

    @staticmethod
    def host_of(request) -> str:
        return request.client.host if request.client else "unknown"

    @staticmethod
    def connection_of(request) -> object:
        return request.scope.get(CONNECTION_KEY)

    async def wait_ready(self) -> None:
        """Before the body is read: while the target loads the request waits (the client's timeout is retried);
        once the service stops it is dropped."""
        state = self.state
        while not state.ready.is_set():
            if state.stopping.is_set():
                raise Dropped()
            await asyncio.sleep(0.02)
        if state.stopping.is_set():
            raise Dropped()

    async def admit(self, job: Job):
        """The job's future once the queue has room: the connection is held meanwhile (back-pressure)."""
        scheduler = self.state.scheduler
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


def build_app(state: ServiceState):
    """The FastAPI application over ``state``: its refusals, health and metrics, NeMo's session endpoints, and
    ``generate``."""
    from fastapi import FastAPI

    app = FastAPI(title="ds-capture serve", docs_url=None, redoc_url=None, openapi_url=None)
    http = _Http(state)
    _add_refusals(app, http)
    _add_status_routes(app, http)
    _add_session_routes(app, http)
    _add_generate(app, http)
    return app


def _add_refusals(app, http: _Http) -> None:
    """A :class:`BadRequest` becomes its 4xx JSON; a client gone mid-body one log line; a dropped request a reset
    connection, no status."""
    from fastapi import Request
    from fastapi.responses import Response

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> Response:
        return http.error(request.url.path.lstrip("/"), exc.status, exc.message, exc.reason, exc.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        _LOG.warning("ds-capture serve: %s (nothing answered)", exc)  # one line, no traceback
        http.state.metrics.refuse("client_gone")
        return Response(status_code=400)  # nobody reads it

    @app.exception_handler(Dropped)
    async def dropped(request: Request, exc: Dropped) -> Response:
        abort = request.scope.get(ABORT_KEY)
        if abort is not None:
            abort()
        http.state.metrics.refuse("stopping")
        return Response(status_code=503)  # not sent: the connection is gone


def _add_status_routes(app, http: _Http) -> None:
    """``GET /health`` (503 until every rank loaded, and once stopping) and ``GET /metrics``."""
    from fastapi.responses import JSONResponse, Response

    state = http.state

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


def _add_session_routes(app, http: _Http) -> None:
    """NeMo's endpoints around ``generate``: ``model_info`` and ``input_embeddings`` (answered once ready), the draft
    vocabulary, ``init_nccl`` (disabled), ``heartbeat`` and ``disconnect``."""
    from fastapi import Request
    from fastapi.responses import Response
    from starlette.concurrency import run_in_threadpool

    state = http.state

    @app.post("/model_info")
    async def model_info(request: Request) -> Response:
        await http.wait_ready()
        await http.read_body(request, "model_info")
        return http.answer("model_info", json.dumps(state.model_info).encode())

    @app.post("/input_embeddings")
    async def input_embeddings(request: Request) -> Response:
        await http.wait_ready()
        await http.read_body(request, "input_embeddings")
        body = await run_in_threadpool(state.embeddings_body)
        return http.answer("input_embeddings", body, "application/octet-stream")

    @app.post("/set_vocab_mapping")
    async def set_vocab_mapping(request: Request) -> Response:
        raw = await http.read_body(request, "set_vocab_mapping")
        mapping = await run_in_threadpool(parse_vocab_mapping, raw, vocab_size=state.vocab_size)
        await run_in_threadpool(state.mappings.set, http.host_of(request), http.connection_of(request), mapping, raw)
        return http.answer("set_vocab_mapping", OK)

    @app.post("/init_nccl")
    async def init_nccl(request: Request) -> Response:
        await http.read_body(request, "init_nccl")
        return http.answer("init_nccl", b'{"status": "disabled"}')

    @app.post("/heartbeat")
    async def heartbeat(request: Request) -> Response:
        await http.read_body(request, "heartbeat")
        return http.answer("heartbeat", OK)

    @app.post("/disconnect")
    async def disconnect(request: Request) -> Response:
        await http.read_body(request, "disconnect")
        state.mappings.disconnect(http.host_of(request), http.connection_of(request))
        state.disconnected.set()
        return http.answer("disconnect", OK)


def _add_generate(app, http: _Http) -> None:
    """``generate``: once ready, the body read and checked, the request's draft vocabulary found, admitted to the
    queue (held while it is full) and answered from the loop's future; dropped if the service stops first."""
    from fastapi import Request
    from fastapi.responses import Response
    from starlette.concurrency import run_in_threadpool

    state = http.state

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        started = time.perf_counter()
        await http.wait_ready()
        raw = await http.read_body(request, "generate")
        parsed = await run_in_threadpool(parse_generate, raw, vocab_size=state.vocab_size,
                                         max_seq_length=state.max_seq_length, max_rows=state.max_rows)
        mapping = state.mappings.get(http.host_of(request), http.connection_of(request))
        future = await http.admit(Job(request=parsed, mapping=mapping, nbytes=len(raw)))
        del raw
        state.metrics.queue_depth.set(state.scheduler.depth())
        state.metrics.in_flight.inc()
        try:
            result = await asyncio.wrap_future(future)
        except Stopping as stopped:
            raise Dropped() from stopped
        except Exception as failed:  # noqa: BLE001 - this request's answer failed; the client hears why
            return http.error("generate", 500, f"generate: {type(failed).__name__}: {failed}", "failed")
        finally:
            state.metrics.in_flight.dec()
        size, pieces = await run_in_threadpool(encode_pieces, result)
        state.metrics.latency.observe(time.perf_counter() - started)
        return http.stream("generate", size, pieces)


class HttpServer:
    """uvicorn serving ``app`` from a thread, on a socket bound here (a busy port is a clear error at once).

    uvicorn's httptools protocol, told which connection each request came on (``scope[CONNECTION_KEY]``) and calling
    ``on_close(connection)`` when one ends: draft vocabularies are bound to connections (:class:`VocabMappings`).
    httptools rather than h11: h11 joins every response into one more copy before writing it, and a ``generate``
    answer is tens of MB (measured, 35 MB: 69 ms per request with h11, 44 ms with httptools, client included).
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
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    ids = itertools.count(1)

    class ConnectionTracking(HttpToolsProtocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.connection_id = next(ids)
            app, connection, protocol = self.app, self.connection_id, self

            async def tagged(scope, receive, send):
                scope[CONNECTION_KEY] = connection
                scope[ABORT_KEY] = lambda: protocol.transport.abort()
                await app(scope, receive, send)

            self.app = tagged
            self._head_bytes, self._in_head = 0, True

        # httptools sets no bound on a request's head (h11 refused past 16 KiB): one is set here, exact on the
        # parsed URL and headers (400 past _MAX_HEAD_BYTES), and on the bytes received while a head is incomplete
        # (a header value that never ends is buffered by the parser whole: cut past 16 x that).
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes, self._in_head = 0, True

        def on_url(self, url: bytes) -> None:
            self._count_head(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_head(len(name) + len(value))
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def _count_head(self, size: int) -> None:
            self._head_bytes += size
            if self._head_bytes > _MAX_HEAD_BYTES:
                raise ValueError("request head too large")  # httptools: HttpParserCallbackError -> uvicorn's 400

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_head and not self.transport.is_closing():
                self._unparsed_head = getattr(self, "_unparsed_head", 0) + len(data)
                if self._unparsed_head > 16 * _MAX_HEAD_BYTES:
                    self.send_400_response("Request head too large.")
            else:
                self._unparsed_head = 0

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
