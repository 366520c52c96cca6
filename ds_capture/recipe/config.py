"""Configuration: a YAML recipe (+ DeepSpeed JSON) -> a validated, frozen :class:`RunConfig`.

In: the path of a YAML recipe in NeMo AutoModel's precompute schema (``dist_env``,
``distributed``, ``recipe_args``) plus this project's ``engine``, ``cache_kind`` and ``deepspeed_config`` keys,
and ``--set dotted.key=value`` overrides. Out: a frozen ``RunConfig``; the rest of the code never
sees a raw dict. Every value is type-checked and range-checked here, before any process group
or weight is touched; every error names the file and the YAML path of the bad value. Checks
that need the target's ``config.json`` (layer ids, head counts) live with the stages that own
those facts and also run before loading.

    cfg = load_config("configs/demo.yaml", overrides=["recipe_args.seq_length=256"])
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import yaml

from ds_capture.errors import CaptureError
from ds_capture.recipe.parsing import (
    apply_override,
    as_capture_error,
    build_section,
    check_type,
    load_deepspeed_config,
    warn_or_refuse_unknown,
)

CACHE_DTYPES = ("bf16", "fp16", "fp32")
ENGINES = ("deepspeed", "fsdp2")
CACHE_KINDS = ("dspark", "eagle3")


@dataclass(frozen=True, kw_only=True)
class DistEnvConfig:
    """``dist_env``: how the process group is initialised."""

    backend: str | None = None
    """``gloo`` or ``nccl``; default: nccl when CUDA is present, else gloo."""
    timeout_minutes: int = 30
    """Collective timeout."""
    heartbeat_timeout_seconds: float = 120.0
    """A rank whose heartbeat is older than this (frozen, its host unreachable) is dead: every other rank stops
    with ``RERUN_EXIT_CODE`` within this plus a few seconds. Heartbeats come from a thread, so they continue
    through model loading; keep it well above the longest stall of a healthy rank (GIL-holding calls)."""

    def __post_init__(self) -> None:
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"must be 'gloo' or 'nccl', got {self.backend!r}", "backend")
        if self.timeout_minutes < 1:
            raise ValueError(f"must be >= 1, got {self.timeout_minutes}", "timeout_minutes")
        # Below a second, a loaded host's scheduling jitter alone would look like a frozen rank.
        if not 1 <= self.heartbeat_timeout_seconds <= 60 * self.timeout_minutes:
            raise ValueError(f"must be between 1 and the collective timeout ({60 * self.timeout_minutes} s, "
                             f"dist_env.timeout_minutes), got {self.heartbeat_timeout_seconds:g}",
                             "heartbeat_timeout_seconds")


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """``distributed``: parallel degrees. Unset degrees may come from the DeepSpeed config instead."""

    tp_size: int | None = None
    """Tensor-parallel degree (DeepSpeed AutoTP); ranks of one TP group forward the same micro-batch."""
    ep_size: int | None = None
    """Expert-parallel degree for routed MoE experts."""
    pp_size: int = 1
    """Pipeline parallelism: not supported (forward hooks need the whole layer stack in one module)."""
    cp_size: int = 1
    """Context parallelism: not supported by the capture."""
    strategy: str | None = None
    """NeMo's sharding strategy name; recorded, the engine is chosen by the top-level ``engine`` key."""

    def __post_init__(self) -> None:
        for name in ("tp_size", "ep_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"must be >= 1, got {value}", name)
        if self.pp_size != 1:
            raise ValueError(
                f"pipeline parallelism is not supported (got {self.pp_size}): the capture hooks every decoder "
                "layer of one module. Set pp_size: 1 and shard a large target with tp_size / ep_size.",
                "pp_size",
            )
        if self.cp_size != 1:
            raise ValueError(
                f"context parallelism is not supported (got {self.cp_size}): each sequence must be forwarded "
                "whole to capture its hidden states. Set cp_size: 1.",
                "cp_size",
            )


@dataclass(frozen=True, kw_only=True)
class RecipeArgs:
    """``recipe_args``: target, data and cache settings (NeMo's precompute keys)."""

    target_model_name_or_path: str
    """Local Hugging Face checkpoint directory (config.json + safetensors + tokenizer), or ``demo:qwen3_moe_tiny``."""
    train_data_path: str
    """JSONL/JSON file, parquet file or Hugging Face dataset directory, or ``demo:conversations``."""
    cache_output_dir: str
    """Where the cache is written (a shared filesystem for multi-node runs)."""
    seq_length: int
    """S: every row is truncated or padded to it."""
    train_split: str | None = None
    """Split expression such as ``train[:1000]``; Hugging Face datasets are shuffled first."""
    micro_batch_size: int = 1
    """Rows per forward."""
    num_workers: int = 0
    """Accepted for NeMo compatibility; tokenisation runs in-process."""
    shuffle_seed: int = 42
    """Seed of the Hugging Face dataset shuffle (recorded even where unused)."""
    trust_remote_code: bool = False
    cache_dtype: str = "bf16"
    """Float dtype of cached hidden states and weights: bf16, fp16 or fp32."""
    cache_shard_size: int = 256
    """Rows per shard; a multiple of micro_batch_size."""
    target_layer_ids: tuple[int, ...] | None = None
    """Captured layers (strictly increasing; -1 = embeddings, L-1 = post-final-norm). Default: DESIGN §3 rule."""
    draft_num_hidden_layers: int = 5
    """Drives the default layer ids when target_layer_ids is unset."""
    target_num_hidden_layers: int | None = None
    """NeMo's reduced-depth diagnostic: build and read only the first N decoder layers (1 <= N <= L)."""
    chat_template: str | None = None
    """Override of the tokenizer's chat template: inline Jinja or a file path."""
    mask_reasoning_content: bool = False
    mask_generation_prompt: bool = False
    target_attn_implementation: str | None = None
    """``sdpa`` / ``eager`` / ...; default: the transformers default."""
    draft_vocab_size: int | None = None
    """EAGLE-3 only (NeMo's ``--draft-vocab-size``): the draft vocabulary; absent: the full target vocabulary."""
    target_probs_topk: int | None = None
    """EAGLE-3 only (``--target-probs-topk``): store the top-k of ``target_probs``; 0 or absent: in full."""
    aux_layer_ids: tuple[int, ...] | None = None
    """EAGLE-3 only (``--aux-layer-ids``): 3 distinct decoder layers (pre-norm outputs), in concatenation
    order. Default: NeMo's ``[1, L//2 - 1, L - 4]``."""

    @functools.cached_property
    def target_path(self) -> Path:
        """``target_model_name_or_path`` as a directory: a ``demo:`` name is resolved here (the demo target is
        built on first use), and nothing after the recipe sees the word. The manifest records the value as
        configured."""
        from ds_capture.demo import resolve_special_path

        return Path(resolve_special_path(self.target_model_name_or_path))

    @functools.cached_property
    def train_data(self) -> Path:
        """``train_data_path`` as a path, a ``demo:`` name resolved (the manifest records it as configured)."""
        from ds_capture.demo import resolve_special_path

        return Path(resolve_special_path(self.train_data_path))

    def __post_init__(self) -> None:
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"must be >= 1 or absent (absent: the full target vocabulary), got "
                             f"{self.draft_vocab_size}", "draft_vocab_size")
        if self.target_probs_topk is not None and self.target_probs_topk < 0:
            raise ValueError(f"must be >= 0 (0: target_probs stored in full), got {self.target_probs_topk}",
                             "target_probs_topk")
        aux = self.aux_layer_ids
        if aux is not None and (len(aux) != 3 or len(set(aux)) != 3 or min(aux) < 0):
            raise ValueError(
                f"must be exactly 3 distinct decoder layer ids >= 0 (EAGLE-3 concatenates 3 layers, matching the "
                f"draft's num_aux_hidden_states), got {list(aux)}", "aux_layer_ids")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"must be one of {', '.join(CACHE_DTYPES)}, got {self.cache_dtype!r}", "cache_dtype")
        if self.seq_length < 2:
            raise ValueError(f"must be >= 2, got {self.seq_length}", "seq_length")
        if self.micro_batch_size < 1:
            raise ValueError(f"must be >= 1, got {self.micro_batch_size}", "micro_batch_size")
        if self.cache_shard_size < 1:
            raise ValueError(f"must be >= 1, got {self.cache_shard_size}", "cache_shard_size")
        if self.cache_shard_size % self.micro_batch_size:
            raise ValueError(
                f"({self.cache_shard_size}) must be a multiple of micro_batch_size ({self.micro_batch_size}) "
                "so shards align to micro-batch boundaries",
                "cache_shard_size",
            )
        if self.draft_num_hidden_layers < 1:
            raise ValueError(f"must be >= 1, got {self.draft_num_hidden_layers}", "draft_num_hidden_layers")
        ids = self.target_layer_ids
        if ids is not None and (not ids or any(b <= a for a, b in zip(ids, ids[1:]))):
            raise ValueError(f"must be a non-empty, strictly increasing list, got {list(ids)}", "target_layer_ids")


