"""Our own tensor parallelism for families AutoTP mis-shards: the family's explicit plan, applied to a plain model.

In:  a plain Hugging Face causal LM on ``meta`` (experts already expert-parallel or not), its
     :class:`~ds_capture.target.family.Family` (``tp_plan``: decoder-layer-relative paths -> a style), and this rank's
     TP group.
Out: the same model, each planned tensor keeping this rank's block ``[r * N/tp, (r+1) * N/tp)`` of its dim 0:

- ``colwise`` linears (the local heads of a head-major projection: MLA's ``q_b_proj`` and ``kv_b_proj``, GQA's
  ``q/k/v_proj``, DeepSeek-V4's ``q_b_proj``, an MLP's ``gate_proj`` / ``up_proj``) compute their block locally;
- ``gathered`` linears (``o_proj``, ``down_proj``, V4's ``o_b_proj``) all-gather their split input, compute their
  block of outputs over the whole input dim and all-gather the outputs (:class:`GatheredLinear`), so no partial
  sums are ever added in another order than one process adds them: bit-identical to one process in fp32 and in
  bf16, where AutoTP's row-parallel split (even with the fp32 reduction) can flip near-tie router choices;
- ``grouped`` linears (DeepSeek-V4's block-diagonal ``o_a_proj``: ``n_groups`` blocks of output rows, block g
  reading head group g) keep this rank's groups, which read exactly this rank's heads (:class:`LocalGroups`);
- ``heads`` parameters (V4's per-head attention ``sinks``) keep this rank's heads;
- ``per_rank`` integer attributes (V4's ``num_key_value_groups``: its one KV head, replicated, is broadcast to
  the rank's heads) are divided by ``tp``.

Every other module (DSA / V4 indexers, V4's compressors, the low-rank ``q_a`` / ``kv_a`` projections and their
norms, a single replicated KV head, routers, hyper-connections, embeddings, lm_head) stays whole.

Attention forwards of these families view their projections with ``-1`` heads, so a rank's local heads flow
through the model's own forward unchanged. Each sharded module publishes ``owned_slices`` (leaf -> the part of
the checkpoint tensor it holds), which the loader reads, so a rank only ever reads its own block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ds_capture.errors import CaptureError
from ds_capture.target.family import Family, get_submodule
from ds_capture.target.checkpoint_reads import OwnedSlice


class ColumnParallelLinear(nn.Linear):
    """This rank's output rows of a linear layer: a local result, no communication."""

    owned_slices: dict[str, OwnedSlice]
    tp_size: int


class GatheredLinear(nn.Linear):
    """The layer after a column-parallel one (``o_proj``, ``down_proj``) without a partial-sum reduction.

    Its input arrives split by the previous layer's columns (this rank's heads / intermediate block): it is
    all-gathered, this rank computes its block of output rows over the *whole* input dim, and the outputs are
    all-gathered. Every output element is then the same one-kernel dot product one process computes, so the result
    is bit-identical in bf16 too (a row-parallel split sums partial products in another order: near-tie router
    choices flipped, 1 of 1,200 routed tokens on the tiny GLM-5). The weight stays split ``tp`` ways; the price is
    two all-gathers instead of one all-reduce.
    """

    owned_slices: dict[str, OwnedSlice]
    tp_group: dist.ProcessGroup
    tp_size: int

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        full_input = _all_gather_last_dim(input, self.tp_group, self.tp_size)  # collective: every TP rank
        return _all_gather_last_dim(super().forward(full_input), self.tp_group, self.tp_size)


def _all_gather_last_dim(tensor: torch.Tensor, group: dist.ProcessGroup, world: int) -> torch.Tensor:
    """Concatenate every TP rank's ``tensor`` along the last dim, in rank order (= the split order)."""
    tensor = tensor.contiguous()
    pieces = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(pieces, tensor, group=group)
    return torch.cat(pieces, dim=-1)


class LocalGroups:
    """Mixin over a block-diagonal grouped linear (DeepSeek-V4's ``o_a_proj``) keeping this rank's groups.

    The attention views its (local) heads as ``config.o_groups`` groups before calling the projection; this rank's
    ``n_groups`` local groups are the same memory viewed ``n_groups`` ways, so the input is re-viewed and the
    model's own grouped forward runs on them."""

    n_groups: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.reshape(*x.shape[:-2], self.n_groups, -1))


