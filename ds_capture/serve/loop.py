"""The service's driver: one target session, every rank forwarding each batch of requests together.

In: a validated recipe (``cache_kind: eagle3``; output and data keys unused) and the service's options. Out: a
running service until SIGTERM / Ctrl-C on any rank (every rank leaves at the same tick, exit 0), a client's
``disconnect`` with ``exit_on_disconnect``, or a dead / frozen rank (:class:`~ds_capture.capture.liveness.Liveness`
ends every rank, exit 75). The target session is :mod:`ds_capture.session`'s, as ``run``'s is.

One URL per data-parallel replica: the first rank of each TP group (DP rank d) listens on ``port + d``
(:mod:`ds_capture.serve.app`), so a job with DP 1 has one URL on rank 0 and NeMo's ``remote_urls`` lists one URL
per replica (under ``--port 0`` each listener binds a free port, and every listener logs the ports every replica
bound). Per tick (``tick_s`` while idle) each listener takes the waiting requests one forward can answer
(:class:`~ds_capture.serve.scheduler.Scheduler`), and every rank runs ``run``'s own step
(:class:`~ds_capture.session.Lockstep`): one small integer all-gather agrees on the stop vote, every replica's
shape and the fillers of a replica with nothing to do (sharded engines' forwards are collectives, and EP / FSDP2
ranks may carry different rows); under TP the listener broadcasts its rows to its TP group (one broadcast); every
rank forwards, and each listener's answers (:mod:`ds_capture.serve.supervision`) are computed on a worker thread
while the next tick runs. An idle service costs one small collective per tick. This module keeps what is the
service's own: HTTP, scheduling and supervision.

    summary = serve_target(load_config("configs/serve_demo.yaml"), ServeOptions(port=8000))
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_capture.cache.common.identity import read_target_weights
from ds_capture.cache.eagle3.draft_distribution import logits_mismatch
from ds_capture.capture.interrupt import StopOnSignal
from ds_capture.capture.progress import collective_device
from ds_capture.errors import CaptureError
from ds_capture.parallel.dist import agree_on_error, all_gather_int, discover_env
from ds_capture.parallel.layout import new_groups
from ds_capture.recipe.config import RunConfig
from ds_capture.serve.app import HttpServer, ServiceState, build_app
from ds_capture.serve.metrics import ServeMetrics
from ds_capture.serve.protocol import parse_vocab_mapping
from ds_capture.serve.scheduler import Job, Scheduler, Stopping, resolve
from ds_capture.serve.supervision import Supervisor
from ds_capture.session import (
    Ballot,
    Lockstep,
    SessionPlan,
    Step,
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
    """A draft vocabulary no request used for this long is no longer live (see serve/vocabularies.py)."""
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
    state, server, lm_head, error = None, None, None, None
    if plan.is_writer:  # the first rank of each TP group: one URL per data-parallel replica
        # Listen before loading (a busy port is refused at once; health answers 503 until every rank loaded).
        try:
            state, server, lm_head = _listen(cfg, session, options, compute_dtype)
        except Exception as caught:  # noqa: BLE001 - every rank must reach agree_on_error
            error = caught
    agree_on_error(error)
    try:
        groups = new_groups(plan) if plan.world_size > 1 else None
        model = build_target_model(cfg, target, plan, groups)
        device = next(model.parameters()).device
        answers = _Answers(Supervisor(lm_head.to(device, compute_dtype)), state) if state is not None else None
        # Every rank has loaded the target (only now may health answer 200) and learns where each replica listens.
        ports = all_gather_int(server.port if server is not None else 0)
        with target_forward(model, target, session.layer_ids, pre_norm_last=True,
                            chunk_tokens=session.chunk_tokens) as forward:
            if state is not None:
                _announce(state, session, options, [ports[d * plan.tp_size] for d in range(plan.dp_size)])
                if on_listening is not None:
                    on_listening(server.port)
            lockstep = Lockstep(forward, stop, device=device, seq_length=cfg.recipe_args.seq_length)
            loop = _ServeLoop(lockstep, plan, groups, compute_dtype, state, answers, options)
            reason = loop.run()
        if state is not None:
            _LOG.log(logging.INFO if plan.rank == 0 else logging.WARNING, "%s", state.metrics.line())
        return ServeSummary(reason=reason, requests=answers.requests if answers else 0, forwards=loop.forwards,
                            tokens=answers.tokens if answers else 0, seconds=time.perf_counter() - started)
    finally:
        if state is not None:
            state.stopping.set()  # what is not answered now is dropped: NeMo's client retries a connection error
            state.ready.clear()
            state.metrics.ready.set(0)
            state.scheduler.close("the service is stopping")
        if server is not None:
            server.stop()


def _listen(cfg: RunConfig, session: SessionPlan, options: ServeOptions, compute_dtype: torch.dtype):
    """A listener's :class:`ServiceState` and started :class:`HttpServer` on ``--port`` + its replica (any free
    port under ``--port 0``), and the checkpoint's lm_head the answers are computed with."""
    target, plan = session.target, session.plan
    embed, lm_head = read_target_weights(target)
    state = ServiceState(
        vocab_size=target.vocab_size, max_seq_length=cfg.recipe_args.seq_length, max_rows=options.max_batch_rows,
        model_info={"num_hidden_layers": target.num_hidden_layers, "hidden_size": target.hidden_size,
                    "vocab_size": target.vocab_size, "aux_layer_ids": list(session.layer_ids)},
        embeddings=lambda: {"weight": embed.to(compute_dtype)},
        scheduler=Scheduler(max_rows=options.max_batch_rows, batch=options.batch_requests,
                            max_queued_rows=options.max_queued_rows,
                            max_queued_bytes=int(options.max_queued_mib * 2**20), hard_limit=options.max_held),
        metrics=ServeMetrics(), max_body_bytes=int(options.max_body_mib * 2**20),
        exit_on_disconnect=options.exit_on_disconnect, vocab_idle_s=options.vocab_idle_s,
        vocab_store=options.vocab_dir / f"replica-{plan.dp_rank}" if options.vocab_dir else None)
    server = HttpServer(build_app(state), options.host, options.port + plan.dp_rank if options.port else 0,
                        on_close=state.mappings.closed)
    server.start()
    return state, server, lm_head