@dataclass(frozen=True, kw_only=True)
class CaptureOptions:
    """``capture``: this project's throughput and robustness knobs (not part of NeMo's schema)."""

    pad_to_multiple_of: int = 64
    """Each micro-batch is computed at its longest row rounded up to this (0: always at seq_length).
    Hidden states at padding positions are written as 0 either way."""
    sort_by_length: bool = True
    """Batch rows of similar length together within each shard (rows are still written in dataset order)."""
    writer_buffer_mib: int = 1024
    """Host memory (MiB) for captured micro-batches waiting to be written (pinned on CUDA): the forward
    loop waits while it is full. At least one micro-batch fits whatever the value; 0 writes synchronously.
    Whole shards are never held: rows go to their place in the shard file as their micro-batch completes."""
    nan_policy: str = "fail"
    """``fail``: NaN/Inf in a captured state stops the run naming the sample. ``record``: the sample is
    written with zero states and loss_mask, and listed in .ds_capture/nonfinite_samples.json."""
    invalid_rows: str = "refuse"
    """A dataset row NeMo refuses (not JSON, not UTF-8, a shape its reader rejects): ``refuse`` stops the run
    naming the first one; ``skip`` leaves every such row out, captures the valid rows (``num_samples`` counts
    them), and lists each skipped row with the refusal's reason in ``.ds_capture/skipped_rows.json``. Part of the
    cache's identity: a rerun with the other setting over the same directory is refused."""
    metrics_interval_steps: int = 8
    """Forward steps between progress/metrics updates (no collective: each step's own carries the counts)."""
    gpu_memory_gib: float | None = None
    """GPU memory per rank (GiB) that ``run`` checks the layout against before any weight loads, with
    ``ds-capture plan``'s computation; default: the local CUDA device's total memory (no check on a machine
    without CUDA); 0 disables the check."""
    compute_dtype: str = "auto"
    """Dtype the target runs in: ``auto`` follows NeMo's producer (bf16 on CUDA, fp32 on CPU), whatever
    the cache dtype; or ``bf16`` / ``fp16`` / ``fp32``. States are cast to ``cache_dtype`` when captured."""
    cpu_threads: int | str = "auto"
    """Intra-op threads of each rank on CPU (``torch.set_num_threads``), part of a CPU run's numerics: fp32 sums
    are split over the threads, so another count can round to other bits. ``auto``: a process alone on its host
    takes the cores it is given (its CPU affinity), each of several local ranks ``cores // local ranks`` (at
    least 1), whatever the launcher set (torchrun's ``OMP_NUM_THREADS=1``). The count a cache was begun with is
    recorded in ``.ds_capture/numerics.json`` and a rerun over that cache uses it again at any world size, so its
    shards match byte for byte; an explicit count other than the recorded one is refused unless ``--restart``.
    On CUDA the forward runs on the GPU and this setting is not applied: it changes no bit of the cache."""
    expert_storage: str = "dequantized"
    """Quantized checkpoints: ``dequantized`` (every weight dequantized to the compute dtype on load) or
    ``checkpoint`` (routed experts stay resident in the checkpoint's FP8 / FP4 / INT4 format and are
    dequantized per expert just before its matmul; same cache bit for bit, less memory)."""
    chunked_prefill: int | str | bool = "auto"
    """How a row is forwarded: ``off`` (whole, as one forward), ``<tokens>`` (in chunks of that many tokens, in
    order, each layer carrying from the chunks before exactly the state its kind needs, so every captured tensor is
    the whole row's within float summation order; activations are bounded by the chunk, not the row), or ``auto``
    (whole rows where ``ds-capture plan`` says they fit the GPU budget or no budget is known, else the largest of
    S/2, S/4, ... that fits). A chunk as long as the row is the whole row. A
    chunk the family cannot take is refused before anything loads (docs/long_rows.md). Recorded with the cache's
    numerics: a rerun with ``auto`` continues with the recorded chunk, another setting is refused unless --restart."""

    def __post_init__(self) -> None:
        if self.expert_storage not in ("dequantized", "checkpoint"):
            raise ValueError(f"must be dequantized or checkpoint, got {self.expert_storage!r}", "expert_storage")
        if isinstance(self.cpu_threads, str) and self.cpu_threads != "auto" or (
                isinstance(self.cpu_threads, int) and self.cpu_threads < 1):
            raise ValueError(f"must be auto or a number of threads >= 1, got {self.cpu_threads!r}", "cpu_threads")
        if self.compute_dtype not in ("auto", *CACHE_DTYPES):
            raise ValueError(f"must be auto, bf16, fp16 or fp32, got {self.compute_dtype!r}", "compute_dtype")
        if self.pad_to_multiple_of < 0:
            raise ValueError(f"must be >= 0, got {self.pad_to_multiple_of}", "pad_to_multiple_of")
        if self.writer_buffer_mib < 0:
            raise ValueError(f"must be >= 0, got {self.writer_buffer_mib}", "writer_buffer_mib")
        if self.invalid_rows not in ("refuse", "skip"):
            raise ValueError(f"must be 'refuse' or 'skip', got {self.invalid_rows!r}", "invalid_rows")
        if self.nan_policy not in ("fail", "record"):
            raise ValueError(f"must be 'fail' or 'record', got {self.nan_policy!r}", "nan_policy")
        if self.gpu_memory_gib is not None and self.gpu_memory_gib < 0:
            raise ValueError(f"must be >= 0 (0: no check), got {self.gpu_memory_gib}", "gpu_memory_gib")
        if self.metrics_interval_steps < 1:
            raise ValueError(f"must be >= 1, got {self.metrics_interval_steps}", "metrics_interval_steps")
        if self.chunked_prefill is False:  # YAML 1.1 reads a bare `off` as false
            object.__setattr__(self, "chunked_prefill", "off")
        if self.chunked_prefill is True:
            raise ValueError("must be auto, off or a number of tokens, got true", "chunked_prefill")
        if isinstance(self.chunked_prefill, str) and self.chunked_prefill not in ("auto", "off"):
            raise ValueError(f"must be auto, off or a number of tokens, got {self.chunked_prefill!r}", "chunked_prefill")
        if isinstance(self.chunked_prefill, int) and self.chunked_prefill < 1:
            raise ValueError(f"must be >= 1 tokens (or auto / off), got {self.chunked_prefill}", "chunked_prefill")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One capture run, fully validated."""

    recipe_args: RecipeArgs
    dist_env: DistEnvConfig = field(default_factory=DistEnvConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    capture: CaptureOptions = field(default_factory=CaptureOptions)
    engine: str = "deepspeed"
    """``deepspeed`` (AutoTP + expert parallelism) or ``fsdp2`` (torch fully_shard)."""
    cache_kind: str = "dspark"
    """``dspark`` (NeMo's DSpark offline cache, format v1) or ``eagle3`` (its EAGLE-3 offline cache, format v2)."""
    deepspeed_config: Mapping[str, Any] | None = None
    """The DeepSpeed config: a path (relative to the YAML file) or an inline mapping; loaded here."""
    source: str = "<config>"
    """The YAML file this came from (for messages)."""
    overrides: tuple[str, ...] = ()
    """The ``--set dotted.key=value`` overrides applied to it (with ``source``: the command that made a cache)."""
    deepspeed_config_source: str = "<inline deepspeed_config>"

    def command_argv(self) -> list[str] | None:
        """``ds-capture run -c <the recipe's absolute path> [--set ...]``: the command that runs this config
        (None for a config built in code, which no command reproduces)."""
        if not Path(self.source).is_file():
            return None
        argv = ["ds-capture", "run", "-c", str(Path(self.source).resolve())]
        for override in self.overrides:
            argv += ["--set", override]
        return argv

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"must be one of {', '.join(ENGINES)}, got {self.engine!r}", "engine")
        if self.cache_kind not in CACHE_KINDS:
            raise ValueError(f"must be one of {', '.join(CACHE_KINDS)}, got {self.cache_kind!r}", "cache_kind")


