"""The target session: one frozen target, sharded over the job's ranks, forwarded in lockstep; shared by every driver.

In: a validated :class:`~ds_capture.recipe.config.RunConfig` and the launcher's
:class:`~ds_capture.parallel.dist.DistEnv`. Out, in the order a driver uses them:

- :func:`plan_session`: the :class:`~ds_capture.sizing.session_plan.SessionPlan` (the target's facts, the cache
  kind's layer ids, the :class:`ParallelLayout`, the driver's largest forward), checked (family vs layout, resident
  experts, attention implementation, ``ds-capture plan``'s fit verdict on that same object) before any process
  group exists or any weight loads;
- :func:`distributed_target`: this rank's CPU threads (``capture.cpu_threads``, :func:`session_cpu_threads`), the
  process group and what keeps a sharded job honest (DeepSpeed's CPU all-reduce repaired, :class:`FailFast`,
  :class:`Liveness`, a dead peer's collective as a clear message);
- :func:`build_target_model`: the engine's sharded model (deepspeed | fsdp2 | single);
- :class:`TargetForward`: the scoped hooks and the per-micro-batch forward;
- :class:`Lockstep`: the step every rank of every driver runs together: one small integer collective agrees on
  the stop vote, every rank's micro-batch and its shape, and the fillers a rank forwards when it has fewer.

The drivers decide where rows come from and where results go: :func:`ds_capture.runner.run_capture` (the offline
cache) and :mod:`ds_capture.serve` (NeMo's remote target protocol), as vLLM's offline ``LLM`` and its API server
share one engine core.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from ds_capture.cache.common.names import BOOKKEEPING_DIR, DTYPES, NUMERICS_NAME
from ds_capture.cache.kind import CacheKind
from ds_capture.cache.registry import kind_class
from ds_capture.capture.chunked import forward_in_chunks
from ds_capture.capture.hooks import LayerCapture, capture_hidden_states
from ds_capture.capture.interrupt import VOTE_LAG_STEPS, StopOnSignal, StopVote
from ds_capture.capture.liveness import Liveness
from ds_capture.capture.safety import FailFast
from ds_capture.errors import RerunError
from ds_capture.parallel.cpu_threads import compute_on_cpu, resolve_cpu_threads, use_cpu_threads
from ds_capture.parallel.dist import DistEnv, distributed_session, repair_cpu_allreduce
from ds_capture.parallel.engines import build_model
from ds_capture.parallel.layout import ParallelLayout
from ds_capture.recipe.config import RunConfig
from ds_capture.sizing.command import refuse_if_not_fitting
from ds_capture.sizing.session_plan import SessionPlan, resolve_session
from ds_capture.target.families import TargetInfo

_LOG = logging.getLogger("ds_capture")


def plan_session(cfg: RunConfig, env: DistEnv, *, serve_rows: int | None = None) -> SessionPlan:
    """Every check of the target and the layout that needs no process group (a refusal here loads nothing): the
    :class:`SessionPlan` ``ds-capture plan`` sizes, resolved once (``serve_rows``: ``serve``'s ``--max-batch-rows``).
    """
    session = resolve_session(cfg, world_size=env.world_size, rank=env.rank, serve_rows=serve_rows)
    target = session.target
    if target.checkpoint_num_hidden_layers is not None and env.rank == 0:
        _LOG.warning("Reducing the target from %d to %d layers (target_num_hidden_layers): diagnostic/CI only, "
                    "not a usable cache.", target.checkpoint_num_hidden_layers, target.num_hidden_layers)
    # ds-capture plan's verdict on this same session, before any process group or weight (GPU or a stated budget
    # only); with a budget, chunked_prefill: auto forwards in the chunk that made plan's verdict fit.
    return refuse_if_not_fitting(cfg, session=session,
                                 compute_dtype=resolve_compute_dtype(cfg.capture.compute_dtype))


@contextmanager
def distributed_target(cfg: RunConfig, env: DistEnv, plan: ParallelLayout) -> Iterator[None]:
    """The job's process group with its guards, this rank computing with :func:`session_cpu_threads` threads; on
    every exit the group is torn down (barrier, destroy) and the process's earlier thread count is back."""
    with use_cpu_threads(session_cpu_threads(cfg, env)), distributed_session(
            env, backend=cfg.dist_env.backend, timeout_minutes=cfg.dist_env.timeout_minutes):
        # DeepSpeed's CPU shm all-reduce ignores process groups: off unless the TP group is the world (§6).
        repair_cpu_allreduce(env, tp_group_is_world=plan.tp_size == plan.world_size)
        # FailFast ends every rank within seconds of any rank's failure (not at the collective timeout);
        # Liveness within heartbeat_timeout_seconds of a rank (or the store's host) that stops answering.
        with FailFast(plan.rank), Liveness(env, limit_s=cfg.dist_env.heartbeat_timeout_seconds), peer_failures():
            yield


def select_cache_kind(cfg: RunConfig) -> CacheKind:
    """The one place the cache kind is chosen (``cache_kind``)."""
    return kind_class(cfg.cache_kind)(cfg)


def session_cpu_threads(cfg: RunConfig, env: DistEnv) -> int | None:
    """This rank's intra-op threads for ``capture.cpu_threads`` (``auto``: the host's cores shared by its local ranks);
    None where the forward runs on a GPU, where the count changes no bit and the process's own is left alone."""
    return resolve_cpu_threads(cfg.capture.cpu_threads, local_size=env.local_size) if compute_on_cpu() else None


def resolve_compute_dtype(name: str) -> torch.dtype:
    """``auto`` is NeMo's producer rule: bf16 on CUDA, fp32 on CPU (CPU bf16 matmuls are slow and lossy)."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return DTYPES[name]


def build_target_model(cfg: RunConfig, target: TargetInfo, plan: ParallelLayout, groups, *,
                       build=build_model) -> torch.nn.Module:
    """The frozen target on this rank, sharded by the configured engine (every rank of the job calls it).

    ``build``: :func:`~ds_capture.parallel.engines.build_model`, or what a driver's tests wrap it with."""
    return build(cfg.engine, target, plan, groups, dtype=resolve_compute_dtype(cfg.capture.compute_dtype),
                       attn_implementation=cfg.recipe_args.target_attn_implementation, ds_config=cfg.deepspeed_config,
                       expert_storage=cfg.capture.expert_storage)


def continue_recorded_numerics(numerics: dict, out_dir, *, chunk_tokens: int | None, announce_threads: bool,
                               threads_setting: int | str) -> int | None:
    """Compute with the numerics a cache was begun with (its ``.ds_capture/numerics.json``, settled by the cache kind
    on rank 0 and agreed by every rank): the CPU thread count and the chunked prefill's chunk, each announced in one
    line where it is not this run's own setting. Returns the chunk to forward with."""
    if numerics.get("chunk_tokens") != chunk_tokens:
        # capture.chunked_prefill: auto over a cache begun with another setting continues with that one.
        chunk_tokens = numerics.get("chunk_tokens")
        _LOG.info("continuing %s with %s, as it was begun (%s/%s): its new shards match the earlier ones", out_dir,
                  f"chunks of {chunk_tokens} tokens" if chunk_tokens else "whole rows", BOOKKEEPING_DIR, NUMERICS_NAME)
    count = numerics["cpu_threads"]
    if count is not None:
        # A rerun computes with the thread count the cache was begun with, at whatever world size it runs.
        session_threads = torch.get_num_threads()  # capture.cpu_threads here (distributed_target applied it)
        torch.set_num_threads(count)
        if announce_threads:
            _LOG.info("continuing %s with %d CPU thread%s per rank, the count it was begun with (%s/%s; here "
                      "capture.cpu_threads: %s gives %d): its new shards match the earlier ones byte for byte",
                      out_dir, count, "s" * (count != 1), BOOKKEEPING_DIR, NUMERICS_NAME, threads_setting,
                      session_threads)
    return chunk_tokens


class TargetForward:
    """One forward of the target with its hooks armed: what every rank runs for every micro-batch, in lockstep.

    ``hooks`` holds the captures of the last :meth:`forward` (:meth:`LayerCapture.collect`); the model is asked
    for the last position's logits only (``[B, S, vocab]`` would dwarf the hidden states)."""

    def __init__(self, model: torch.nn.Module, target: TargetInfo, hooks: LayerCapture, *,
                 chunk_tokens: int | None = None, chunks_to_host: bool = False) -> None:
        self.model = model
        self.hooks = hooks
        self.chunk_tokens = chunk_tokens
        self.chunks_to_host = chunks_to_host
        self.carriers = target.family.chunk_carriers  # a NeMo-built family's own carriers of its layers' state
        self.query_blocks = target.family.chunk_query_blocks  # indexers scoring a chunk's queries in blocks
        self.full_width = target.family.full_width
        # NeMo's classes take no `use_cache` (DeepSeek-V4.1's forward has no **kwargs; Kimi K3 passes them down).
        self.forward_kwargs = {"logits_to_keep": 1} if target.family.is_nemo else {"use_cache": False,
                                                                                    "logits_to_keep": 1}

    def forwards_for(self, length: int) -> int:
        """The model forwards a micro-batch of ``length`` tokens takes: its chunks, or 1 for a whole row."""
        return 1 if self.chunk_tokens is None else max(1, math.ceil(length / self.chunk_tokens))

    def forward(self, inputs: dict[str, torch.Tensor]) -> Any:
        """The model's output for ``inputs`` (already on the model's device); the hooks hold its captures.

        Collective for sharded engines: :meth:`Lockstep.forward` runs it, so that every rank runs as many model
        forwards as every other (:meth:`forwards_for` of its micro-batch, after fillers)."""
        input_ids = inputs["input_ids"]
        self.hooks.reset()
        chunked = self.forwards_for(input_ids.shape[1]) > 1
        self.hooks.to_host = chunked and self.chunks_to_host
        if chunked:
            return forward_in_chunks(self.model, inputs, self.chunk_tokens, self.forward_kwargs,
                                     carriers=self.carriers, query_blocks=self.query_blocks)
        return self.model(**inputs, **self.forward_kwargs)


@contextmanager
def target_forward(model: torch.nn.Module, target: TargetInfo, layer_ids: list[int], *,
                   pre_norm_last: bool, chunk_tokens: int | None = None,
                   chunks_to_host: bool = False) -> Iterator[TargetForward]:
    """Hooks registered for ``layer_ids`` (removed on exit, errors included) under ``torch.no_grad``; rows longer
    than ``chunk_tokens`` are forwarded in chunks (:mod:`ds_capture.capture.chunked`), and with ``chunks_to_host``
    (``run``) each chunk's captures leave the device as the chunk runs (the cache kinds take host tensors).

    ``no_grad``, not ``inference_mode``: gloo collectives fail inside inference mode (DESIGN §6)."""
    with torch.no_grad(), capture_hidden_states(model, target.family, layer_ids, target.num_hidden_layers,
                                                pre_norm_last=pre_norm_last) as hooks:
        yield TargetForward(model, target, hooks, chunk_tokens=chunk_tokens, chunks_to_host=chunks_to_host)


@dataclass(frozen=True)
class Ballot:
    """What one rank says of one step: the shape of its micro-batch (0 rows: it has none) and whether it asks the
    ranks to end (``serve --exit-on-disconnect``)."""

    rows: int = 0
    length: int = 0
    exit: bool = False
    samples: int = 0
    """What the micro-batch adds to the job's progress (``run``'s writer ranks; 0 elsewhere), summed in
    :class:`Step`."""
    tokens: int = 0

    def fields(self) -> tuple[int, ...]:
        return self.rows, self.length, int(self.exit), self.samples, self.tokens


@dataclass(frozen=True)
class Step:
    """What every rank agreed for one step, the same on every rank (:meth:`Lockstep.agree`)."""

    stop: bool
    """A signal reached some rank: every rank stops at this step (``reason`` says which)."""
    exit: bool
    """Some rank asked to end."""
    num_forwards: int
    """Model forwards every rank runs this step: the most any rank's micro-batch takes (0: no rank has rows)."""
    shapes: tuple[tuple[int, int], ...]
    """Every rank's ``(rows, length)`` by global rank (a TP group's ranks learn their leader's micro-batch)."""
    samples: int = 0
    """The ballots' ``samples`` and ``tokens``, summed over the ranks (``run``'s progress, without a collective)."""
    tokens: int = 0


class Lockstep:
    """The step every driver runs on every rank, in lockstep: ``run`` over its planned micro-batches, ``serve``
    over the requests each replica's listener took.

    Each step costs one small integer collective for control (:class:`StopVote`'s all-gather of every rank's
    stop flags and :class:`Ballot`, on a gloo side group): the stop vote, every rank's next micro-batch and its
    shape, and from them the number of model forwards every rank runs. A rank with fewer (no rows, or rows in
    fewer chunks) forwards one-row fillers first, whose output is discarded: a sharded engine's forward is a
    collective, and a rank that skipped one would hang the others (EP's all-to-all, FSDP2's gathers).

    ``schedule``: every step's ballot, known in advance (``run``): each is cast :data:`VOTE_LAG_STEPS` steps
    ahead and read when its step comes, so the collective never stalls a forward and data-parallel ranks may
    drift that far apart. ``None`` (``serve``): each step's ballot is cast and read at the step."""

    def __init__(self, forward: TargetForward, stop: StopOnSignal, *, device: torch.device, seq_length: int,
                 pad_id: int = 0, schedule: Sequence[Ballot] | None = None) -> None:
        self.target_forward, self.stop, self.device = forward, stop, device
        self._vote = StopVote(stop, lag=VOTE_LAG_STEPS if schedule is not None else 0, width=len(Ballot().fields()))
        self._schedule = schedule
        self._cast = 0
        # The filler: seq_length where the family computes every row at seq_length (its width is part of the
        # bits), else a few tokens; a family that takes chunks never is full-width.
        length = seq_length if forward.full_width else min(seq_length, 8)
        self._filler = torch.full((1, length), pad_id, dtype=torch.long, device=device)
        for _ in range(self._vote.lag):
            self._cast_scheduled()

    def _cast_scheduled(self) -> None:
        ballot = self._schedule[self._cast] if self._cast < len(self._schedule) else Ballot()
        self._vote.cast(ballot.fields())
        self._cast += 1

    def agree(self, ballot: Ballot | None = None) -> Step:
        """This step's agreement (collective: every rank, every step). ``ballot``: this rank's micro-batch for the
        step (``schedule`` is None), else the schedule's ballot ``lag`` steps ahead is cast."""
        if self._schedule is None:
            self._vote.cast(ballot.fields())
        else:
            self._cast_scheduled()
        ballots = self._vote.read()[:, 2:]  # [world_size, fields]: the stop flags are read by the vote
        rows, lengths, exits = ballots[:, 0].tolist(), ballots[:, 1].tolist(), ballots[:, 2].tolist()
        num_forwards = max((self.target_forward.forwards_for(length) for count, length in zip(rows, lengths)
                            if count), default=0)
        return Step(stop=self._vote.stopping, exit=any(exits), num_forwards=num_forwards,
                    shapes=tuple(zip(rows, lengths)), samples=int(ballots[:, 3].sum()), tokens=int(ballots[:, 4].sum()))

    def forward(self, step: Step, inputs: dict[str, torch.Tensor] | None) -> Any:
        """This rank's model forwards of ``step``: fillers up to ``step.num_forwards``, then ``inputs``' own (moved
        to the model's device; None: fillers only, and no output). The hooks hold ``inputs``' captures."""
        own = self.target_forward.forwards_for(inputs["input_ids"].shape[1]) if inputs is not None else 0
        forward = self.target_forward
        for _ in range(step.num_forwards - own):
            forward.model(input_ids=self._filler, **forward.forward_kwargs)
        if inputs is None:
            forward.hooks.reset()  # the fillers' captures are nobody's
            return None
        return forward.forward({name: tensor.to(self.device) for name, tensor in inputs.items()})

    def reason(self) -> str:
        """Which signals stopped the ranks (``"SIGTERM on 2 of 2 ranks"``)."""
        return self._vote.reason()

    def close(self) -> None:
        """Wait for the ballots in flight (every rank cast the same ones) and free the side group."""
        self._vote.close()


# What gloo / NCCL say when a peer process died under a collective.
_PEER_DIED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


@contextmanager
def peer_failures() -> Iterator[None]:
    """A collective that failed because a peer rank died becomes a clear message instead of a traceback."""
    try:
        yield
    except RuntimeError as error:
        if any(text in str(error) for text in _PEER_DIED):
            raise RerunError(
                f"a peer rank died during a collective ({str(error).splitlines()[0][:200]}). Its own log has the "
                "cause; rerun the same command to continue: finished shards are kept, the rest is recomputed."
            ) from error
        raise
