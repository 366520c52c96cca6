"""Our own tensor parallelism for families AutoTP mis-shards: the family's explicit plan, applied to a plain model.

In:  a plain Hugging Face causal LM on ``meta`` (experts already expert-parallel or not), its
     :class:`~ds_capture.families.Family` (``tp_plan``: decoder-layer-relative linear paths -> ``colwise`` /
     ``rowwise``), and this rank's TP group.
Out: the same model, each planned linear keeping this rank's block: ``colwise`` its output rows
     ``[r * N/tp, (r+1) * N/tp)`` (the local heads of a head-major projection: MLA's ``q_b_proj`` and ``kv_b_proj``,
     an MLP's ``gate_proj`` / ``up_proj``), ``rowwise`` the matching input columns (``o_proj``, ``down_proj``), whose
     partial products are computed in fp32, all-reduced in fp32 over the TP group and rounded once (as
     :func:`~ds_capture.engine.deepspeed_engine.reduce_row_parallel_in_fp32` does for AutoTP's layers). Every other
     module (the DSA indexer, the low-rank ``q_a`` / ``kv_a`` projections and their norms, routers, embeddings,
     lm_head) stays whole on every rank.

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


class RowParallelLinear(nn.Linear):
    """This rank's input columns of a linear layer: fp32 partial product, fp32 all-reduce, one rounding."""

    owned_slices: dict[str, OwnedSlice]
    tp_group: dist.ProcessGroup

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = torch.matmul(input.float(), self.weight.float().transpose(-1, -2))
        dist.all_reduce(output, group=self.tp_group)  # collective: every TP rank, same shapes
        if self.bias is not None:
            output = output + self.bias.float()  # once, after the sum
        return output.to(input.dtype)


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
            assert isinstance(linear, nn.Linear) and style in ("colwise", "rowwise"), (path, style)
            name = f"{family.layers}.{index}.{path}"
            dim = 0 if style == "colwise" else 1
            size = linear.weight.shape[dim]
            if size % tp_size:
                raise CaptureError(
                    f"distributed.tp_size ({tp_size}) must divide {name}'s {'output' if dim == 0 else 'input'} size "
                    f"({size}): this family's tensor-parallel plan splits it evenly. Use a tp_size that divides {size}."
                )
            length = size // tp_size
            start = tp_rank * length
            owned = {"weight": OwnedSlice(dim=dim, start=start, length=length)}
            _keep(linear, "weight", linear.weight.narrow(dim, start, length))
            if linear.bias is not None and style == "colwise":
                owned["bias"] = OwnedSlice(dim=0, start=start, length=length)
                _keep(linear, "bias", linear.bias.narrow(0, start, length))
            if style == "colwise":
                linear.__class__ = ColumnParallelLinear
                linear.out_features = length
            else:
                linear.__class__ = RowParallelLinear
                linear.in_features = length
                linear.tp_group = tp_group
            linear.owned_slices = owned
            num_sharded += 1
    assert num_sharded, f"family {family.model_type!r}: no linear of its tp_plan found under {family.layers}"
    return model


def _keep(module: nn.Module, leaf: str, kept: torch.Tensor) -> None:
    kept = kept if kept.is_meta else kept.clone()
    setattr(module, leaf, nn.Parameter(kept.contiguous() if not kept.is_meta else kept, requires_grad=False))
