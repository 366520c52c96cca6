"""The counting half of ``ds-capture plan``: the sharded meta model -> a tensor table -> every rank's memory.

In:  the run config, the target, the compute dtype, a resolved layout (sharding, world, tp, ep, micro-batch), and what
     the session's cache kind and driver add: its hook semantics and its supervision (:mod:`.supervision`).
Out: :class:`Sizer.ranks` -> one :class:`RankEstimate` per rank (computed per distinct role, then expanded); other
     layouts that fit: :mod:`.alternatives`; the cache's size: :mod:`.cache_size`.

Parameters (and buffers) are counted from the model the engines would build, on ``meta``: the DeepSpeed layout
comes from :func:`~ds_capture.parallel.meta_layout.build_layout_on_meta` (the engine's EP, then DeepSpeed's own
AutoTP replacement), FSDP2's from its dim-0 chunk rule. One meta model per (engine, tp, ep) is built and kept.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from ds_capture.errors import CaptureError
from ds_capture.sizing import memory_model as mm
from ds_capture.sizing.cache_size import row_bytes
from ds_capture.sizing.carried_state import CarriedState, carried_state_bytes
from ds_capture.sizing.supervision import Supervision
from ds_capture.target import attention_sizes
from ds_capture.target.families import TargetInfo
from ds_capture.target.shard_spec import Member, Placement

KINDS = ("routed experts", "attention", "dense/shared MLP", "embeddings + lm_head", "other")
DTYPE_BYTES = mm.DTYPE_BYTES
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Layout:
    """A resolved layout as plan sizes it: the :class:`~ds_capture.parallel.layout.ParallelLayout`'s degrees and
    sharding (:func:`~ds_capture.parallel.resolve.layout_of` decided them), and the micro-batch."""

    engine: str
    world_size: int
    tp_size: int
    ep_size: int
    micro_batch_size: int
    sharding: str = "deepspeed"
    """How the non-expert parameters are split, as resolved: ``deepspeed`` (AutoTP, or whole), ``fsdp2`` (FSDP2's
    dim-0 chunks) or ``zero3`` (DeepSpeed ZeRO-3's flat partitions); one process is the plain model."""
    zero_stage: int = 0
    """``deepspeed_config``'s ``zero_optimization.stage`` as configured."""

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size

    @property
    def partitioned(self) -> bool:
        """FSDP2 or ZeRO-3: every non-expert parameter partitioned over every rank (tp 1)."""
        return self.sharding in ("fsdp2", "zero3")

    @staticmethod
    def of(parallel: Any, engine: str, micro_batch_size: int) -> "Layout":
        """The resolved :class:`~ds_capture.parallel.layout.ParallelLayout` as plan sizes it."""
        return Layout(engine, parallel.world_size, parallel.tp_size, parallel.ep_size, micro_batch_size,
                      sharding=parallel.sharding, zero_stage=parallel.zero_stage)

    def member(self, rank: int) -> Member:
        """``rank``'s index in each group of this layout (TP groups consecutive, EP groups consecutive)."""
        return Member(rank=rank, world_size=self.world_size, tp_rank=rank % self.tp_size, ep_rank=rank % self.ep_size)

    def describe(self) -> str:
        if self.sharding == "zero3":
            shape = f"engine deepspeed ZeRO-3, world {self.world_size}, ep {self.ep_size}"
        elif self.sharding == "fsdp2":
            shape = f"engine fsdp2, world {self.world_size}" + (f", ep {self.ep_size}" if self.ep_size > 1 else "")
        else:
            shape = f"world {self.world_size} = dp {self.dp_size} x tp {self.tp_size}, ep {self.ep_size}"
        return f"{shape}, micro_batch_size {self.micro_batch_size}"


@dataclass(frozen=True)
class TensorEntry:
    """One parameter or buffer of the sharded meta model: rank 0's shape and its placement in the layout's
    :class:`~ds_capture.target.shard_spec.ShardSpec` (None: whole on every rank)."""

    name: str
    kind: str
    itemsize: int
    shape: tuple[int, ...]
    is_expert: bool
    layer: int | None
    placement: Placement | None = None

    def local_numel(self, member: Member) -> int:
        """Elements ``member`` holds (the same rule the loader reads its slices by)."""
        return self.placement.local_numel(self.shape, member) if self.placement else math.prod(self.shape)

    def numel(self, tp_rank: int = 0) -> int:
        """Elements on TP rank ``tp_rank`` of a DeepSpeed layout; a partitioned tensor's whole size."""
        return self.local_numel(Member(tp_rank=tp_rank))

    @property
    def fsdp_sharded(self) -> bool:
        return self.placement is not None and self.placement.kind == "chunk"

    @property
    def zero3_partitioned(self) -> bool:
        return self.placement is not None and self.placement.kind == "flat"


@dataclass
class RankEstimate:
    """One rank's device and host memory, in bytes."""

    rank: int
    tp_rank: int
    ep_rank: int
    dp_rank: int
    is_writer: bool
    param_bytes_by_kind: dict[str, float]
    activation_bytes: float
    capture_bytes: float
    writer_device_bytes: float
    writer_host_bytes: float
    fsdp2_gather_bytes: float
    """The sharded engine's transient whole copies: FSDP2's all-gathered layers, or ZeRO-3's gathered modules."""
    reserve_bytes: float
    host_bytes: float
    gather_name: str = "FSDP2 all-gathered layers"
    supervision_bytes: float = 0.0
    """A supervising rank's (EAGLE-3) whole lm_head and one chunk of its logits (:mod:`.supervision`)."""

    @property
    def param_bytes(self) -> float:
        return sum(self.param_bytes_by_kind.values())

    @property
    def peak_bytes(self) -> float:
        return (self.param_bytes + self.activation_bytes + self.capture_bytes + self.writer_device_bytes
                + self.fsdp2_gather_bytes + self.reserve_bytes + self.supervision_bytes)

    def consumers(self) -> dict[str, float]:
        return {**self.param_bytes_by_kind, "activations": self.activation_bytes,
                "capture buffers": self.capture_bytes, self.gather_name: self.fsdp2_gather_bytes,
                "runtime reserve": self.reserve_bytes, "supervision (lm_head + logits)": self.supervision_bytes}

    def to_dict(self, budget: float) -> dict[str, Any]:
        return {"rank": self.rank, "tp_rank": self.tp_rank, "ep_rank": self.ep_rank, "dp_rank": self.dp_rank,
                "is_writer": self.is_writer, "param_bytes": int(self.param_bytes),
                "param_bytes_by_kind": {k: int(v) for k, v in self.param_bytes_by_kind.items()},
                "activation_bytes": int(self.activation_bytes), "capture_bytes": int(self.capture_bytes),
                "writer_device_bytes": int(self.writer_device_bytes),
                "writer_host_bytes": int(self.writer_host_bytes), "fsdp2_gather_bytes": int(self.fsdp2_gather_bytes),
                "reserve_bytes": int(self.reserve_bytes), "supervision_bytes": int(self.supervision_bytes),
                "peak_bytes": int(self.peak_bytes),
                "host_bytes": int(self.host_bytes), "fits": self.peak_bytes <= budget}


@dataclass(frozen=True)
class _Table:
    tensors: list[TensorEntry]
    shapes: mm.BlockShapes
    total_params: int
    text_config: Any
    attn_implementation: str
    """The attention implementation the model resolved (DeepSeek-V4 has only eager)."""
    gathers: tuple[str, ...] = ()
    """What the layout communicates in the forward (the spec's ``gathers``)."""


_TABLES: dict[tuple, _Table] = {}
"""Tensor tables by (config.json and its mtime, dtype, grain, attention, engine, tp, ep): immutable, kept."""


class Sizer:
    """Counts one target's ranks under any layout; meta models are built once per (engine, tp, ep)."""

    def __init__(self, cfg: Any, target: TargetInfo, layer_ids: list[int], compute_dtype: str,
                 tp_grain_size: int, *, pre_norm_last: bool = False, supervision: Supervision | None = None) -> None:
        self.cfg, self.target, self.layer_ids = cfg, target, layer_ids
        self.compute_dtype, self.tp_grain_size = compute_dtype, tp_grain_size
        self.pre_norm_last, self.supervision = pre_norm_last, supervision
        self.num_built = 0

    # -- the tensor table ----------------------------------------------------------------------------------------
    def _tables_world(self, sharding: str, world_size: int, ep_size: int = 1) -> int:
        """The ranks the sharding splits the family's row-parallel tables over (1: it has none, or plain FSDP2, which
        shards them as any parameter; FSDP2 with expert parallelism keeps them row-split like DeepSpeed): the only
        way the world size shapes a rank's tensors."""
        row_split = sharding != "fsdp2" or ep_size > 1
        return world_size if row_split and self.target.family.row_parallel_tables else 1

    def _key(self, sharding: str, tp_size: int, ep_size: int, world_size: int) -> tuple:
        config = self.target.path / "config.json"
        return (str(config), config.stat().st_mtime_ns, self.compute_dtype, self.tp_grain_size,
                self.cfg.recipe_args.target_attn_implementation, sharding, tp_size, ep_size,
                self._tables_world(sharding, world_size, ep_size))

    def has_table(self, sharding: str, tp_size: int, ep_size: int, world_size: int) -> bool:
        return self._key(sharding, tp_size, ep_size, world_size) in _TABLES

    def table(self, sharding: str, tp_size: int, ep_size: int, world_size: int) -> _Table:
        """The tensor table of one layout; built once per process (a meta model takes about a second)."""
        key = self._key(sharding, tp_size, ep_size, world_size)
        if key not in _TABLES:
            tables_world = self._tables_world(sharding, world_size, ep_size)
            _TABLES[key] = self._build_table(sharding, tp_size, ep_size, tables_world)
            self.num_built += 1
        return _TABLES[key]

    def _build_table(self, sharding: str, tp_size: int, ep_size: int, tables_world: int) -> _Table:
        from ds_capture.parallel.engram_parallel import RowParallelTable, row_parallel_tables
        from ds_capture.parallel.expert_parallel import moe_experts_modules
        from ds_capture.parallel.meta_layout import build_layout_on_meta
        from ds_capture.parallel.shard_spec import build_shard_spec

        family = self.target.family
        model = build_layout_on_meta(self.target, dtype=TORCH_DTYPES[self.compute_dtype], tp_size=tp_size,
                                     ep_size=ep_size, tp_grain_size=self.tp_grain_size,
                                     attn_implementation=self.cfg.recipe_args.target_attn_implementation,
                                     world_size=tables_world)
        # The engines' own spec (rank 0's shapes, every rank's sizes): FSDP2 with expert parallelism and ZeRO-3
        # leave the routed experts (E/ep per rank) and the row-split tables out of the partitioning.
        spec = build_shard_spec(model, Member(), sharding=sharding, family=family)
        expert_prefixes = tuple(f"{name}." for name, _ in moe_experts_modules(model, family)) if family.is_moe else ()
        tensors = []
        for name, tensor in (*model.named_parameters(), *model.named_buffers()):
            place = spec.placements.get(name)
            if place is not None and place.kind == "split" and 0 in place.sizes:
                raise CaptureError(
                    f"deepspeed tensor_parallel.tp_grain_size ({self.tp_grain_size}) leaves a rank an empty shard "
                    f"of {name}: lower tp_grain_size (1 always splits evenly) or the tp_size.")
            tensors.append(TensorEntry(
                name=name, kind=self._kind(name, expert_prefixes), itemsize=tensor.element_size(),
                shape=tuple(tensor.shape), is_expert=name.startswith(expert_prefixes), layer=self._layer(name),
                placement=place))
        # The unsharded model's size: every TP split summed back, every expert block times ep_size, every
        # row-parallel table whole.
        whole_rows = {f"{name}.weight": table.num_embeddings for name, table in row_parallel_tables(model, family)
                      if isinstance(table, RowParallelTable)}
        total = 0
        for name, p in model.named_parameters():
            place = spec.placements.get(name)
            tp_split = place is not None and place.kind == "split" and place.group == "tp"
            numel = math.prod(sum(place.sizes) if tp_split and d == place.dim else s for d, s in enumerate(p.shape))
            total += (numel * (ep_size if name.startswith(expert_prefixes) else 1)
                      // (p.shape[0] if name in whole_rows else 1) * whole_rows.get(name, 1))
        return _Table(tensors=tensors, shapes=self._block_shapes(model, tensors, tp_size), total_params=total,
                      text_config=family.text_config(model.config), gathers=spec.gathers,
                      attn_implementation=(family.attn_implementations[0] if family.is_nemo  # NeMo: its backend's
                                           else str(model.config._attn_implementation)))

    def _kind(self, name: str, expert_prefixes: tuple[str, ...]) -> str:
        family = self.target.family
        if name.startswith(expert_prefixes):
            return "routed experts"
        if name.startswith((f"{family.embed_tokens}.", f"{family.lm_head}.")):
            return "embeddings + lm_head"
        parts = name[len(family.layers) + 1:].split(".") if name.startswith(family.layers + ".") else []
        if len(parts) > 2 and parts[1] == family.attention:
            return "attention"
        if len(parts) > 2 and parts[1] == (family.moe_block or "mlp") and parts[2] != family.router:
            return "dense/shared MLP"
        return "other"  # norms, routers, hyper-connections, rotary and other buffers

    def _layer(self, name: str) -> int | None:
        prefix = self.target.family.layers + "."
        if not name.startswith(prefix):
            return None
        return int(name[len(prefix):].split(".", 1)[0])

    def _block_shapes(self, model: torch.nn.Module, tensors: list[TensorEntry], tp_size: int) -> mm.BlockShapes:
        """The sizes the activation estimate needs, read off this rank's (tp rank 0's) projections."""
        family = self.target.family
        text = family.text_config(model.config)
        outputs: dict[str, dict[int, int]] = {"attention": defaultdict(int), "dense/shared MLP": defaultdict(int)}
        intermediate = 0
        for entry in tensors:
            if entry.kind in outputs and entry.name.endswith(".weight") and len(entry.shape) == 2:
                outputs[entry.kind][entry.layer] += entry.shape[0]  # a projection's local output features
            if entry.is_expert and entry.name.endswith("down_proj") and len(entry.shape) == 3:
                intermediate = entry.shape[2]  # fused [E, H, I]
            if entry.is_expert and entry.name.endswith("down_projs") and len(entry.shape) == 3:
                intermediate = entry.shape[1]  # NeMo's GroupedExperts: [E, I, H]
        streams = int(getattr(text, family.residual_streams_key, 1) or 1) if family.residual_streams_key else 1
        return mm.BlockShapes(
            hidden_size=self.target.hidden_size, residual_streams=streams,
            attention_outputs=max(outputs["attention"].values(), default=0),
            attention_heads=self.target.num_attention_heads // tp_size,
            head_dim=int(getattr(text, "head_dim", None) or self.target.hidden_size // self.target.num_attention_heads),
            kv_heads=max(1, (self.target.num_key_value_heads or self.target.num_attention_heads) // tp_size),
            mlp_outputs=max(outputs["dense/shared MLP"].values(), default=0),
            experts_per_token=int(getattr(text, "num_experts_per_tok", None) or getattr(text, "num_experts_per_token", 0)
                                  or 0) if family.is_moe else 0,
            expert_intermediate=intermediate, vocab_size=self.target.vocab_size)

    # -- ranks ---------------------------------------------------------------------------------------------------
    def ranks(self, layout: Layout, storage: mm.ExpertStorage, chunk_tokens: int | None = None
              ) -> tuple[list[RankEstimate], mm.Term, list[mm.Term]]:
        """Every rank's estimate; ``chunk_tokens``: rows forwarded in chunks of that many tokens (None: whole)."""
        args = self.cfg.recipe_args
        table = self.table(layout.sharding, layout.tp_size, layout.ep_size, layout.world_size)
        c = DTYPE_BYTES[self.compute_dtype]
        B, S, H = layout.micro_batch_size, args.seq_length, self.target.hidden_size
        family, text = self.target.family, table.text_config
        chunked = bool(chunk_tokens and chunk_tokens < S)
        indexer = family.indexer_scores(text, B, S) if family.indexer_scores else 0
        stack, largest = mm.forward_activation_terms(
            table.shapes, micro_batch_size=B, seq_length=S, compute_bytes=c, ep_size=layout.ep_size,
            tp_size=layout.tp_size, fp32_row_parallel=self.compute_dtype != "fp32",
            attn_implementation=table.attn_implementation,
            keys_per_query=family.keys_per_query(text) if family.keys_per_query else 1.0,
            indexer_bytes=indexer,
            bias_bytes=family.attention_bias(text, B, S, chunk_tokens, c) if family.attention_bias else 0,
            dequantized_experts_bytes=self._layer_experts_bytes(table) if storage.bytes_per_param else 0,
            chunk_tokens=chunk_tokens, carried_bytes=B * self.carried_state().bytes_per_row if chunked else 0,
            carried_transient_bytes=B * self._chunk_transient(text, S, c, layout.tp_size) if chunked else 0,
            # The indexer scores a chunk's queries in blocks (ds_capture.target.query_blocks).
            indexer_queries=attention_sizes.block_queries(indexer // (B * S))
            if chunked and indexer and family.chunk_query_blocks else None,
            chunk_keys=family.chunk_attention_keys(text, chunk_tokens, S)
            if chunked and family.chunk_attention_keys else None, sdpa_mask_copy=not family.chunk_expansion)
        activation = sum(t.bytes for t in stack) + largest.bytes
        capture, capture_host = self._capture_bytes(B, S, chunk_tokens)
        micro_batch = B * row_bytes(self.cfg, self.target, self.layer_ids)  # as the cache kind stores its rows
        # Rank 0 reads the full embedding and lm_head on the host to write target_weights (checkpoint dtype: 2 B);
        # under supervision every supervising rank reads them (its lm_head, and serve's embeddings endpoint).
        target_weights = 2 * self.target.vocab_size * H * 2
        supervision = self.supervision
        supervised = sum(t.bytes for t in supervision.device_terms(B, S, chunk_tokens)) if supervision else 0
        answer = supervision.answer_bytes(B, S, len(self.layer_ids)) if supervision else 0
        fsdp, zero3 = layout.sharding == "fsdp2", layout.sharding == "zero3"
        gather = (self._fsdp2_gather(table, storage) if fsdp
                  else self._zero3_gather(table, storage, layout.world_size, self.target.family.lm_head) if zero3
                  else 0.0)
        by_role: dict[Any, dict[str, float]] = {}
        estimates = []
        for rank in range(layout.world_size):
            tp_rank = rank % layout.tp_size
            role = rank if fsdp else tp_rank  # ZeRO-3: tp 1, every rank holds the same partition sizes
            if role not in by_role:
                by_role[role] = self._rank_params(table, storage, layout.member(rank))
            is_writer = tp_rank == 0  # run's writer, serve's listener: the TP group's first rank
            device, host = mm.writer_memory(micro_batch, is_writer=is_writer and not answer,
                                            buffer_bytes=self.cfg.capture.writer_buffer_mib << 20)
            host_bytes = host.bytes + (answer if is_writer else 0)  # serve writes no cache: its answer is on the host
            reads_weights = rank == 0 or (is_writer and supervision is not None)
            estimates.append(RankEstimate(
                rank=rank, tp_rank=tp_rank, ep_rank=rank % layout.ep_size, dp_rank=rank // layout.tp_size,
                is_writer=is_writer, param_bytes_by_kind=by_role[role], activation_bytes=activation,
                capture_bytes=capture, writer_device_bytes=device.bytes, writer_host_bytes=host_bytes,
                fsdp2_gather_bytes=gather, reserve_bytes=mm.RUNTIME_RESERVE_BYTES,
                gather_name="ZeRO-3 gathered modules" if zero3 else "FSDP2 all-gathered layers",
                supervision_bytes=supervised if is_writer else 0,
                host_bytes=host_bytes + capture_host + (target_weights if reads_weights else 0)))
        return estimates, largest, stack

    def _capture_bytes(self, micro_batch_size: int, seq_length: int, chunk_tokens: int | None) -> tuple[float, int]:
        """(device, host) bytes of one forward's captures: every hooked layer's output held (EAGLE-3's pre-norm
        semantics hook layer L-1 too; DSpark's L-1 is the final norm's output, recorded anyway), collected in the
        cache dtype, or in the compute dtype where the writing rank supervises from them (EAGLE-3)."""
        last = self.target.num_hidden_layers - 1
        held = sum(1 for i in self.layer_ids if self.pre_norm_last or i != last)
        collected = DTYPE_BYTES[self.compute_dtype if self.supervision else self.cfg.recipe_args.cache_dtype]
        term, host = mm.capture_terms(
            micro_batch_size=micro_batch_size, seq_length=seq_length, hidden_size=self.target.hidden_size,
            num_held=held, num_layer_ids=len(self.layer_ids), compute_bytes=DTYPE_BYTES[self.compute_dtype],
            cache_bytes=collected, chunk_tokens=chunk_tokens)
        return term.bytes, host

    def carried_state(self) -> CarriedState:
        """One row's carried state under chunked prefill, on any rank (a meta forward, counted once)."""
        return carried_state_bytes(self.target, self.cfg.recipe_args.seq_length, DTYPE_BYTES[self.compute_dtype],
                                   attn_implementation=self.cfg.recipe_args.target_attn_implementation)

    def _chunk_transient(self, text_config, seq_length: int, compute_bytes: int, tp_size: int) -> int:
        """What one attention layer expands from its carried state per chunk at S, one row: a NeMo carrier's
        declared expansion, or the family's rule (GLM-5's latent attention, its heads split over TP)."""
        family = self.target.family
        expansion = family.chunk_expansion(text_config, seq_length, compute_bytes, tp_size) \
            if family.chunk_expansion else 0
        return max(self.carried_state().transient_bytes, expansion)

    @staticmethod
    def _layer_experts_bytes(table: _Table) -> int:
        """One MoE layer's local routed experts in the compute dtype (tp rank 0; every layer alike)."""
        per_layer: dict[int | None, int] = defaultdict(int)
        for entry in table.tensors:
            if entry.is_expert:
                per_layer[entry.layer] += entry.numel() * entry.itemsize
        return max(per_layer.values(), default=0)

    @staticmethod
    def _rank_params(table: _Table, storage: mm.ExpertStorage, member: Member) -> dict[str, float]:
        """One rank's parameter and buffer bytes by kind: each tensor's local elements under the spec, the routed
        experts in their storage's bytes."""
        kinds = dict.fromkeys(KINDS, 0.0)
        for entry in table.tensors:
            kinds[entry.kind] += mm.stored_bytes(entry.local_numel(member), entry.itemsize,
                                                 is_routed_expert=entry.is_expert, storage=storage)
        return kinds

    def rank_tensors(self, layout: Layout, rank: int) -> dict[str, tuple[int, int]]:
        """Plan's per-rank tensor table: every parameter and buffer ``rank`` holds, ``name -> (elements, item
        size)`` (routed experts as computed, whatever their storage), from the same spec the engine loads by."""
        table = self.table(layout.sharding, layout.tp_size, layout.ep_size, layout.world_size)
        member = layout.member(rank)
        return {entry.name: (entry.local_numel(member), entry.itemsize) for entry in table.tensors}

    @staticmethod
    def _fsdp2_gather(table: _Table, storage: mm.ExpertStorage) -> float:
        """FSDP2's unsharded copies during a forward: the root group (embeddings, final norm, lm_head) for the
        whole forward, and two decoder layers (the current one and the next one's overlapped all-gather)."""
        per_layer: dict[int | None, float] = defaultdict(float)
        for entry in table.tensors:
            if entry.fsdp_sharded:
                per_layer[entry.layer] += mm.stored_bytes(entry.numel(), entry.itemsize,
                                                          is_routed_expert=entry.is_expert, storage=storage)
        root = per_layer.pop(None, 0.0)
        return root + 2 * max(per_layer.values(), default=0.0)

    @staticmethod
    def _zero3_gather(table: _Table, storage: mm.ExpertStorage, world_size: int, lm_head: str) -> float:
        """ZeRO-3's whole copies, the larger of the forward's and the load's.

        Forward: a module's own parameters are gathered at its forward and released after it, so what is whole at
        once is one module's and its ancestors' own parameters (the deepest chain), a one-rank-group expert stack
        (kept expert-parallel) gathered as a copy too when the experts are dequantized; packed experts are no
        parameters (their per-expert scratch is an activation term). NeMo's causal LMs read ``lm_head.weight``
        in the root's own forward (``compute_lm_head_logits``), which ZeRO-3 then registers as the root's external
        parameter and gathers at the root's pre-forward: the lm_head is whole through every forward, so it counts
        as the root's own. Load (:mod:`ds_capture.parallel.zero3_engine`): one module's own parameters whole before
        partitioning, beside one block's partitions read as whole rows."""
        own: dict[str, float] = defaultdict(float)
        blocks: dict[int | None, float] = defaultdict(float)
        for entry in table.tensors:
            if entry.zero3_partitioned or (entry.is_expert and storage.bytes_per_param is None):
                module = entry.name.rpartition(".")[0]
                module = "" if module == lm_head else module
                own[module] += mm.stored_bytes(entry.numel(), entry.itemsize, is_routed_expert=entry.is_expert,
                                               storage=storage)
            if entry.zero3_partitioned:  # the rows covering a partition: at most two rows past it
                row = entry.numel() // entry.shape[0] if entry.shape else 1
                blocks[entry.layer] += (min(entry.numel(), -(-entry.numel() // world_size) + 2 * row)
                                        * entry.itemsize)

        def chain(module: str) -> float:
            parts = module.split(".") if module else []
            return own.get("", 0.0) + sum(own.get(".".join(parts[:i]), 0.0) for i in range(1, len(parts) + 1))

        forward = max((chain(m) for m in own), default=0.0)
        load = max(own.values(), default=0.0) + max(blocks.values(), default=0.0)
        return max(forward, load)
