"""The HTTP side of the service (each replica's first rank): NeMo's endpoints, health, metrics, client limits.

In: requests on ``host:port`` (FastAPI routes served by uvicorn in a thread of the replica's first rank). Out:
NeMo 0.7.0's answers (``{"status": "ok"}`` JSON, wire blobs) and, for a request it refuses, a 4xx JSON
``{"error": "..."}`` naming the problem; the next request is served as if nothing happened. ``generate`` hands a :class:`~ds_capture.serve.
scheduler.Job` to the lockstep loop and waits for its future; everything else is answered here.

Limits: a body larger than ``max_body_bytes`` is refused (413) before it is read whole; a client that hangs up
mid-reply costs only its own answer. Draft vocabularies are kept per client connection (two trainers may train
different drafts against one service); a connection that never set one uses the one every client agreed on, and
is refused (409) when they differ.
"""

import asyncio
import json
import socket
import threading
from typing import Callable

from ds_capture.errors import CaptureError
from ds_capture.serve.metrics import CONTENT_TYPE, ServeMetrics
from ds_capture.serve.protocol import BadRequest, parse_generate, parse_vocab_mapping
from ds_capture.serve.scheduler import Job, Scheduler
from ds_capture.serve.supervision import VocabMapping
from ds_capture.serve.wire import encode, encode_view

OK = b'{"status": "ok"}'


class ServiceState:
    """What the HTTP threads share with the loop: readiness, the draft vocabularies, the queue, the counters."""

    def __init__(self, *, vocab_size: int, max_seq_length: int, max_rows: int, model_info: dict,
                 embeddings: Callable[[], dict], scheduler: Scheduler, metrics: ServeMetrics,
                 max_body_bytes: int, exit_on_disconnect: bool) -> None:
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
        self.disconnected = threading.Event()
        """A client said ``disconnect`` (the loop stops on it only with ``exit_on_disconnect``)."""
        self._mappings: dict[object, VocabMapping] = {}
        self._lock = threading.Lock()

    def embeddings_body(self) -> bytes:
        with self._lock:
            if self._embeddings_body is None:
                self._embeddings_body = encode(self._embeddings())
            return self._embeddings_body

    def set_mapping(self, client: object, mapping: VocabMapping) -> None:
        with self._lock:
            self._mappings[client] = mapping

    def forget(self, client: object) -> None:
        with self._lock:
            self._mappings.pop(client, None)

    def mapping_for(self, client: object) -> VocabMapping:
        with self._lock:
            mapping = self._mappings.get(client)
            if mapping is not None:
                return mapping
            known = list(self._mappings.values())
        if not known:
            raise BadRequest(409, "generate before set_vocab_mapping: the trainer must send its draft vocabulary "
                                  "first (RemoteEagle3TargetModel.set_vocab_mapping)")
        if any(not other.same_as(known[0]) for other in known[1:]):
            raise BadRequest(409, "generate from a connection that set no draft vocabulary while the connected "
                                  "trainers set different ones: send set_vocab_mapping on this connection first")
        return known[0]


def build_app(state: ServiceState):
    """The FastAPI application over ``state``."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from starlette.concurrency import run_in_threadpool

    app = FastAPI(title="ds-capture serve", docs_url=None, redoc_url=None, openapi_url=None)

    def error(endpoint: str, status: int, message: str) -> Response:
        state.metrics.count_request(endpoint, status)
        return JSONResponse({"error": message}, status_code=status)

    def answer(endpoint: str, body: bytes, media_type: str = "application/json") -> Response:
        state.metrics.count_request(endpoint, 200)
        return Response(body, media_type=media_type)

    async def read_body(request: Request, endpoint: str) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > state.max_body_bytes:
            raise BadRequest(413, f"{endpoint}: body of {int(declared):,} bytes exceeds this service's limit of "
                                  f"{state.max_body_bytes:,} (--max-body-mib)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > state.max_body_bytes:
                raise BadRequest(413, f"{endpoint}: body exceeds this service's limit of {state.max_body_bytes:,} "
                                      "bytes (--max-body-mib)")
            chunks.append(chunk)
        return b"".join(chunks)

    def client_of(request: Request) -> object:
        return (request.client.host, request.client.port) if request.client else None

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> Response:
        return error(request.url.path.lstrip("/"), exc.status, exc.message)

    @app.get("/health")
    async def health() -> Response:
        if not state.ready.is_set():
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return Response(OK, media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.queue_depth.set(state.scheduler.depth())
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def require_ready(endpoint: str) -> None:
        if not state.ready.is_set():
            raise BadRequest(503, f"{endpoint}: the target is not loaded on every rank yet, or the service is "
                                  "stopping; poll GET /health until it answers 200")

    @app.post("/model_info")
    async def model_info(request: Request) -> Response:
        await read_body(request, "model_info")
        require_ready("model_info")
        return answer("model_info", json.dumps(state.model_info).encode())

    @app.post("/input_embeddings")
    async def input_embeddings(request: Request) -> Response:
        await read_body(request, "input_embeddings")
        require_ready("input_embeddings")
        body = await run_in_threadpool(state.embeddings_body)
        return answer("input_embeddings", body, "application/octet-stream")

    @app.post("/set_vocab_mapping")
    async def set_vocab_mapping(request: Request) -> Response:
        raw = await read_body(request, "set_vocab_mapping")
        mapping = await run_in_threadpool(parse_vocab_mapping, raw, vocab_size=state.vocab_size)
        state.set_mapping(client_of(request), mapping)
        return answer("set_vocab_mapping", OK)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        raw = await read_body(request, "generate")
        require_ready("generate")
        parsed = await run_in_threadpool(parse_generate, raw, vocab_size=state.vocab_size,
                                         max_seq_length=state.max_seq_length, max_rows=state.max_rows)
        mapping = state.mapping_for(client_of(request))
        future = state.scheduler.submit(Job(request=parsed, mapping=mapping))
        state.metrics.queue_depth.set(state.scheduler.depth())
        try:
            result = await asyncio.wrap_future(future)
        except RuntimeError as stopped:
            return error("generate", 503, f"generate: {stopped}")
        body = await run_in_threadpool(encode_view, result)
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
        state.forget(client_of(request))
        state.disconnected.set()
        return answer("disconnect", OK)

    return app


class HttpServer:
    """uvicorn serving ``app`` from a thread, on a socket bound here (a busy port is a clear error at once)."""

    def __init__(self, app, host: str, port: int) -> None:
        import uvicorn

        self.sock = _bind(host, port)
        self.port = self.sock.getsockname()[1]
        # A long keep-alive: NeMo's client keeps one connection per server, and its draft vocabulary is kept per
        # connection (see ServiceState); uvicorn's default 5 s would make every idle trainer reconnect.
        config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=3600, access_log=False,
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="ds_capture-http", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()


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
