"""The EAGLE-3 cache kind: NeMo AutoModel 0.7.0's EAGLE-3 offline cache (format v2) from any layout.

In: the run's config, the target, the tokenised rows of this DP rank, and per forward the hook
captures (3 pre-norm decoder outputs + the post-norm final state) and the model's last-position
logits. Out: what the runner's loop asks of a cache kind (``runner.CacheKind``): the
:class:`~ds_capture.cache.eagle3.format.Eagle3Manifest`, the draft vocabulary (counted over every DP
rank before any shard), the pre-shard files (``target_embeddings``, manifest, ``.ds_capture/run.json``),
one :class:`~ds_capture.cache.common.async_writer.MicroBatch` per forward for the
:class:`~ds_capture.cache.eagle3.writer.Eagle3Shards`, and ``.ds_capture/complete.json`` at the end.

Per micro-batch (EAGLE3_CACHE.md §3): ``input_ids`` / ``loss_mask`` shifted left by one (0 at S-1);
``attention_mask`` NeMo's rule, unshifted; ``aux_hidden_states`` unshifted, 0 on padding;
``position_mask`` / ``target_probs`` (or top-k) from :mod:`ds_capture.cache.eagle3.draft_distribution`.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from ds_capture import __version__
from ds_capture.cache.common.async_writer import AsyncShardWriter, MicroBatch
from ds_capture.cache.common.identity import continue_numerics, read_target_weights, refuse_changed_inputs
from ds_capture.cache.common.names import BOOKKEEPING_DIR, DTYPES
from ds_capture.cache.common.rerun_check import check_complete_cache
from ds_capture.cache.common.staging import HostStaging, slot_bytes
from ds_capture.cache.common.verify import padding_lengths
from ds_capture.cache.eagle3.draft_distribution import (
    DraftDistribution,
    count_supervised_tokens,
    logits_mismatch,
    select_draft_vocab,
    sum_counts_over_ranks,
)
from ds_capture.cache.eagle3.format import COMPLETE_NAME, RUN_RECORD_NAME, Eagle3Manifest, resolve_aux_layer_ids
from ds_capture.cache.eagle3.writer import (
    VOCAB_FIELDS,
    Eagle3Shards,
    check_eagle3_output_dir,
    is_complete,
    prepare_eagle3_output_dir,
    read_bookkeeping,
    write_bookkeeping,
    write_complete,
    write_eagle3_manifest,
    write_target_embeddings,
)
from ds_capture.capture.safety import OutputLock, input_fingerprints
from ds_capture.data.tokenization import pad_token_id
from ds_capture.errors import CaptureError
from ds_capture.parallel.layout import ParallelLayout
from ds_capture.recipe.config import RunConfig
from ds_capture.target.families import TargetInfo

_LOG = logging.getLogger("ds_capture")

def nemo_attention_mask(input_ids: torch.Tensor, strip_id: int | None, eos_id: int | None) -> torch.Tensor:
    """NeMo's ``attention_mask`` [B, S] int64: strip the trailing run of ``strip_id``; when it is eos the first
    of them stays content.

    ``strip_id`` is NeMo ChatDataset's ``_add_pad_token(tokenizer) or eos_token_id``: a pad id of 0 is falsy
    there, so NeMo strips eos instead and a row right-padded with id 0 gets an all-ones mask (NeMo's code
    wins over EAGLE3_CACHE.md §3, which says 1 on the content prefix then 0).
    """
    S = input_ids.shape[1]
    content = S - padding_lengths(input_ids, strip_id)
    if strip_id == eos_id:
        content = torch.where(content < S, content + 1, content)
    return (torch.arange(S)[None, :] < content[:, None]).to(torch.int64)


def shift_left(tensor: torch.Tensor) -> torch.Tensor:
    """``x[:, t+1]`` at t, 0 at S-1 (NeMo's ``_shift_left_with_zero``)."""
    shifted = torch.zeros_like(tensor)
    shifted[:, :-1] = tensor[:, 1:]
    return shifted


class Eagle3Kind:
    """The EAGLE-3 cache kind (see the module docstring); one instance per run."""

    pre_norm_last = True
    supervised = True

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.args = cfg.recipe_args
        self.cache_dtype = DTYPES[self.args.cache_dtype]
        self.special_ids: list[int | None] = []
        self.pad_id, self.eos_id, self.mask_strip_id = 0, None, None
        self.producer: dict[str, Any] = {}
        self.fingerprints: dict[str, str] = {}
        self.distribution: DraftDistribution | None = None
        self.compute_dtype = torch.float32

    def looks_complete(self, out_dir: Path) -> bool:
        return (Path(out_dir) / BOOKKEEPING_DIR / COMPLETE_NAME).is_file()

    def resolve_layer_ids(self, cfg: RunConfig, target: TargetInfo) -> list[int]:
        if target.family.eagle3_refusal:
            raise CaptureError(f"{cfg.source}: cache_kind eagle3: {target.family.eagle3_refusal}")
        return resolve_aux_layer_ids(cfg.recipe_args.aux_layer_ids, target.num_hidden_layers, source=cfg.source)

    def build_manifest(self, cfg: RunConfig, target: TargetInfo, layer_ids: list[int], *, tokenizer,
                       chat_template: str, num_samples: int, plan: ParallelLayout) -> Eagle3Manifest:
        args = self.args
        # NeMo reads the specials after its dataset is built: a missing pad token is its fallback id.
        self.pad_id, self.eos_id = pad_token_id(tokenizer), getattr(tokenizer, "eos_token_id", None)
        # NeMo strips the trailing run of ChatDataset.pad_token_id, which is `pad or eos`: eos for a pad id of 0.
        self.mask_strip_id = getattr(tokenizer, "pad_token_id", None) or self.eos_id
        self.special_ids = [getattr(tokenizer, "bos_token_id", None), self.eos_id, self.pad_id,
                            getattr(tokenizer, "unk_token_id", None)]
        self.producer = {"name": "ds_capture", "version": __version__, "engine": cfg.engine,
                         "world_size": plan.world_size, "dp_size": plan.dp_size, "tp_size": plan.tp_size,
                         "ep_size": plan.ep_size}
        # The vocabulary is filled in by publish(), after the counting pass over every DP rank.
        return Eagle3Manifest(
            target_model=args.target_model_name_or_path, target_vocab_size=target.vocab_size, draft_vocab_size=0,
            seq_length=args.seq_length, dtype=args.cache_dtype, num_samples=num_samples,
            shard_size=args.cache_shard_size, target_probs_topk=args.target_probs_topk or 0,
            aux_hidden_dim=target.hidden_size * len(layer_ids), aux_layer_ids=tuple(layer_ids), selected_token_ids=(),
            input_data=args.train_data_path, split=args.train_split, shuffle_seed=args.shuffle_seed,
            mask_reasoning_content=args.mask_reasoning_content, mask_generation_prompt=args.mask_generation_prompt,
        )

    def prepare_output(self, prepared: Any, target: TargetInfo, out_dir: Path, data_path: Path, lock: OutputLock,
                       *, restart: bool, verify_checksums: bool) -> None:
        """Rank 0, read-only until the lock: every identity field but the (not yet counted) vocabulary; the numerics
        (a rerun continues with the recorded CPU thread count: ``prepared.numerics``)."""
        self.fingerprints = input_fingerprints(data_path, target.path, invalid_rows=self.cfg.capture.invalid_rows)
        existing = check_eagle3_output_dir(out_dir, prepared.manifest, skip=VOCAB_FIELDS)
        if existing is not None and not restart:
            recorded = (read_bookkeeping(out_dir, RUN_RECORD_NAME) or {}).get("inputs", {})
            refuse_changed_inputs(out_dir, recorded, self.fingerprints)
        prepared.numerics, prepared.numerics_continued = continue_numerics(
            out_dir, prepared.numerics, setting=self.cfg.capture.cpu_threads,
            resuming=existing is not None and not restart, chunk_setting=self.cfg.capture.chunked_prefill)
        lock.acquire()

    def publish(self, prepared: Any, target: TargetInfo, plan: ParallelLayout, out_dir: Path, *,
                restart: bool, verify_checksums: bool) -> None:
        args, manifest = self.args, prepared.manifest
        vocab_size = manifest.target_vocab_size
        if args.draft_vocab_size is None or args.draft_vocab_size >= vocab_size:
            selected = list(range(vocab_size))  # NeMo's identity: no counting pass
        else:
            counts = torch.zeros(vocab_size, dtype=torch.long)
            for input_ids, loss_mask, _num_tokens in prepared.rows_by_shard.values():
                counts += count_supervised_tokens(input_ids, loss_mask, vocab_size)
            # Each DP rank counted its own rows; the ranks of one TP group hold the same rows.
            counts = sum_counts_over_ranks(counts, contributes=plan.is_writer)
            selected = select_draft_vocab(counts, draft_vocab_size=args.draft_vocab_size,
                                          special_token_ids=self.special_ids)
        manifest = prepared.manifest = dataclasses.replace(
            manifest, draft_vocab_size=len(selected), selected_token_ids=tuple(selected))
        if not plan.is_manifest_writer:
            return
        # Resume refuses a changed vocabulary (its columns are target_probs'); --restart recomputes it.
        prepared.done = prepare_eagle3_output_dir(out_dir, manifest, restart=restart,
                                                  skip=VOCAB_FIELDS if restart else ())
        prepared.already_complete = not restart and is_complete(out_dir, manifest)
        if prepared.already_complete:
            # complete.json says every shard was written, not that it is still there: check before "nothing to do".
            check = check_complete_cache(out_dir, manifest, checksums=verify_checksums)
            prepared.rerun_check = check.describe()
            if check.ok:
                return
            _LOG.warning("%s is marked complete, but %s; %s/%s is removed until they are written", out_dir,
                         prepared.rerun_check, BOOKKEEPING_DIR, COMPLETE_NAME)
            prepared.done -= set(check.damaged)
            prepared.already_complete = False
        # Until every shard is in, the directory must not look complete (a rerun rewrites it).
        (Path(out_dir) / BOOKKEEPING_DIR / COMPLETE_NAME).unlink(missing_ok=True)
        embed, _lm_head = read_target_weights(target)
        write_target_embeddings(out_dir, embed)  # NeMo's order: embeddings, manifest, shards
        write_eagle3_manifest(out_dir, manifest)
        write_bookkeeping(out_dir, RUN_RECORD_NAME, {"producer": self.producer, "inputs": self.fingerprints})

    def start(self, target: TargetInfo, *, device: torch.device, compute_dtype: torch.dtype,
              manifest: Eagle3Manifest, writes: bool) -> None:
        self.compute_dtype = compute_dtype
        if not writes:
            return  # the other ranks of a TP group discard their copy of the batch: no lm_head needed
        _embed, lm_head = read_target_weights(target)
        self.distribution = DraftDistribution(lm_head.to(device, compute_dtype), list(manifest.selected_token_ids),
                                              target_probs_topk=manifest.target_probs_topk,
                                              cache_dtype=self.cache_dtype)

    def open_writer(self, out_dir: Path, manifest: Eagle3Manifest, *, micro_batch_size: int, buffer_mib: int,
                    device: torch.device) -> AsyncShardWriter:
        # micro_batch() hands over host tensors (the distribution is computed in chunks and lands on the host),
        # so the slots only bound how many micro-batches wait: buffer_mib of them at full length.
        per_batch = slot_bytes({name: ((micro_batch_size, *shape[1:]), dtype)
                                for name, (shape, dtype) in manifest.expected_shard_tensors(0).items()})
        staging = HostStaging(max_in_flight=max(1, (buffer_mib << 20) // per_batch), buffer_bytes=1, device="cpu")
        return AsyncShardWriter(Eagle3Shards(out_dir, manifest), staging, synchronous=buffer_mib == 0)

    def micro_batch(self, batch: Any, hooks: Any, output: Any, *, writes: bool,
                    check_finite: Callable[[torch.Tensor, torch.Tensor], None]) -> MicroBatch | None:
        aux, last = hooks.collect(self.compute_dtype)
        hooks.reset()  # the hooks' own references to this forward's activations go now
        check_finite(aux, last)  # nan_policy record zeroes the row's states and loss_mask in place
        if not writes:
            return None
        self._check_logits(last, output)
        S = self.args.seq_length
        distribution = self.distribution.compute(last, batch.loss_mask, batch.num_tokens, S)
        tensors = {
            "input_ids": shift_left(batch.input_ids),
            "attention_mask": nemo_attention_mask(batch.input_ids, self.mask_strip_id, self.eos_id),
            "loss_mask": shift_left(batch.loss_mask),
            # [B, T, 3H]: positions past each row's real length are never written (they read as 0).
            "aux_hidden_states": aux.to(self.cache_dtype).cpu().contiguous(),
            **distribution,
        }
        return MicroBatch(shard_index=batch.shard_index, rows=batch.rows, num_tokens=batch.num_tokens, tensors=tensors)

    def _check_logits(self, last: torch.Tensor, output: Any) -> None:
        """lm_head(final norm output) must be the model's own logits (here at the last computed position)."""
        problem = logits_mismatch(self.distribution.logits(last[:, -1]), output, self.compute_dtype)
        if problem is not None:
            raise CaptureError(f"{problem}, so the EAGLE-3 distribution cannot be computed in chunks from the final "
                               "hidden state. Use cache_kind: dspark for this target.")

    def finish(self, out_dir: Path, manifest: Eagle3Manifest) -> None:
        write_complete(out_dir, manifest)


# NeMo's `precompute_eagle3` flags -> this project's YAML keys (one to one; docs/cache_formats.md "Cache kinds").
# Flags with no key here: --device (ours follows the launcher / CUDA), --resume (ours resumes by
# default; --restart recomputes), --log-level; --num-workers is accepted and unused, as for DSpark.
NEMO_EAGLE3_FLAGS: dict[str, str] = {
    "--target-model": "recipe_args.target_model_name_or_path",
    "--input-data": "recipe_args.train_data_path",
    "--output-dir": "recipe_args.cache_output_dir",
    "--seq-length": "recipe_args.seq_length",
    "--draft-vocab-size": "recipe_args.draft_vocab_size",
    "--target-probs-topk": "recipe_args.target_probs_topk",
    "--batch-size": "recipe_args.micro_batch_size",
    "--shard-size": "recipe_args.cache_shard_size",
    "--dtype": "recipe_args.cache_dtype",
    "--num-workers": "recipe_args.num_workers",
    "--split": "recipe_args.train_split",
    "--shuffle-seed": "recipe_args.shuffle_seed",
    "--aux-layer-ids": "recipe_args.aux_layer_ids",
    "--mask-reasoning-content": "recipe_args.mask_reasoning_content",
    "--mask-generation-prompt": "recipe_args.mask_generation_prompt",
    "--trust-remote-code": "recipe_args.trust_remote_code",
}
_NEMO_SWITCHES = {"--mask-reasoning-content", "--mask-generation-prompt", "--trust-remote-code"}
_NEMO_INTS = {"--seq-length", "--draft-vocab-size", "--target-probs-topk", "--batch-size", "--shard-size",
              "--num-workers", "--shuffle-seed"}
# NeMo's defaults where they differ from ours (our micro_batch_size defaults to 1, NeMo's batch to 4).
_NEMO_DEFAULTS = {"recipe_args.seq_length": 2048, "recipe_args.micro_batch_size": 4}


def recipe_from_nemo_argv(argv: list[str]) -> dict[str, Any]:
    """A NeMo ``precompute_eagle3`` argv as this project's YAML mapping (``cache_kind: eagle3``)."""
    values: dict[str, Any] = dict(_NEMO_DEFAULTS)
    i = 0
    while i < len(argv):
        flag = argv[i]
        if flag in ("--device", "--log-level"):
            i += 2
            continue
        if flag == "--resume":
            i += 1
            continue
        if flag not in NEMO_EAGLE3_FLAGS:
            raise CaptureError(f"precompute_eagle3 flag {flag!r} has no ds_capture key; known: "
                               f"{', '.join(sorted(NEMO_EAGLE3_FLAGS))}.")
        key = NEMO_EAGLE3_FLAGS[flag]
        if flag in _NEMO_SWITCHES:
            values[key], i = True, i + 1
        elif flag == "--aux-layer-ids":
            ids = []
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                ids.append(int(argv[i]))
                i += 1
            values[key] = ids
        else:
            values[key] = int(argv[i + 1]) if flag in _NEMO_INTS else argv[i + 1]
            i += 2
    recipe: dict[str, Any] = {"cache_kind": "eagle3", "recipe_args": {}}
    for key, value in values.items():
        recipe["recipe_args"][key.split(".", 1)[1]] = value
    return recipe
