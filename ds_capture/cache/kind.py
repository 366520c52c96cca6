"""The cache-kind interface: what the capture loop (``runner``) asks of a cache format.

In: nothing (a ``Protocol``). Out: the methods a kind implements, in the order the runner calls them:
``resolve_layer_ids`` (before any process group), ``build_manifest`` and ``prepare_output`` (rank 0,
before any collective), ``publish`` (every rank, after the data agreed), ``start`` (the model is
built), ``open_writer`` / ``micro_batch`` (the loop), ``finish`` (rank 0, after every rank wrote).
Implementations: ``dspark.DSparkKind`` (NeMo's DSpark cache v1) and ``eagle3.Eagle3Kind`` (its EAGLE-3
cache v2); ``session.select_cache_kind`` picks one from ``cache_kind``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

import torch


class CacheKind(Protocol):
    """What the loop asks of a cache kind (``dspark.DSparkKind``, ``eagle3.Eagle3Kind``)."""

    pre_norm_last: bool
    """Hooks: layer id L-1 is the last decoder layer's own output (EAGLE-3), not the post-norm state (DSpark)."""
    supervised: bool
    """The writing rank computes the target's distribution from the final state and the whole lm_head (EAGLE-3;
    ``ds-capture plan`` counts that lm_head and one chunk of its logits)."""

    def looks_complete(self, out_dir: Path) -> bool:
        """A cheap hint, before anything is checked: ``out_dir`` seems to hold a finished cache of this kind (one
        process then loads the model only if :meth:`prepare_output` finds work; it decides, not this)."""

    def resolve_layer_ids(self, cfg: Any, target: Any) -> list[int]:
        """The captured layers, checked against the target (before any process group)."""

    def build_manifest(self, cfg: Any, target: Any, layer_ids: list[int], *, tokenizer: Any, chat_template: str,
                       num_samples: int, plan: Any) -> Any:
        """This run's manifest (EAGLE-3: without its vocabulary until :meth:`publish`)."""

    def prepare_output(self, prepared: Any, target: Any, out_dir: Path, data_path: Path, lock: Any, *,
                       restart: bool, verify_checksums: bool) -> None:
        """Rank 0, before any collective: refuse a foreign or changed directory, settle ``prepared.numerics`` with
        the cache's record (:func:`~ds_capture.cache.common.identity.continue_numerics`), take the lock."""

    def publish(self, prepared: Any, target: Any, plan: Any, out_dir: Path, *, restart: bool,
                verify_checksums: bool) -> None:
        """Every rank, after the data agreed: collectives, then rank 0's pre-shard files and finished shards.

        Whichever of the two finds the finished shards (``prepared.done``) runs the rerun check
        (:mod:`ds_capture.cache.common.rerun_check`) on a cache marked complete: a damaged shard is taken out of
        ``done`` and the completion mark withdrawn until it is rewritten; ``verify_checksums`` re-hashes
        every shard too. ``prepared.rerun_check`` says what the check found."""

    def start(self, target: Any, *, device: torch.device, compute_dtype: torch.dtype, manifest: Any,
              writes: bool) -> None:
        """The model is built: per-run state on the compute device (``writes``: this rank writes shards)."""

    def open_writer(self, out_dir: Path, manifest: Any, *, micro_batch_size: int, buffer_mib: int,
                    device: torch.device) -> Any:
        """The in-place shard writer over this kind's shard layout (``cache.async_writer.AsyncShardWriter``),
        its host memory bounded by ``buffer_mib`` (0: synchronous writes)."""

    def micro_batch(self, batch: Any, hooks: Any, output: Any, *, writes: bool,
                    check_finite: Callable[[torch.Tensor, torch.Tensor], None]) -> Any:
        """One forward's hook captures -> the writer's ``MicroBatch`` (None where this rank does not write)."""

    def finish(self, out_dir: Path, manifest: Any) -> None:
        """Rank 0, after every rank wrote its shards: mark the cache complete."""
