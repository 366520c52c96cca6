"""Our own TP plans applied on meta: what each rank keeps, and the refusal of a degree the plan cannot split.

The equality of the sharded forwards to one process (fp32 and bf16 routing) is tested on real gloo ranks in
tests/distributed/test_family_layouts.py and tests/distributed/test_layouts.py; here the plan's bookkeeping
is checked without any process group: the shapes, the slices the loader reads and the attributes the model's own
forward uses.
"""

from __future__ import annotations

import pytest
import torch
from test_families import family_target  # noqa: F401 - the fixture

from ds_capture.errors import CaptureError
from ds_capture.parallel.tensor_parallel import ColumnParallelLinear, GatheredLinear, LocalGroups, apply_tensor_parallel
from ds_capture.target.families import read_target_info
from ds_capture.target.checkpoint_reads import OwnedSlice
from ds_capture.target.loading import build_meta_model


def _meta(target_dir):
    target = read_target_info(target_dir)
    return target, build_meta_model(target, dtype=torch.float32, attn_implementation=None)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_deepseek_v4_plan_keeps_this_ranks_heads_sinks_and_groups(family_target, tp_rank):
    target, model = _meta(family_target("deepseek_v4"))
    whole = model.model.layers[0].self_attn
    heads, head_dim, groups = whole.config.num_attention_heads, whole.head_dim, whole.config.o_groups
    o_rows = whole.o_a_proj.out_features
    apply_tensor_parallel(model, target.family, tp_group=None, tp_size=2, tp_rank=tp_rank)
    for layer in model.model.layers:
        attn = layer.self_attn
        assert isinstance(attn.q_b_proj, ColumnParallelLinear)
        assert attn.q_b_proj.weight.shape == (heads // 2 * head_dim, attn.q_a_proj.out_features)
        assert attn.q_b_proj.owned_slices == {"weight": OwnedSlice(dim=0, start=tp_rank * heads // 2 * head_dim,
                                                                   length=heads // 2 * head_dim)}
        assert attn.sinks.shape == (heads // 2,) and attn.sinks.dtype == torch.float32
        assert attn.owned_slices == {"sinks": OwnedSlice(dim=0, start=tp_rank * heads // 2, length=heads // 2)}
        assert attn.num_key_value_groups == heads // 2  # the one KV head, broadcast to this rank's heads
        assert isinstance(attn.o_a_proj, LocalGroups) and attn.o_a_proj.n_groups == groups // 2
        assert attn.o_a_proj.weight.shape == (o_rows // 2, heads * head_dim // groups)
        assert isinstance(attn.o_b_proj, GatheredLinear) and attn.o_b_proj.weight.shape[0] == target.hidden_size // 2
        # Kept whole: the KV head, the low-rank query projection, the compressor and its indexer.
        assert attn.kv_proj.weight.shape == (head_dim, target.hidden_size)
        assert attn.q_a_proj.__class__ is torch.nn.Linear
        if attn.compressor is not None:
            assert not any(hasattr(module, "owned_slices") for module in attn.compressor.modules())
        shared = layer.mlp.shared_experts
        assert isinstance(shared.gate_proj, ColumnParallelLinear) and isinstance(shared.down_proj, GatheredLinear)


def test_local_groups_compute_this_ranks_block_of_the_grouped_projection(family_target):
    """Rank r's grouped o_a_proj on its heads equals rows [r * N/2, (r+1) * N/2) of the whole projection."""
    target = read_target_info(family_target("deepseek_v4"))
    torch.manual_seed(0)
    outputs = []
    for tp_rank in (None, 0, 1):
        model = build_meta_model(target, dtype=torch.float32, attn_implementation=None)
        if tp_rank is not None:
            apply_tensor_parallel(model, target.family, tp_group=None, tp_size=2, tp_rank=tp_rank)
        outputs.append(model.model.layers[0].self_attn)
    whole_attn = outputs[0]
    heads, head_dim, groups = whole_attn.config.num_attention_heads, whole_attn.head_dim, whole_attn.config.o_groups
    weight = torch.randn(whole_attn.o_a_proj.out_features, whole_attn.o_a_proj.in_features)
    attn_output = torch.randn(3, 5, heads, head_dim)  # [B, S, H, D], as the attention hands it on
    whole_attn.o_a_proj.to_empty(device="cpu").weight.data.copy_(weight)
    want = whole_attn.o_a_proj(attn_output.reshape(3, 5, groups, -1)).flatten(2)
    got = []
    for tp_rank, attn in enumerate(outputs[1:]):
        rows = weight.shape[0] // 2
        attn.o_a_proj.to_empty(device="cpu").weight.data.copy_(weight[tp_rank * rows:(tp_rank + 1) * rows])
        local_heads = attn_output[:, :, tp_rank * heads // 2:(tp_rank + 1) * heads // 2]
        # The model's own forward views the local heads with config.o_groups groups.
        got.append(attn.o_a_proj(local_heads.reshape(3, 5, groups, -1)).flatten(2))
    assert torch.equal(torch.cat(got, dim=-1), want)


def test_a_tp_size_the_grouped_projection_cannot_split_is_refused(family_target):
    target, model = _meta(family_target("deepseek_v4"))  # 4 heads, o_groups 2
    with pytest.raises(CaptureError) as caught:
        apply_tensor_parallel(model, target.family, tp_group=None, tp_size=4, tp_rank=0)
    assert str(caught.value) == (
        "distributed.tp_size (4) must divide model.layers.0.self_attn.o_a_proj (its n_groups)'s sizes (2): this "
        "family's tensor-parallel plan splits them evenly. Use a tp_size that divides them.")


def test_deepseek_v4_tp_does_not_split_its_one_kv_head(family_target):
    target = read_target_info(family_target("deepseek_v4"))
    assert target.num_key_value_heads == 1 and target.tp_key_value_heads is None
    qwen3 = read_target_info(family_target("qwen3"))
    assert qwen3.tp_key_value_heads == qwen3.num_key_value_heads == 2


def test_gpt_oss_plan_splits_its_sinks_with_the_heads(family_target):
    target, model = _meta(family_target("gpt_oss"))
    heads = model.config.num_attention_heads
    apply_tensor_parallel(model, target.family, tp_group=None, tp_size=2, tp_rank=1)
    for layer in model.model.layers:
        attn = layer.self_attn
        assert attn.sinks.shape == (heads // 2,)
        assert attn.owned_slices == {"sinks": OwnedSlice(dim=0, start=heads // 2, length=heads // 2)}
        assert isinstance(attn.q_proj, ColumnParallelLinear) and isinstance(attn.o_proj, GatheredLinear)
        assert attn.o_proj.owned_slices["bias"] == OwnedSlice(dim=0, start=target.hidden_size // 2,
                                                              length=target.hidden_size // 2)
        assert attn.num_key_value_groups == model.config.num_attention_heads // model.config.num_key_value_heads
