"""The service's driver: one target session, every rank forwarding each batch of requests together.

In: a validated recipe (``cache_kind: eagle3``; output and data keys unused) and the service's options. Out: a
running service until SIGTERM / Ctrl-C on any rank (every rank leaves at the same tick, exit 0), a client's
``disconnect`` with ``exit_on_disconnect``, or a dead / frozen rank (:class:`~ds_capture.capture.liveness.Liveness`
ends every rank, exit 75). The target session is :mod:`ds_capture.session`'s, as ``run``'s is.

One URL per data-parallel replica: the first rank of each TP group (DP rank d) listens on ``port + d``
(:mod:`ds_capture.serve.app`), so a job with DP 1 has one URL on rank 0 and NeMo's ``remote_urls`` lists one URL
per replica. Lockstep, per tick (``tick_s`` while idle): every rank casts its stop ballot (:class:`StopVote`, a
collective); each listener takes the waiting requests one forward can answer
(:class:`~ds_capture.serve.scheduler.Scheduler`) and every rank learns every replica's shape (an all-gather); a
replica's listener broadcasts ``input_ids`` and ``attention_mask`` to its TP group; every rank forwards (a
replica with nothing to do forwards a one-row filler: sharded engines' forwards are collectives, and EP / FSDP2 ranks
may carry different rows), and each listener turns its captures into its requests' answers
(:mod:`ds_capture.serve.supervision`). An idle service costs two small collectives per tick.

    summary = serve_target(load_config("configs/serve_demo.yaml"), ServeOptions(port=8000))
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_capture.cache.common.identity import read_target_weights
from ds_capture.cache.eagle3.draft_distribution import logits_mismatch
from ds_capture.capture.interrupt import StopOnSignal, StopVote
from ds_capture.capture.progress import collective_device
from ds_capture.errors import CaptureError
from ds_capture.parallel.dist import agree_on_error, all_reduce_max_int, discover_env
from ds_capture.parallel.layout import new_groups
from ds_capture.recipe.config import RunConfig
from ds_capture.serve.app import HttpServer, ServiceState, build_app
from ds_capture.serve.metrics import ServeMetrics
from ds_capture.serve.protocol import parse_vocab_mapping
from ds_capture.serve.scheduler import Job, Scheduler, Stopping, resolve
from ds_capture.serve.supervision import Supervisor
from ds_capture.session import (
    SessionPlan,
    build_target_model,
    distributed_target,
    plan_session,
    resolve_compute_dtype,
    target_forward,
)
from ds_capture.sizing.session_plan import SERVE_MAX_BATCH_ROWS
from ds_capture.target.checkpoint_reads import release_freed_memory

_LOG = logging.getLogger("ds_capture")
_TRIM_EVERY_S = 5.0  # how often a serving rank hands freed heap pages back (release_freed_memory)


@dataclass(frozen=True)
class ServeOptions:
    """How the service listens and batches (the ``ds-capture serve`` flags)."""

    host: str = "127.0.0.1"
    """Address to bind; 127.0.0.1 unless the operator says otherwise (NeMo's client sends no credentials)."""
    port: int = 8000
    """TCP port; 0 picks a free one (logged, and passed to ``on_listening``)."""
    exit_on_disconnect: bool = False
    """NeMo's own server's behaviour: stop once a client says ``disconnect`` and nothing is waiting."""
    max_batch_rows: int = SERVE_MAX_BATCH_ROWS
    """Most rows one request may carry, and (with ``batch_requests``) one forward may batch."""
    batch_requests: bool = False
    """Let waiting requests of one sequence length share a forward (``--batch-requests``). Off by default: each
    request is then forwarded in a computation of its own shape, so its answer is byte-identical to an idle
    service's; shared forwards can change answers in the last bits (docs/serve.md, measured)."""
    max_body_mib: float = 256.0
    """Largest request body accepted (413 above it)."""
    max_queued_rows: int | None = None
    """Most rows waiting in the queue (default 4 x ``max_batch_rows``); past it requests are held (back-pressure)."""
    max_queued_mib: float = 1024.0
    """Most request bytes waiting in the queue; past it requests are held."""
    max_held: int = 256
    """Requests queued plus held past which one is refused (503, ``Retry-After``)."""
    vocab_idle_s: float = 60.0
    """A draft vocabulary no request used for this long is no longer live (see serve/app.py VocabMappings)."""
    vocab_dir: Path | None = None
    """Where each replica keeps its trainers' draft vocabularies (``replica-<d>/``), restored on a restart: a
    trainer rides through a requeue of the service with its vocabulary (``--vocab-dir``; None: memory only)."""
    tick_s: float = 0.05
    """How long a listener waits for a request before the ranks' next stop vote while idle."""
    log_interval_s: float = 30.0
    """Seconds between progress lines of each listener (0: none)."""


@dataclass(frozen=True)
class ServeSummary:
    """What one service did (this rank's counts; a listener's are its replica's requests)."""

    reason: str
    requests: int
    forwards: int
    tokens: int
    seconds: float

    def format(self) -> str:
        return (f"ds-capture serve stopped ({self.reason}): {self.requests:,} generate requests in {self.forwards:,} "
                f"forwards, {self.tokens:,} tokens, {self.seconds:.1f} s up")


def serve_target(cfg: RunConfig, options: ServeOptions, *, on_listening=None) -> ServeSummary:
    """Serve ``cfg``'s target until stopped; every rank of the job calls this (each replica's first rank
    listens)."""
    if options.max_batch_rows < 1 or options.max_body_mib <= 0:
        raise CaptureError(f"--max-batch-rows ({options.max_batch_rows}) must be >= 1 and --max-body-mib "
                           f"({options.max_body_mib:g}) > 0.")
    env = discover_env()
    # From here on SIGTERM / SIGINT stop every rank at the next tick (exit 0); a second one ends the process at once.
    with StopOnSignal(announce=env.rank == 0) as stop:
        # Every refusal (cache kind, layout, fit) before anything loads or listens; sized as serve itself:
        # --max-batch-rows rows per forward, the listeners' lm_head and logits chunk (ds-capture plan --serve).
        session = plan_session(cfg, env, serve_rows=options.max_batch_rows)
        with distributed_target(cfg, env, session.plan):
            return _serve(cfg, session, stop, options, on_listening)


def _serve(cfg: RunConfig, session: SessionPlan, stop: StopOnSignal, options: ServeOptions,
           on_listening) -> ServeSummary:
    started = time.perf_counter()
    target, plan = session.target, session.plan
    compute_dtype = resolve_compute_dtype(cfg.capture.compute_dtype)
    state, server, error = None, None, None
    listens = plan.is_writer  # the first rank of each TP group: one URL per data-parallel replica
    port = options.port + plan.dp_rank if options.port else 0
    if listens:
        # Listen before loading (a busy port is refused at once; health answers 503 until every rank loaded).
        try:
            embed, lm_head = read_target_weights(target)
            state = ServiceState(
                vocab_size=target.vocab_size, max_seq_length=cfg.recipe_args.seq_length,
                max_rows=options.max_batch_rows,
                model_info={"num_hidden_layers": target.num_hidden_layers, "hidden_size": target.hidden_size,
                            "vocab_size": target.vocab_size, "aux_layer_ids": list(session.layer_ids)},
                embeddings=lambda: {"weight": embed.to(compute_dtype)},
                scheduler=Scheduler(max_rows=options.max_batch_rows, batch=options.batch_requests,
                                    max_queued_rows=options.max_queued_rows,
                                    max_queued_bytes=int(options.max_queued_mib * 2**20),
                                    hard_limit=options.max_held),
                metrics=ServeMetrics(), max_body_bytes=int(options.max_body_mib * 2**20),
                exit_on_disconnect=options.exit_on_disconnect, vocab_idle_s=options.vocab_idle_s,
                vocab_store=options.vocab_dir / f"replica-{plan.dp_rank}" if options.vocab_dir else None)
            server = HttpServer(build_app(state), options.host, port, on_close=state.mappings.closed)
            server.start()
        except Exception as caught:  # noqa: BLE001 - every rank must reach agree_on_error
            error = caught
    agree_on_error(error)
    try:
        groups = new_groups(plan) if plan.world_size > 1 else None
        model = build_target_model(cfg, target, plan, groups)
        device = next(model.parameters()).device
        supervisor = Supervisor(lm_head.to(device, compute_dtype)) if listens else None
        all_reduce_max_int(1)  # every rank has loaded the target: only now may health answer 200
        with target_forward(model, target, session.layer_ids, pre_norm_last=True,
                            chunk_tokens=session.chunk_tokens) as forward:
            if listens:
                restored = state.mappings.restore(lambda raw: parse_vocab_mapping(raw, vocab_size=target.vocab_size))
                if restored:
                    _LOG.warning("ds-capture serve: replica %d restored %d draft vocabular%s from %s (a restart: "
                                 "its trainers go on with them)", plan.dp_rank, restored, "y" if restored == 1 else
                                 "ies", state.mappings.store)
                state.ready.set()
                state.metrics.ready.set(1)
                # Every replica's listener says where it listens (ranks but 0 log warnings and up only).
                urls = ", ".join(f"http://{options.host}:{server.port - plan.dp_rank + d}" for d in range(plan.dp_size))
                _LOG.log(logging.INFO if plan.rank == 0 else logging.WARNING,
                         "ds-capture serve: %s, replica %d of %d on http://%s:%d (world %d: dp %d x tp %d, ep %d; aux "
                         "layers %s); NeMo recipe_args: target_model_backend: remote, remote_urls: [%s]", target.path,
                         plan.dp_rank, plan.dp_size, options.host, server.port, plan.world_size, plan.dp_size,
                         plan.tp_size, plan.ep_size, session.layer_ids, urls)
                if on_listening is not None:
                    on_listening(server.port)
            loop = _Lockstep(forward, plan, groups, device, compute_dtype, state, supervisor, options)
            reason = loop.run(stop)
        if listens:
            _LOG.log(logging.INFO if plan.rank == 0 else logging.WARNING, "%s", state.metrics.line())
        return ServeSummary(reason=reason, requests=loop.requests, forwards=loop.forwards, tokens=loop.tokens,
                            seconds=time.perf_counter() - started)
    finally:
        if state is not None:
            state.stopping.set()  # what is not answered now is dropped: NeMo's client retries a connection error
            state.ready.clear()
            state.metrics.ready.set(0)
            state.scheduler.close("the service is stopping")
        if server is not None:
            server.stop()


class _Lockstep:
    """The per-tick loop of the module docstring (every rank runs one)."""

    def __init__(self, forward, plan, groups, device: torch.device, compute_dtype: torch.dtype,
                 state: ServiceState | None, supervisor: Supervisor | None, options: ServeOptions) -> None:
        self.forward, self.plan, self.device = forward, plan, device
        self.world_size, self.listens = plan.world_size, plan.is_writer
        self.tp_group = groups.tp_group if groups is not None else None
        self.leader = plan.tp_ranks[0]  # the global rank of this replica's listener
        self.compute_dtype, self.state, self.supervisor, self.options = compute_dtype, state, supervisor, options
        self.requests = self.forwards = self.tokens = 0
        self._logits_checked = False

    def run(self, stop: StopOnSignal) -> str:
        vote = StopVote(stop, lag=0)  # collective on a side group, every rank, every tick
        next_log = time.monotonic() + self.options.log_interval_s
        next_trim = time.monotonic() + _TRIM_EVERY_S
        try:
            while True:
                if vote.should_stop():
                    return f"{vote.reason()}"
                jobs, header = [], None
                if self.listens:
                    jobs = self.state.scheduler.take(self.options.tick_s)
                    if jobs:
                        header = ("forward", sum(job.request.num_rows for job in jobs), jobs[0].request.seq_length)
                    elif self.state.exit_on_disconnect and self.state.disconnected.is_set():
                        header = ("exit",)
                    if self.options.log_interval_s and time.monotonic() >= next_log:
                        self.state.metrics.queue_depth.set(self.state.scheduler.depth())
                        _LOG.log(logging.INFO if self.plan.rank == 0 else logging.WARNING, "%s",
                                 self.state.metrics.line())
                        next_log = time.monotonic() + self.options.log_interval_s
                headers = self._gather_headers(header)  # every replica's, on every rank
                if time.monotonic() >= next_trim:
                    release_freed_memory()  # see its docstring: what the requests' tensors left behind
                    next_trim = time.monotonic() + _TRIM_EVERY_S
                exiting = any(other is not None and other[0] == "exit" for other in headers)
                forwarding = [other is not None and other[0] == "forward" for other in headers]
                if not any(forwarding):
                    if exiting:
                        return "a client disconnected (--exit-on-disconnect)"
                    continue
                mine = headers[self.leader]
                mine = mine if mine is not None and mine[0] == "forward" else None
                try:
                    # Taken jobs are answered also on the tick a replica says exit (it forwards a filler). Under
                    # chunked prefill every rank forwards as many chunks as the longest replica's rows take.
                    forwards = max(self.forward.forwards_for(other[2]) for other in headers
                                   if other is not None and other[0] == "forward")
                    self._step(jobs, *(mine[1:] if mine is not None else (0, 0)), forwards)
                except BaseException as error:
                    for job in jobs:  # dropped (a connection error, which NeMo's client retries): the service goes down
                        resolve(job.future, error=Stopping(f"the service failed: {type(error).__name__}"))
                    raise
                finally:
                    if self.listens:
                        self.state.scheduler.done()
                if exiting:
                    return "a client disconnected (--exit-on-disconnect)"
        finally:
            vote.close()

    def _step(self, jobs: list[Job], rows: int, length: int, forwards: int) -> None:
        started = time.monotonic()
        if rows == 0:  # another replica has work: this one forwards one-row fillers whose output is discarded
            self.forward.forward({"input_ids": torch.zeros(1, 8, dtype=torch.int64, device=self.device)},
                                 num_forwards=forwards)
            return
        if self.listens:
            input_ids = torch.cat([job.request.input_ids for job in jobs])
            attention_mask = torch.cat([job.request.attention_mask for job in jobs])
        else:
            input_ids = torch.empty(rows, length, dtype=torch.int64)
            attention_mask = torch.empty(rows, length, dtype=torch.int64)
        input_ids, attention_mask = self._broadcast_tensors(input_ids, attention_mask)
        # NeMo's forward: the client's attention mask, whatever its padding (left padding included).
        output = self.forward.forward({"input_ids": input_ids.to(self.device),
                                       "attention_mask": attention_mask.to(self.device)}, num_forwards=forwards)
        self.forwards += 1
        if not self.listens:
            return
        aux, last = self.forward.hooks.collect(self.compute_dtype)
        self.forward.hooks.reset()
        if not self._logits_checked:
            problem = logits_mismatch(self.supervisor.logits(last[:, -1]), output, self.compute_dtype)
            if problem is not None:
                raise CaptureError(f"{problem}; ds-capture serve cannot answer generate for this target.")
            self._logits_checked = True
        del output
        lo = 0
        for job in jobs:
            hi = lo + job.request.num_rows
            try:
                resolve(job.future, result=self.supervisor.compute(aux[lo:hi], last[lo:hi], job.request.input_ids,
                                                                   job.request.loss_mask, job.mapping))
            except Exception as error:  # noqa: BLE001 - this request's answer fails, the service goes on
                resolve(job.future, error=error)
            lo = hi
        tokens = sum(job.request.num_tokens for job in jobs)
        self.requests += len(jobs)
        self.tokens += tokens
        waits = [started - job.enqueued for job in jobs]
        self.state.metrics.count_forward(rows=rows, tokens=tokens, seconds=time.monotonic() - started, waits=waits)
        self.state.metrics.queue_depth.set(self.state.scheduler.depth())

    def _gather_headers(self, header) -> list:
        """Every rank's header (None but on listeners), indexed by global rank."""
        if self.world_size == 1:
            return [header]
        headers = [None] * self.world_size
        torch.distributed.all_gather_object(headers, header)  # every rank, every tick
        return headers

    def _broadcast_tensors(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """The listener's tensors on every rank of its TP group (the ranks that see the same rows)."""
        if self.tp_group is None:
            return list(tensors)
        device = collective_device()
        out = []
        for tensor in tensors:
            tensor = tensor.to(device).contiguous()
            torch.distributed.broadcast(tensor, src=self.leader, group=self.tp_group)
            out.append(tensor)
        return out