# recipe_args keys that only one cache kind reads: key -> (its kind, why the other kind refuses it).
KIND_ONLY_KEYS: dict[str, tuple[str, str]] = {
    "draft_vocab_size": ("eagle3", "it sizes the draft vocabulary of EAGLE-3's target_probs; the DSpark cache "
                                   "stores hidden states and no target distribution"),
    "target_probs_topk": ("eagle3", "it compresses EAGLE-3's target_probs; the DSpark cache has none"),
    "aux_layer_ids": ("eagle3", "it names EAGLE-3's 3 aux layers; the DSpark cache captures "
                                "recipe_args.target_layer_ids"),
    "target_layer_ids": ("dspark", "EAGLE-3 captures exactly 3 pre-norm decoder outputs named by "
                                   "recipe_args.aux_layer_ids (NeMo's --aux-layer-ids)"),
    "draft_num_hidden_layers": ("dspark", "it only drives DSpark's default target_layer_ids; EAGLE-3's default "
                                          "aux layers are NeMo's [1, L//2 - 1, L - 4]"),
    "chat_template": ("dspark", "NeMo's precompute_eagle3 has no --chat-template and the EAGLE-3 manifest does not "
                                "record the template, so a cache made with an override could not be told apart; "
                                "put the template into the tokenizer's own chat_template instead"),
}


