"""The capture loop: config -> layout -> data -> engine -> hooks -> cache, in lockstep over all ranks.

In: a validated :class:`~ds_capture.recipe.config.RunConfig`. Out: a cache directory (DESIGN §3) and a
:class:`RunSummary`. Everything a user can get wrong (config, target, layout, data rows, a
foreign output directory) is checked before any weight loads, and a refusal on rank 0 reaches
every rank at once. Each data-parallel rank forwards its contiguous, shard-aligned slice and its
tp-rank-0 writes global shard indices; rank 0 writes the target weights, the manifest with
``complete: false``, and after every rank has finished, the manifest with ``complete: true``.

    summary = run_capture(load_config("configs/demo.yaml"))
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from ds_capture.cache.common.files import (
    run_numerics,
    write_atomic,
    write_numerics,
    write_run_command,
    write_skipped_rows,
)
from ds_capture.cache.common.names import BOOKKEEPING_DIR, SKIPPED_ROWS_NAME
from ds_capture.cache.dspark.format import Manifest
from ds_capture.cache.kind import CacheKind
from ds_capture.capture.interrupt import Interrupted, StopOnSignal
from ds_capture.capture.micro_batches import PlannedBatch, micro_batches_to_do
from ds_capture.capture.progress import Progress, collective_device
from ds_capture.capture.safety import OutputLock
from ds_capture.data.tokenization import (
    open_dataset,
    pad_token_id,
    resolve_chat_template,
    tokenize_conversations,
)
from ds_capture.errors import CaptureError
from ds_capture.parallel.dist import agree_on_error, all_reduce_max_int, discover_env
from ds_capture.parallel.engines import build_model
from ds_capture.parallel.layout import ParallelLayout, new_groups
from ds_capture.recipe.config import RunConfig
from ds_capture.session import (
    Ballot,
    Lockstep,
    build_target_model,
    distributed_target,
    continue_recorded_numerics,
    plan_session,
    resolve_compute_dtype,
    select_cache_kind,
    session_cpu_threads,
    target_forward,
)
from ds_capture.target.families import TargetInfo
from ds_capture.target.inputs import check_checkpoint_files, check_token_ids, load_tokenizer, require_tokens

_LOG = logging.getLogger("ds_capture")


@dataclass(frozen=True)
class RunSummary:
    """What one run did (on this rank's DP group for the counts; rank 0 prints it)."""

    output_dir: str
    num_samples: int
    num_shards: int
    shards_written: int
    shards_skipped: int
    num_tokens: int
    bytes_written: int
    seconds: float
    capture_seconds: float = 0.0
    """Time in the forward/write loop (``seconds`` also counts data preparation and model loading)."""
    published: bool = True
    """False when the directory already held this complete cache and nothing was (re)written."""
    logical_bytes: int = 0
    """Size of the shards written (``st_size``): what a reader sees."""
    disk_bytes: int = 0
    """Their blocks on disk (``st_blocks * 512``): below ``logical_bytes`` where padding tails are holes."""
    writer_busy_seconds: float = 0.0
    """This rank's writer time spent writing (the rest of the loop it waited for work)."""
    rerun_check: str = ""
    """Rank 0: what the rerun check of a cache marked complete found (empty where it was not marked complete)."""
    rows_skipped: int = 0
    """Invalid dataset rows left out (``capture.invalid_rows: skip``), listed in .ds_capture/skipped_rows.json."""

    @property
    def padding_fraction(self) -> float:
        """Share of the shards' logical bytes that were never written (padding left as holes)."""
        return 1 - self.bytes_written / self.logical_bytes if self.logical_bytes else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.capture_seconds if self.capture_seconds > 0 else 0.0

    def format(self) -> str:
        return self._format() + (f"; {self.rows_skipped} invalid rows skipped (listed in {BOOKKEEPING_DIR}/"
                                  f"{SKIPPED_ROWS_NAME})" if self.rows_skipped else "")

    def _format(self) -> str:
        if not self.published:
            checked = f"; {self.rerun_check}" if self.rerun_check else ""
            return (f"{self.output_dir} already holds this complete cache ({self.num_samples} samples{checked}); "
                    "nothing to do")
        if self.shards_written == 0 and self.shards_skipped == self.num_shards:
            return (f"all {self.num_shards} shards of {self.output_dir} were already done; published the manifest "
                    f"(complete: true) for {self.num_samples} samples")
        return (
            f"captured {self.num_samples} samples into {self.output_dir}: {self.shards_written} shards written, "
            f"{self.shards_skipped} already done; {self.num_tokens:,} tokens at {self.tokens_per_s:,.0f} tokens/s; "
            f"{self.bytes_written / 2**20:,.1f} MiB written of {self.logical_bytes / 2**20:,.1f} MiB logical "
            f"({self.padding_fraction:.0%} padding not written), {self.disk_bytes / 2**20:,.1f} MiB on disk; "
            f"{self.seconds:.1f} s in all"
        )


def run_capture(cfg: RunConfig, *, restart: bool = False, verify_checksums: bool = False,
                show_progress: bool = True) -> RunSummary:
    """Run one capture described by ``cfg``; every rank of the job calls this.

    ``restart`` recomputes every shard. Otherwise finished shards are kept, and over a cache marked complete
    each shard is first checked from its header and sidecar (``verify_checksums``: re-hashed too), and only
    the damaged ones are recomputed (:mod:`ds_capture.cache.common.rerun_check`)."""
    env = discover_env()
    # From here on SIGTERM / SIGINT stop the run at a step boundary on every rank (exit 75), never mid-write.
    with StopOnSignal(announce=env.rank == 0) as stop:
        return _run_capture(cfg, env, stop, restart=restart, verify_checksums=verify_checksums,
                            show_progress=show_progress)


def _run_capture(cfg: RunConfig, env, stop: StopOnSignal, *, restart: bool, verify_checksums: bool,
                 show_progress: bool) -> RunSummary:
    session = plan_session(cfg, env)
    threads = session_cpu_threads(cfg, env)
    numerics = run_numerics(compute_dtype=_DTYPE_NAMES[resolve_compute_dtype(cfg.capture.compute_dtype)],
                            device="cpu" if threads is not None else "cuda", engine=cfg.engine, cpu_threads=threads,
                            chunk_tokens=session.chunk_tokens)
    with distributed_target(cfg, env, session.plan):  # this rank computes with `threads` threads from here
        return _run(cfg, session.target, session.layer_ids, session.plan, stop, numerics, restart=restart,
                    verify_checksums=verify_checksums, show_progress=show_progress, chunk_tokens=session.chunk_tokens)


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _run(cfg: RunConfig, target: TargetInfo, layer_ids: list[int], plan: ParallelLayout, stop: StopOnSignal,
         numerics: dict, *, restart: bool, verify_checksums: bool, show_progress: bool,
         chunk_tokens: int | None) -> RunSummary:
    out_dir = Path(cfg.recipe_args.cache_output_dir)
    started = time.perf_counter()
    lock = OutputLock(out_dir) if plan.is_manifest_writer else None
    kind = select_cache_kind(cfg)
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_capture-load") as pool:
            # One process: the model loads while the data is read and tokenised (no collective in either;
            # checkpoint reads, tensor copies and the Rust tokenizer release the GIL). Nothing is written
            # until every row is valid; a refusal still writes nothing (it is raised once the load returns).
            # A rerun over a finished cache usually has nothing to compute: there the model loads only if needed.
            eager = plan.world_size == 1 and (restart or not kind.looks_complete(out_dir))
            loading = pool.submit(_build_model, cfg, target, plan, None) if eager else None
            # Every rank validates every row (cheap, and the same error everywhere), then tokenises only
            # the rows of its own DP range. Any failure here ends every rank with the first message.
            error, prepared = None, None
            try:
                prepared = _prepare(cfg, kind, target, layer_ids, plan)
                prepared.numerics = numerics  # rank 0's kind settles them against the cache's record
            except Exception as caught:  # noqa: BLE001 - every rank must reach agree_on_error, whatever failed
                error = caught
            agree_on_error(error)
            require_tokens(all_reduce_max_int(prepared.max_tokens), cfg.recipe_args.train_data_path)
            # Only once every rank's rows tokenised does rank 0 touch the output directory.
            error = None
            if plan.is_manifest_writer:
                try:
                    _prepare_output_dir(kind, target, prepared, out_dir, lock, restart=restart,
                                        verify_checksums=verify_checksums)
                except Exception as caught:  # noqa: BLE001
                    error = caught
            agree_on_error(error)
            # The kind's collective preparation (EAGLE-3: the draft vocabulary over all DP ranks), then
            # rank 0's writes that depend on it; a refusal there also reaches every rank at once.
            try:
                kind.publish(prepared, target, plan, out_dir, restart=restart, verify_checksums=verify_checksums)
                if plan.is_manifest_writer and not prepared.already_complete:
                    _record_run(out_dir, prepared)
            except Exception as caught:  # noqa: BLE001 - as above
                error = caught
            agree_on_error(error)
            return _capture(kind, cfg, target, layer_ids, plan, prepared, loading, stop, started=started,
                            show_progress=show_progress, chunk_tokens=chunk_tokens)
    finally:
        if lock is not None:
            lock.release()


def _build_model(cfg: RunConfig, target: TargetInfo, plan: ParallelLayout, groups) -> torch.nn.Module:
    return build_target_model(cfg, target, plan, groups, build=build_model)


def _capture(kind: CacheKind, cfg: RunConfig, target: TargetInfo, layer_ids: list[int], plan: ParallelLayout,
             prepared: "_Prepared", loading: Future | None, stop: StopOnSignal, *, started: float,
             show_progress: bool, chunk_tokens: int | None) -> RunSummary:
    args = cfg.recipe_args
    out_dir = Path(args.cache_output_dir)
    manifest, rows_by_shard, pad_id = prepared.manifest, prepared.rows_by_shard, prepared.pad_id
    done_shards, already_complete, numerics = _broadcast_from_rank0(
        (prepared.done, prepared.already_complete, prepared.numerics))
    if not already_complete:
        chunk_tokens = continue_recorded_numerics(numerics, out_dir, chunk_tokens=chunk_tokens,
                                                  announce_threads=prepared.numerics_continued,
                                                  threads_setting=cfg.capture.cpu_threads)
    if already_complete:
        # Nothing to recompute and nothing to republish: the directory is left exactly as it was.
        _LOG.info("%s already holds this complete cache; nothing to do (use --restart to recompute)", out_dir)
        return RunSummary(output_dir=str(out_dir), num_samples=manifest.num_samples, num_shards=manifest.num_shards,
                          shards_written=0, shards_skipped=len(done_shards), num_tokens=0, bytes_written=0,
                          seconds=time.perf_counter() - started, published=False,
                          rerun_check=prepared.rerun_check, rows_skipped=len(prepared.skipped_rows or ()))
    if loading is not None:
        model = loading.result()
    else:
        model = _build_model(cfg, target, plan, new_groups(plan) if plan.world_size > 1 else None)

    device = next(model.parameters()).device
    kind.start(target, device=device, compute_dtype=resolve_compute_dtype(cfg.capture.compute_dtype),
               manifest=manifest, writes=plan.is_writer)
    options, batches = micro_batches_to_do(cfg, target, plan, manifest.num_shards, rows_by_shard.__getitem__,
                                           done_shards)
    # Every forward of a sharded engine is a collective: all ranks run the same number of steps;
    # ranks that run out of data forward a filler whose output is discarded (the Lockstep's).
    num_steps = all_reduce_max_int(len(batches))
    loop_started = time.perf_counter()
    progress = Progress(total_samples=manifest.num_samples, already_done=_rows_in(manifest, done_shards),
                        is_rank0=plan.rank == 0, show=show_progress,
                        metrics_path=out_dir / BOOKKEEPING_DIR / "metrics.jsonl", interval=options.metrics_interval_steps)
    writer = kind.open_writer(out_dir, manifest, micro_batch_size=args.micro_batch_size,
                              buffer_mib=options.writer_buffer_mib, device=device)
    # Each step's ballot is known in advance (cast VOTE_LAG_STEPS steps ahead); only writers count progress.
    schedule = [Ballot(rows=len(batch.rows), length=batch.length, samples=len(batch.rows) * plan.is_writer,
                       tokens=int(batch.num_tokens.sum()) * plan.is_writer) for batch in batches]
    nonfinite: list[int] = []
    with _output_errors(out_dir), writer, target_forward(model, target, layer_ids, pre_norm_last=kind.pre_norm_last,
                                                         chunk_tokens=chunk_tokens, chunks_to_host=True) as forward:
        lockstep = Lockstep(forward, stop, device=device, seq_length=args.seq_length, pad_id=pad_id,
                            schedule=schedule)
        stopped_at = _capture_steps(kind, lockstep, batches, num_steps, writer, progress, manifest, plan,
                                    options.nan_policy, nonfinite)
    lockstep.close()
    progress.step(num_steps, 0, 0, writer=writer, final=True)
    progress.close()
    if nonfinite:
        _record_nonfinite(out_dir, nonfinite, plan)
    if stopped_at is not None:
        finished = len(done_shards) + _sum_over_ranks([writer.shards_written])[0]  # collective, as every rank stopped
        raise Interrupted(f"stopped by {lockstep.reason()} after {stopped_at} of {num_steps} steps: {finished} of "
                          f"{manifest.num_shards} shards are finished (with their checksums), no partial file is "
                          "left under a final name; rerun the same command to continue.")

    return _publish(kind, plan, out_dir, manifest, writer, progress, prepared, len(done_shards),
                    started=started, loop_started=loop_started)


def _capture_steps(kind: CacheKind, lockstep: Lockstep, batches: list[PlannedBatch], num_steps: int, writer: Any,
                   progress: Progress, manifest: Manifest, plan: ParallelLayout, nan_policy: str,
                   nonfinite: list[int]) -> int | None:
    """The loop: every rank runs ``num_steps`` lockstep steps (fillers past its own batches); returns the step a
    signal stopped every rank at, or None."""
    for step in range(num_steps):
        # Collective, every step: a signal on any rank stops every rank before the same forward. Shards
        # whose rows are all written are finished (sidecar included); the .tmp of the others is deleted.
        agreed = lockstep.agree()
        if agreed.stop:
            writer.close(partial=True)
            lockstep.stop.finishing()
            return step
        batch = batches[step] if step < len(batches) else None
        inputs = batch.model_inputs() if batch is not None else None
        # Only the last position's logits: EAGLE-3 computes its distribution in chunks from the final
        # hidden state, checked against these last logits.
        output = lockstep.forward(agreed, inputs)
        if batch is not None:
            item = kind.micro_batch(batch, lockstep.target_forward.hooks, output, writes=plan.is_writer,
                                    check_finite=lambda hidden, last: (
                                        _check_finite(batch, hidden, last, manifest, nan_policy, nonfinite)))
            if item is not None:
                writer.put(item)
            del item
        progress.step(step, agreed.samples, agreed.tokens, writer=writer)
    return None


def _publish(kind: CacheKind, plan: ParallelLayout, out_dir: Path, manifest: Any, writer: Any, progress: Progress,
             prepared: "_Prepared", num_skipped: int, *, started: float, loop_started: float) -> RunSummary:
    """Rank 0 marks the cache complete once every rank has written its shards (and only if all of them
    succeeded); the run's summary, summed over the ranks (collective)."""
    agree_on_error(None)
    if plan.is_manifest_writer:
        with _output_errors(out_dir):
            kind.finish(out_dir, manifest)
    totals = _sum_over_ranks([writer.shards_written, writer.bytes_written, writer.logical_bytes, writer.disk_bytes])
    return RunSummary(
        output_dir=str(out_dir), num_samples=manifest.num_samples, num_shards=manifest.num_shards,
        shards_written=totals[0], shards_skipped=num_skipped, num_tokens=progress.global_tokens,
        bytes_written=totals[1], seconds=time.perf_counter() - started,
        capture_seconds=time.perf_counter() - loop_started, logical_bytes=totals[2], disk_bytes=totals[3],
        writer_busy_seconds=writer.busy_seconds, rows_skipped=len(prepared.skipped_rows or ()),
    )


def _prepare(cfg: RunConfig, kind: CacheKind, target: TargetInfo, layer_ids: list[int],
             plan: ParallelLayout) -> "_Prepared":
    """Data and manifest: every row validated (streaming, on every rank) and this rank's range tokenised,
    before anything is written or any weight loads."""
    args = cfg.recipe_args
    check_checkpoint_files(target)
    tokenizer = load_tokenizer(target, trust_remote_code=args.trust_remote_code)
    template = resolve_chat_template(tokenizer, args.chat_template)
    data_path = args.train_data
    dataset = open_dataset(str(data_path), split=args.train_split, shuffle_seed=args.shuffle_seed,
                           invalid_rows=cfg.capture.invalid_rows)
    manifest = kind.build_manifest(cfg, target, layer_ids, tokenizer=tokenizer, chat_template=template,
                                   num_samples=len(dataset), plan=plan)
    samples = plan.sample_range(manifest.num_samples, manifest.shard_size)
    conversations = dataset.conversations(samples.start, samples.stop)
    rows = tokenize_conversations(
        conversations, tokenizer, chat_template=template, seq_length=args.seq_length,
        mask_reasoning_content=args.mask_reasoning_content, mask_generation_prompt=args.mask_generation_prompt,
    )
    check_token_ids(rows.input_ids, rows.num_tokens, [c.where for c in conversations], target.vocab_size, target.path)
    del conversations
    rows_by_shard = {}
    for index in plan.shard_range(manifest.num_shards):
        lo = index * manifest.shard_size - samples.start
        hi = lo + manifest.shard_rows(index)
        rows_by_shard[index] = (rows.input_ids[lo:hi], rows.loss_mask[lo:hi], rows.num_tokens[lo:hi])
    return _Prepared(manifest=manifest, rows_by_shard=rows_by_shard, pad_id=pad_token_id(tokenizer),
                     data_path=data_path, max_tokens=int(rows.num_tokens.max()) if len(rows) else 0,
                     skipped_rows=[row.to_json() for row in dataset.skipped] if cfg.capture.invalid_rows == "skip"
                     else None, run_command=cfg.command_argv())


def _prepare_output_dir(kind: CacheKind, target: TargetInfo, prepared: "_Prepared", out_dir: Path,
                        lock: OutputLock, *, restart: bool, verify_checksums: bool) -> None:
    try:
        kind.prepare_output(prepared, target, out_dir, prepared.data_path, lock, restart=restart,
                            verify_checksums=verify_checksums)
    except OSError as error:
        raise output_error(out_dir, error) from error


def _record_run(out_dir: Path, prepared: "_Prepared") -> None:
    """Rank 0, once the kind decided there is work: the run's command (verify's repairs), its numerics (a rerun
    continues with them) and the skipped rows."""
    try:
        write_numerics(out_dir, prepared.numerics)
        if prepared.run_command is not None:
            write_run_command(out_dir, prepared.run_command)
        if prepared.skipped_rows is not None:
            write_skipped_rows(out_dir, prepared.skipped_rows)
    except OSError as error:
        raise output_error(out_dir, error) from error


def output_error(out_dir: Path, error: OSError) -> CaptureError:
    """A clear message for a read-only, full or missing output location (no partial file is left behind)."""
    import errno

    reason = {errno.ENOSPC: "the disk is full", errno.EROFS: "the filesystem is read-only",
              errno.EACCES: "permission denied", errno.EPERM: "permission denied",
              errno.EDQUOT: "the disk quota is exceeded"}.get(error.errno, error.strerror or str(error))
    return CaptureError(
        f"cannot write the cache to {out_dir}: {reason} ({error.filename or out_dir}). Free space or fix the "
        "permissions and rerun the same command: finished shards are kept and only the rest is recomputed."
    )


@dataclass
class _Prepared:
    manifest: Manifest
    rows_by_shard: dict
    pad_id: int
    data_path: Path | None = None
    max_tokens: int = 0
    done: set = field(default_factory=set)
    already_complete: bool = False
    rerun_check: str = ""
    run_command: list[str] | None = None
    skipped_rows: list[dict] | None = None
    """``capture.invalid_rows: skip``: the rows left out (``SkippedRow.to_json``); None under ``refuse``."""
    numerics: dict = field(default_factory=dict)
    """What this run computes with (``run_numerics``); on rank 0, after the kind's ``prepare_output``, the cache's
    recorded CPU thread count where the run continues a cache begun on CPU."""
    numerics_continued: bool = False
    """Rank 0: ``numerics`` carry the cache's recorded thread count (a rerun over it)."""


def _rows_in(manifest: Manifest, shards) -> int:
    return sum(manifest.shard_rows(index) for index in shards)


def _check_finite(batch: PlannedBatch, hidden: torch.Tensor, last: torch.Tensor, manifest: Manifest,
                  policy: str, nonfinite: list[int]) -> None:
    """NaN/Inf in a captured state at a content position: stop naming the sample (``fail``), or zero
    the row's states and loss_mask and record it (``record``)."""
    length = hidden.shape[1]
    content = (torch.arange(length)[None, :] < batch.num_tokens[:, None]).to(hidden.device)
    finite = torch.isfinite(hidden).all(dim=-1) & torch.isfinite(last).all(dim=-1)
    bad_rows = (~finite & content).any(dim=1).cpu()
    if not bool(bad_rows.any()):
        return
    samples = [batch.shard_index * manifest.shard_size + int(row) for row in batch.rows[bad_rows]]
    if policy == "fail":
        raise CaptureError(
            f"the target produced NaN/Inf hidden states for sample(s) {samples} (dataset order). Check the "
            "checkpoint and cache_dtype (fp16 overflows easily), or set capture.nan_policy: record to write "
            "such samples with zero states and loss_mask and list them in .ds_capture/nonfinite_samples.*.json."
        )
    hidden[bad_rows.to(hidden.device)] = 0
    last[bad_rows.to(last.device)] = 0
    batch.loss_mask[bad_rows] = 0
    nonfinite.extend(samples)


def _record_nonfinite(out_dir: Path, samples: list[int], plan: ParallelLayout) -> None:
    if not plan.is_writer:
        return
    path = out_dir / BOOKKEEPING_DIR / f"nonfinite_samples.dp{plan.dp_rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(sorted(samples))))
    _LOG.warning("%d sample(s) had NaN/Inf hidden states; written with zero states and loss_mask, listed in %s",
                 len(samples), path)


def _sum_over_ranks(values: list[int]) -> list[int]:
    """Sum ``values`` over all ranks (collective); identity without a process group."""
    import torch.distributed as torch_dist

    tensor = torch.tensor(values, dtype=torch.int64)
    if torch_dist.is_initialized():
        tensor = tensor.to(collective_device())
        torch_dist.all_reduce(tensor)
    return [int(v) for v in tensor.cpu()]


@contextmanager
def _output_errors(out_dir: Path) -> Iterator[None]:
    """Turn an I/O error of the shard writer (raised here with its cause) into a clear message."""
    try:
        yield
    except RuntimeError as error:
        if isinstance(error.__cause__, OSError):
            raise output_error(out_dir, error.__cause__) from error
        raise
    except OSError as error:
        raise output_error(out_dir, error) from error


def _broadcast_from_rank0(value):
    """Rank 0's ``value`` on every rank (collective; identity without a process group)."""
    import torch.distributed as torch_dist

    if not torch_dist.is_initialized():
        return value
    box = [value]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]