_LOCAL_GROUP_CLASSES: dict[type, type] = {}

STYLES = ("colwise", "gathered", "grouped", "heads", "per_rank")


def apply_tensor_parallel(model: nn.Module, family: Family, *, tp_group: dist.ProcessGroup, tp_size: int,
                          tp_rank: int) -> nn.Module:
    """Shard every entry of ``family.tp_plan`` in every decoder layer over ``tp_group`` (see the module doc)."""
    num_sharded = 0
    for index, layer in enumerate(get_submodule(model, family.layers)):
        for path, style in family.tp_plan.items():
            assert style in STYLES, (path, style)
            parent_path, _, leaf = path.rpartition(".")
            try:
                parent = layer.get_submodule(parent_path) if parent_path else layer
                target = getattr(parent, leaf)
            except AttributeError:
                continue  # e.g. shared_experts on a dense first layer
            name = f"{family.layers}.{index}.{path}"
            if style == "per_rank":
                _check_divides(tp_size, name, [target])
                setattr(parent, leaf, target // tp_size)
                continue
            if style == "heads":
                _check_divides(tp_size, name, [target.shape[0]])
                _shard_rows(parent, {leaf: target}, tp_size, tp_rank)
                num_sharded += 1
                continue
            linear = target
            assert isinstance(linear, nn.Linear), (name, type(linear))
            if style == "grouped":
                _check_divides(tp_size, f"{name} (its n_groups)", [linear.n_groups])
            # Every style keeps a block of output rows; "gathered" also needs the whole input (module doc).
            _check_divides(tp_size, name, [linear.out_features] + ([linear.in_features] if style == "gathered" else []))
            params = {"weight": linear.weight, **({"bias": linear.bias} if linear.bias is not None else {})}
            _shard_rows(linear, params, tp_size, tp_rank)
            linear.out_features //= tp_size
            if style == "colwise":
                linear.__class__ = ColumnParallelLinear
            elif style == "gathered":
                linear.__class__ = GatheredLinear
                linear.tp_group = tp_group
            else:
                linear.__class__ = _local_groups_class(type(linear))
                linear.n_groups //= tp_size
            num_sharded += 1
    assert num_sharded, f"family {family.model_type!r}: no linear of its tp_plan found under {family.layers}"
    return model


def _check_divides(tp_size: int, name: str, sizes: list[int]) -> None:
    if any(size % tp_size for size in sizes):
        raise CaptureError(
            f"distributed.tp_size ({tp_size}) must divide {name}'s sizes ({', '.join(map(str, sizes))}): "
            f"this family's tensor-parallel plan splits them evenly. Use a tp_size that divides them."
        )


def _shard_rows(module: nn.Module, params: dict[str, torch.Tensor], tp_size: int, tp_rank: int) -> None:
    """Keep this rank's block of dim 0 (divisible by ``tp_size``) of each of ``module``'s ``params`` and publish
    the slices it owns."""
    owned = dict(getattr(module, "owned_slices", {}))
    for leaf, param in params.items():
        length = param.shape[0] // tp_size
        start = tp_rank * length
        owned[leaf] = OwnedSlice(dim=0, start=start, length=length)
        _keep(module, leaf, param.narrow(0, start, length))
    module.owned_slices, module.tp_size = owned, tp_size  # tp_size: plan reads the split (meta_layout)


def _local_groups_class(cls: type) -> type:
    if cls not in _LOCAL_GROUP_CLASSES:
        _LOCAL_GROUP_CLASSES[cls] = type(f"LocalGroups{cls.__name__}", (LocalGroups, cls), {})
    return _LOCAL_GROUP_CLASSES[cls]


def _keep(module: nn.Module, leaf: str, kept: torch.Tensor) -> None:
    kept = kept if kept.is_meta else kept.clone()
    setattr(module, leaf, nn.Parameter(kept.contiguous() if not kept.is_meta else kept, requires_grad=False))