def _announce(state: ServiceState, session: SessionPlan, options: ServeOptions, ports: list[int]) -> None:
    """Every rank loaded: restore the replica's kept draft vocabularies, answer health 200, and say where every
    replica listens (``ports``: their bound ports, by replica; rank 0 at INFO, the other listeners WARNING)."""
    target, plan = session.target, session.plan
    restored = state.mappings.restore(lambda raw: parse_vocab_mapping(raw, vocab_size=target.vocab_size))
    if restored:
        _LOG.warning("ds-capture serve: replica %d restored %d draft vocabular%s from %s (a restart: its trainers "
                     "go on with them)", plan.dp_rank, restored, "y" if restored == 1 else "ies", state.mappings.store)
    state.ready.set()
    state.metrics.ready.set(1)
    urls = ", ".join(f"http://{options.host}:{port}" for port in ports)
    _LOG.log(logging.INFO if plan.rank == 0 else logging.WARNING,
             "ds-capture serve: %s, replica %d of %d on http://%s:%d (world %d: dp %d x tp %d, ep %d; aux layers %s); "
             "NeMo recipe_args: target_model_backend: remote, remote_urls: [%s]", target.path, plan.dp_rank,
             plan.dp_size, options.host, ports[plan.dp_rank], plan.world_size, plan.dp_size, plan.tp_size,
             plan.ep_size, session.layer_ids, urls)