def _refuse_other_kind_keys(recipe_args: Mapping[str, Any], cache_kind: Any, source: str) -> None:
    for key in recipe_args:
        kind, reason = KIND_ONLY_KEYS.get(key, (cache_kind, ""))
        if kind != cache_kind and cache_kind in CACHE_KINDS:
            raise CaptureError(
                f"{source}: `recipe_args.{key}` applies only to cache_kind: {kind}, and this run writes the "
                f"{cache_kind} cache: {reason}. Remove the key, or set cache_kind: {kind}."
            )


_SECTIONS = {
    "dist_env": DistEnvConfig, "distributed": DistributedConfig, "recipe_args": RecipeArgs, "capture": CaptureOptions,
}


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read, override and validate a YAML recipe. Raises ``CaptureError`` naming file and key."""
    path = Path(path)
    if not path.is_file():
        raise CaptureError(f"config file {path} does not exist. Pass the path of a YAML recipe, e.g. configs/demo.yaml.")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise CaptureError(f"{path}: not valid YAML ({error}).") from error
    if not isinstance(raw, dict):
        raise CaptureError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}.")
    for override in overrides:
        apply_override(raw, override, path)
    return replace(parse_config(raw, source=str(path), base_dir=path.parent), overrides=tuple(overrides))


def parse_config(raw: Mapping[str, Any], *, source: str, base_dir: Path) -> RunConfig:
    """Validate an already-loaded mapping (the YAML plus overrides) into a ``RunConfig``."""
    warn_or_refuse_unknown(raw, "", set(_SECTIONS) | {"engine", "cache_kind", "deepspeed_config"}, source)
    cache_kind = check_type(raw.get("cache_kind", "dspark"), str, "cache_kind", source)
    if isinstance(raw.get("recipe_args"), dict):
        _refuse_other_kind_keys(raw["recipe_args"], cache_kind, source)
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        value = raw.get(name)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise CaptureError(f"{source}: `{name}` must be a mapping, got {type(value).__name__}.")
        sections[name] = build_section(cls, value, name, source)
    ds_config, ds_source = load_deepspeed_config(raw.get("deepspeed_config"), base_dir, source)
    engine = raw.get("engine", "deepspeed")
    try:
        return RunConfig(
            **sections,
            engine=check_type(engine, str, "engine", source),
            cache_kind=cache_kind,
            deepspeed_config=ds_config,
            source=source,
            deepspeed_config_source=ds_source,
        )
    except ValueError as error:
        raise as_capture_error(error, "", source) from None
