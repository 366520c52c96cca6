"""Our own tensor parallelism for families AutoTP mis-shards: the family's explicit plan, applied to a plain model.

In:  a plain Hugging Face causal LM on ``meta`` (experts already expert-parallel or not), its
     :class:`~ds_capture.families.Family` (``tp_plan``: decoder-layer-relative linear paths -> ``colwise`` /
     ``gathered``), and this rank's TP group.
Out: the same model, each planned linear keeping this rank's block of output rows ``[r * N/tp, (r+1) * N/tp)``:
     ``colwise`` layers (the local heads of a head-major projection: MLA's ``q_b_proj`` and ``kv_b_proj``, GQA's
     ``q/k/v_proj``, an MLP's ``gate_proj`` / ``up_proj``) compute their block locally; ``gathered`` layers
     (``o_proj``, ``down_proj``) all-gather their split input, compute their block of outputs over the whole input
     dim and all-gather the outputs (:class:`GatheredLinear`), so no partial sums are ever added in another order
     than one process adds them: bit-identical to one process in fp32 and in bf16, where AutoTP's row-parallel split
     (even with the fp32 reduction) can flip near-tie router choices. Every other module (the DSA indexer, the
     low-rank ``q_a`` / ``kv_a`` projections and their norms, routers, embeddings, lm_head) stays whole.

Attention forwards of these families view their projections with ``-1`` heads, so a rank's local heads flow
through the model's own forward unchanged. Each sharded linear publishes ``owned_slices`` (leaf -> the part of
the checkpoint tensor it holds), which the loader reads, so a rank only ever reads its own block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ds_capture.engine.loading import OwnedSlice
from ds_capture.errors import CaptureError
from ds_capture.families import Family, get_submodule


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


def apply_tensor_parallel(model: nn.Module, family: Family, *, tp_group: dist.ProcessGroup, tp_size: int,
                          tp_rank: int) -> nn.Module:
    """Shard every linear of ``family.tp_plan`` in every decoder layer over ``tp_group`` (see the module doc)."""
    num_sharded = 0
    for index, layer in enumerate(get_submodule(model, family.layers)):
        for path, style in family.tp_plan.items():
            try:
                linear = layer.get_submodule(path)
            except AttributeError:
                continue  # e.g. shared_experts on a dense first layer
            assert isinstance(linear, nn.Linear) and style in ("colwise", "gathered"), (path, style)
            name = f"{family.layers}.{index}.{path}"
            # Both styles keep a block of output rows; "gathered" also needs the whole input (module doc).
            sizes = [linear.out_features] + ([linear.in_features] if style == "gathered" else [])
            for size in sizes:
                if size % tp_size:
                    raise CaptureError(
                        f"distributed.tp_size ({tp_size}) must divide {name}'s sizes ({', '.join(map(str, sizes))}): "
                        f"this family's tensor-parallel plan splits them evenly. Use a tp_size that divides them."
                    )
            length = linear.out_features // tp_size
            start = tp_rank * length
            owned = {"weight": OwnedSlice(dim=0, start=start, length=length)}
            _keep(linear, "weight", linear.weight.narrow(0, start, length))
            if linear.bias is not None:
                owned["bias"] = OwnedSlice(dim=0, start=start, length=length)
                _keep(linear, "bias", linear.bias.narrow(0, start, length))
            linear.out_features = length
            if style == "colwise":
                linear.__class__ = ColumnParallelLinear
            else:
                linear.__class__ = GatheredLinear
                linear.tp_group, linear.tp_size = tp_group, tp_size
            linear.owned_slices, linear.tp_size = owned, tp_size  # tp_size: plan reads the split (meta_layout)
            num_sharded += 1
    assert num_sharded, f"family {family.model_type!r}: no linear of its tp_plan found under {family.layers}"
    return model


def _keep(module: nn.Module, leaf: str, kept: torch.Tensor) -> None:
    kept = kept if kept.is_meta else kept.clone()
    setattr(module, leaf, nn.Parameter(kept.contiguous() if not kept.is_meta else kept, requires_grad=False))
