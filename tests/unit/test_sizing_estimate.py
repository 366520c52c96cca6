"""plan's activation estimate bounds a measured forward: the peak bytes of every tensor a real capture forward
allocates (tracked op by op with a dispatch mode), for small targets of the real architectures.

The shapes are projection-dominated (hidden 512, S 256), as real targets are: on CPU, sdpa falls back to its math
kernel (materialising [S, S] scores) for MLA's unequal q/v head dims, which the GPU estimate leaves out. Tolerance:
the estimate may be up to 3x the measurement (it counts transients as if alive together), never below it.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ds_capture.capture.hooks import capture_hidden_states
from ds_capture.demo import build_tiny_target
from ds_capture.parallel.single import build_single_model
from ds_capture.recipe.config import parse_config
from ds_capture.sizing.command import plan_capture
from ds_capture.target.families import read_target_info

SHAPES = {
    "qwen3": dict(hidden_size=512, intermediate_size=1536, head_dim=64, num_attention_heads=8, num_key_value_heads=2),
    "qwen3_moe": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, head_dim=64,
                      num_attention_heads=8, num_key_value_heads=2),
    "deepseek_v3": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_attention_heads=8,
                        num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=32,
                        qk_nope_head_dim=64, v_head_dim=64),
    "glm_moe_dsa": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_attention_heads=8,
                        num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=32,
                        qk_nope_head_dim=64, v_head_dim=64, head_dim=32, index_head_dim=64),
}


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created inside the mode (storages in ``preexisting`` are not counted)."""

    def __init__(self, preexisting: set[int]) -> None:
        super().__init__()
        self.skip, self.refs, self.size = preexisting, defaultdict(int), {}
        self.current = self.peak = 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.current -= self.size.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            key = tensor.untyped_storage().data_ptr()
            if key == 0 or key in self.skip:
                continue
            if self.refs[key] == 0:  # a new storage: counted until its last tensor is gone
                self.size[key] = tensor.untyped_storage().nbytes()
                self.current += self.size[key]
                self.peak = max(self.peak, self.current)
            self.refs[key] += 1
            weakref.finalize(tensor, self._release, key)
        return out


@pytest.mark.parametrize("model_type", sorted(SHAPES))
def test_activation_estimate_bounds_the_measured_forward(tmp_path, model_type):
    target = build_tiny_target(tmp_path / model_type, model_type, num_hidden_layers=3, **SHAPES[model_type])
    info = read_target_info(target)
    model = build_single_model(info, dtype=torch.float32, attn_implementation=None)
    batch, seq_length, layer_ids = 4, 256, [1, 2]
    input_ids = torch.randint(1, 1000, (batch, seq_length), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 200:] = 0
    existing = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), input_ids,
                                                         attention_mask)}
    with torch.no_grad(), capture_hidden_states(model, info.family, layer_ids, info.num_hidden_layers) as hooks:
        with LiveBytes(existing) as tracked:
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)
            hooks.collect(torch.float32)

    cfg = parse_config({"recipe_args": {"target_model_name_or_path": str(target), "train_data_path": "/none.jsonl",
                                        "cache_output_dir": "/none", "seq_length": seq_length,
                                        "micro_batch_size": batch, "target_layer_ids": layer_ids,
                                        "cache_dtype": "fp32"}}, source="<test>", base_dir=Path("."))
    report = plan_capture(cfg, world_size=1, gpu_memory_gib=80, compute_dtype="fp32", count_dataset=False,
                          suggest=False)
    estimate = report.worst.activation_bytes + report.worst.capture_bytes
    assert tracked.peak <= estimate <= 3 * tracked.peak, (model_type, tracked.peak, estimate)
