"""The DSpark cache kind: NeMo AutoModel 0.7.0's DSpark offline cache (format v1, DESIGN §3).

In: the run's config, the target, the tokenised rows, and per forward the hook captures (the chosen layers'
features and the post-norm final state). Out: what the runner's loop asks of a cache kind
(:class:`ds_capture.cache.kind.CacheKind`): the :class:`~ds_capture.cache.dspark.format.Manifest`, rank 0's pre-shard
files (target weights, manifest with ``complete: false``), one :class:`~ds_capture.cache.common.async_writer.MicroBatch`
per forward for the in-place shard writer (:class:`~ds_capture.cache.dspark.writer.DSparkShards`), and the manifest
with ``complete: true`` at the end. Its sibling is :mod:`ds_capture.cache.eagle3.kind` (NeMo's EAGLE-3 cache v2).
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from ds_capture import __version__
from ds_capture.cache.common.async_writer import AsyncShardWriter, MicroBatch
from ds_capture.cache.common.identity import continue_numerics, read_target_weights, refuse_changed_inputs
from ds_capture.cache.common.names import DTYPES, MANIFEST_NAME
from ds_capture.cache.common.rerun_check import check_complete_cache
from ds_capture.cache.common.staging import HostStaging, slot_bytes
from ds_capture.cache.dspark.format import Manifest
from ds_capture.cache.dspark.writer import (
    DSparkShards,
    check_output_dir,
    prepare_output_dir,
    write_manifest,
    write_target_weights,
)
from ds_capture.capture.hooks import resolve_layer_ids
from ds_capture.capture.safety import OutputLock, input_fingerprints
from ds_capture.data.tokenization import chat_template_sha256
from ds_capture.parallel.layout import ParallelLayout
from ds_capture.recipe.config import RunConfig
from ds_capture.target.families import TargetInfo

_LOG = logging.getLogger("ds_capture")


class DSparkKind:
    """NeMo's DSpark offline cache (format v1): hidden states of chosen layers, manifest ``complete`` flag."""

    pre_norm_last = False
    supervised = False
    """Layer id L-1 is the post-final-norm state (DESIGN §3)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.dtype = DTYPES[cfg.recipe_args.cache_dtype]

    def looks_complete(self, out_dir: Path) -> bool:
        try:
            return json.loads((Path(out_dir) / MANIFEST_NAME).read_text()).get("complete") is True
        except (OSError, ValueError, AttributeError):
            return False

    def resolve_layer_ids(self, cfg: RunConfig, target: TargetInfo) -> list[int]:
        args = cfg.recipe_args
        return resolve_layer_ids(args.target_layer_ids, target.num_hidden_layers, args.draft_num_hidden_layers,
                                 source=cfg.source, family=target.family)

    def build_manifest(self, cfg: RunConfig, target: TargetInfo, layer_ids: list[int], *, tokenizer: Any,
                       chat_template: str, num_samples: int, plan: ParallelLayout) -> Manifest:
        args, template = cfg.recipe_args, chat_template
        return Manifest(
            target_model=args.target_model_name_or_path,
            target_model_type=target.model_type,
            target_vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            num_hidden_layers=target.num_hidden_layers,
            seq_length=args.seq_length,
            dtype=args.cache_dtype,
            num_samples=num_samples,
            shard_size=args.cache_shard_size,
            target_hidden_dim=target.hidden_size * len(layer_ids),
            target_last_hidden_dim=target.hidden_size,
            target_layer_ids=tuple(layer_ids),
            train_data_path=args.train_data_path,
            train_split=args.train_split,
            shuffle_seed=args.shuffle_seed,
            mask_reasoning_content=args.mask_reasoning_content,
            mask_generation_prompt=args.mask_generation_prompt,
            chat_template_sha256=chat_template_sha256(template),
            bookkeeping={"producer": {"name": "ds_capture", "version": __version__, "engine": cfg.engine,
                                      "world_size": plan.world_size, "dp_size": plan.dp_size, "tp_size": plan.tp_size,
                                      "ep_size": plan.ep_size}, **_reduced_depth(target)},
        )

    def prepare_output(self, prepared: Any, target: TargetInfo, out_dir: Path, data_path: Path, lock: OutputLock,
                       *, restart: bool, verify_checksums: bool) -> None:
        _prepare_output(prepared, target, out_dir, data_path, lock, cache_dtype=self.cfg.recipe_args.cache_dtype,
                        invalid_rows=self.cfg.capture.invalid_rows, cpu_threads=self.cfg.capture.cpu_threads,
                        chunked_prefill=self.cfg.capture.chunked_prefill, restart=restart,
                        verify_checksums=verify_checksums)

    def publish(self, prepared: Any, target: TargetInfo, plan: ParallelLayout, out_dir: Path, *,
                restart: bool, verify_checksums: bool) -> None:
        pass  # the target weights and the complete=false manifest were written by prepare_output

    def start(self, target: TargetInfo, *, device: torch.device, compute_dtype: torch.dtype, manifest: Any,
              writes: bool) -> None:
        pass

    def open_writer(self, out_dir: Path, manifest: Manifest, *, micro_batch_size: int, buffer_mib: int,
                    device: torch.device) -> AsyncShardWriter:
        return AsyncShardWriter(DSparkShards(out_dir, manifest),
                                host_staging(manifest, micro_batch_size, buffer_mib, device),
                                synchronous=buffer_mib == 0)

    def micro_batch(self, batch: Any, hooks: Any, output: Any, *, writes: bool,
                    check_finite: Callable[[torch.Tensor, torch.Tensor], None]) -> MicroBatch | None:
        hidden, last = hooks.collect(self.dtype)
        hooks.reset()  # the hooks' own references to this forward's activations go now
        check_finite(hidden, last)
        if not writes:
            return None
        # The states leave the device at the writer's put (into a bounded host slot).
        return MicroBatch(shard_index=batch.shard_index, rows=batch.rows, num_tokens=batch.num_tokens,
                          tensors={"input_ids": batch.input_ids, "loss_mask": batch.loss_mask,
                                   "target_hidden_states": hidden, "target_last_hidden_states": last})

    def finish(self, out_dir: Path, manifest: Manifest) -> None:
        write_manifest(out_dir, manifest.with_complete(True))


def host_staging(manifest: Manifest, micro_batch_size: int, buffer_mib: int, device: torch.device) -> HostStaging:
    """Slots for the captured states of ``buffer_mib`` MiB of micro-batches at full length (at least one)."""
    S, dtype = manifest.seq_length, DTYPES[manifest.dtype]
    states = {"target_hidden_states": ((micro_batch_size, S, manifest.target_hidden_dim), dtype),
              "target_last_hidden_states": ((micro_batch_size, S, manifest.target_last_hidden_dim), dtype)}
    per_batch = slot_bytes(states)
    return HostStaging(max_in_flight=max(1, (buffer_mib << 20) // per_batch), buffer_bytes=per_batch, device=device)


def _reduced_depth(target: TargetInfo) -> dict:
    """Bookkeeping of a reduced-depth diagnostic (``num_hidden_layers`` itself records N, as NeMo's does)."""
    if target.checkpoint_num_hidden_layers is None:
        return {}
    return {"reduced_depth": {"target_num_hidden_layers": target.num_hidden_layers,
                              "checkpoint_num_hidden_layers": target.checkpoint_num_hidden_layers,
                              "note": "diagnostic only: the target ran its first layers alone; not a usable cache"}}


def _prepare_output(prepared: Any, target: TargetInfo, out_dir: Path, data_path: Path, lock: OutputLock, *,
                    cache_dtype: str, invalid_rows: str, cpu_threads: int | str, chunked_prefill: int | str,
                    restart: bool, verify_checksums: bool) -> None:
    """Rank 0: refuse a foreign or changed-input directory (read-only), settle the numerics (a rerun continues with
    the recorded CPU thread count: ``prepared.numerics``), take its lock, find finished shards
    (of a complete cache: those that pass the rerun check), and unless every one is finished and the manifest
    says complete, write the target weights and the manifest with complete=false."""
    fingerprints = input_fingerprints(data_path, target.path, invalid_rows=invalid_rows)
    manifest = prepared.manifest = replace(
        prepared.manifest, bookkeeping={**prepared.manifest.bookkeeping, "inputs": fingerprints})
    existing = check_output_dir(out_dir, manifest)
    if existing is not None and not restart:
        refuse_changed_inputs(out_dir, existing.bookkeeping.get("inputs", {}), fingerprints)
    prepared.numerics, prepared.numerics_continued = continue_numerics(
        out_dir, prepared.numerics, setting=cpu_threads, resuming=existing is not None and not restart,
        chunk_setting=chunked_prefill)
    lock.acquire()
    prepared.done = prepare_output_dir(out_dir, manifest, restart=restart)
    if existing is not None and existing.complete and not restart:
        # complete: true says every shard was written, not that it is still there: check before "nothing to do".
        check = check_complete_cache(out_dir, manifest, checksums=verify_checksums)
        prepared.rerun_check = check.describe()
        if not check.ok:
            _LOG.warning("%s is marked complete, but %s; its manifest says complete: false until they are written",
                         out_dir, prepared.rerun_check)
            prepared.done -= set(check.damaged)
    prepared.already_complete = (len(prepared.done) == manifest.num_shards and existing is not None
                                 and existing.complete and not restart)
    if not prepared.already_complete:
        # Write order (DESIGN §3): target weights, manifest with complete=false, shards, complete=true.
        embed, lm_head = read_target_weights(target)
        write_target_weights(out_dir, embed, lm_head, cache_dtype)
        write_manifest(out_dir, manifest)