class _ServeLoop:
    """The per-tick loop of the module docstring (every rank runs one): a listener takes what one forward answers,
    the ranks agree on it (:class:`~ds_capture.session.Lockstep`), forward together, and the answers are computed
    while the next tick runs (:class:`_Answers`)."""

    def __init__(self, lockstep: Lockstep, plan, groups, compute_dtype: torch.dtype, state: ServiceState | None,
                 answers: "_Answers | None", options: ServeOptions) -> None:
        self.lockstep, self.plan, self.state, self.answers, self.options = lockstep, plan, state, answers, options
        self.tp_group = groups.tp_group if groups is not None else None
        self.leader = plan.tp_ranks[0]  # the global rank of this replica's listener
        self.compute_dtype = compute_dtype
        self.forwards = 0
        self._logits_checked = False
        self._next_log = time.monotonic() + options.log_interval_s

    def run(self) -> str:
        next_trim = time.monotonic() + _TRIM_EVERY_S
        try:
            while True:
                jobs = self._take()
                step = self.lockstep.agree(self._ballot(jobs))  # the one control collective of the tick
                if time.monotonic() >= next_trim:
                    release_freed_memory()  # see its docstring: what the requests' tensors left behind
                    next_trim = time.monotonic() + _TRIM_EVERY_S
                # Taken jobs are answered also on the tick the ranks stop or a replica says exit.
                if step.num_forwards:
                    try:
                        self._forward(step, jobs)
                    except BaseException as error:
                        # Dropped (a connection error, which NeMo's client retries): the service goes down.
                        for job in jobs:
                            resolve(job.future, error=Stopping(f"the service failed: {type(error).__name__}"))
                        raise
                if step.stop:
                    return self.lockstep.reason()
                if step.exit:
                    return "a client disconnected (--exit-on-disconnect)"
        finally:
            if self.answers is not None:
                self.answers.close()  # the answers of the last forward go out before the listener closes
            self.lockstep.close()

    def _ballot(self, jobs: list[Job]) -> Ballot:
        """This rank's say: the shape of the jobs it took, or (none taken) whether a client asked it to exit."""
        if jobs:
            return Ballot(rows=sum(job.request.num_rows for job in jobs), length=jobs[0].request.seq_length)
        state = self.state
        return Ballot(exit=state is not None and state.exit_on_disconnect and state.disconnected.is_set())

    def _take(self) -> list[Job]:
        """A listener's jobs for this tick (waiting up to ``tick_s`` for one), and its progress line when due."""
        if self.state is None:
            return []
        jobs = self.state.scheduler.take(self.options.tick_s)
        if self.options.log_interval_s and time.monotonic() >= self._next_log:
            self.state.metrics.queue_depth.set(self.state.scheduler.depth())
            _LOG.log(logging.INFO if self.plan.rank == 0 else logging.WARNING, "%s", self.state.metrics.line())
            self._next_log = time.monotonic() + self.options.log_interval_s
        return jobs

    def _forward(self, step: Step, jobs: list[Job]) -> None:
        started = time.monotonic()
        rows, length = step.shapes[self.leader]
        if rows == 0:  # another replica has work: this one forwards fillers only
            self.lockstep.forward(step, None)
            return
        input_ids, attention_mask = self._from_leader(jobs, rows, length)
        # NeMo's forward: the client's attention mask, whatever its padding (left padding included).
        output = self.lockstep.forward(step, {"input_ids": input_ids, "attention_mask": attention_mask})
        self.forwards += 1
        if self.answers is None:
            return
        hooks = self.lockstep.target_forward.hooks
        aux, last = hooks.collect(self.compute_dtype)
        hooks.reset()
        if not self._logits_checked:
            problem = logits_mismatch(self.answers.supervisor.logits(last[:, -1]), output, self.compute_dtype)
            if problem is not None:
                raise CaptureError(f"{problem}; ds-capture serve cannot answer generate for this target.")
            self._logits_checked = True
        del output
        self.answers.submit(jobs, aux, last, started)

    def _from_leader(self, jobs: list[Job], rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The listener's ``input_ids`` and ``attention_mask`` (its jobs' rows, in order) on every rank of its TP
        group (the ranks that see the same rows): one broadcast of both, the rows' only transfer."""
        if jobs:
            input_ids = torch.cat([job.request.input_ids for job in jobs])
            attention_mask = torch.cat([job.request.attention_mask for job in jobs])
            if self.tp_group is None:
                return input_ids, attention_mask
            both = torch.stack([input_ids, attention_mask]).to(collective_device())
        else:
            both = torch.empty(2, rows, length, dtype=torch.int64, device=collective_device())
        torch.distributed.broadcast(both, src=self.leader, group=self.tp_group)
        return both[0], both[1]


class _Answers:
    """A listener's supervision on a worker thread: one forward's answers (:class:`Supervisor`) are computed, sent
    and counted while the next forward runs, as ``run``'s writer writes while the next forward runs. One forward's
    at a time, in order; each answer is computed from its own rows alone, so it is the same whatever runs beside it."""

    def __init__(self, supervisor: Supervisor, state: ServiceState) -> None:
        self.supervisor, self.state = supervisor, state
        self.requests = self.tokens = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_capture-answers")
        self._pending: Future | None = None

    def submit(self, jobs: list[Job], aux: torch.Tensor, last: torch.Tensor, started: float) -> None:
        """Answer ``jobs`` from their forward's captures (``[rows, S, .]``, the jobs' rows in order)."""
        self.wait()
        self._pending = self._pool.submit(self._answer, jobs, aux, last, started)

    def wait(self) -> None:
        """Until the answers in flight are sent (an unexpected failure of the worker is raised here)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def _answer(self, jobs: list[Job], aux: torch.Tensor, last: torch.Tensor, started: float) -> None:
        lo = 0
        for job in jobs:
            hi = lo + job.request.num_rows
            try:
                resolve(job.future, result=self.supervisor.compute(aux[lo:hi], last[lo:hi], job.request.input_ids,
                                                                   job.request.loss_mask, job.mapping))
            except Exception as error:  # noqa: BLE001 - this request's answer fails, the service goes on
                resolve(job.future, error=error)
            lo = hi
        scheduler, metrics = self.state.scheduler, self.state.metrics
        scheduler.done(jobs)
        tokens = sum(job.request.num_tokens for job in jobs)
        self.requests += len(jobs)
        self.tokens += tokens
        metrics.count_forward(rows=lo, tokens=tokens, seconds=time.monotonic() - started,
                              waits=[started - job.enqueued for job in jobs])
        metrics.queue_depth.set(scheduler.depth())
