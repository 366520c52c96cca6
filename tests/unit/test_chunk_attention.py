"""A chunk's causal attention in two unmasked CPU kernels (ds_capture/target/chunk_attention.py): equal to the masked
kernel within fp32 rounding where the mask is the chunk's causal pattern, and transformers' own function, bit for bit,
wherever it is not; the chunked forward takes it."""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ds_capture.capture.chunked import forward_in_chunks
from ds_capture.target import chunk_attention as module
from ds_capture.target.chunk_attention import _ChunkAttention, split_chunk_attention


class _Layer(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


def _inputs(chunk=48, prefix=80, batch=2, heads=4, kv_heads=2, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, chunk, heads, dim, generator=generator).transpose(1, 2)  # as transformers hands it
    key = torch.randn(batch, kv_heads, prefix + chunk, dim, generator=generator)
    value = torch.randn(batch, kv_heads, prefix + chunk, dim, generator=generator)
    causal = torch.ones(chunk, prefix + chunk, dtype=torch.bool).tril(prefix)[None, None].expand(batch, 1, -1, -1)
    return query, key, value, causal


def _masked(query, key, value, mask, scaling=None):
    out = torch.nn.functional.scaled_dot_product_attention(query, repeat_kv(key, 2), repeat_kv(value, 2),
                                                           attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous()


def test_the_chunk_pattern_takes_two_unmasked_kernels_and_equals_the_masked_one():
    query, key, value, causal = _inputs()
    attention, calls = _ChunkAttention(), []
    real = module.chunk_attention
    try:
        module.chunk_attention = lambda *args: calls.append(1) or real(*args)
        for scaling in (None, 0.3):
            ours, _ = attention(_Layer(), query, key, value, causal, scaling=scaling)
            expected = _masked(query, key, value, causal, scaling)
            assert ours.shape == expected.shape == (2, 48, 4, 16)
            assert (ours - expected).abs().max().item() < 1e-6
    finally:
        module.chunk_attention = real
    assert len(calls) == 2


def test_every_other_mask_is_transformers_own_function_bit_for_bit():
    query, key, value, causal = _inputs()
    padded = causal.clone()
    padded[1, :, :, :5] = False  # left padding in one row
    window = causal & ~torch.ones_like(causal).tril(80 - 32)  # a sliding window of 32
    for mask, extra in ((padded, {}), (window, {}), (causal, {"s_aux": torch.zeros(4)}), (None, {})):
        ours, _ = _ChunkAttention()(_Layer(), query, key, value, mask, **extra)
        theirs, _ = sdpa_attention_forward(_Layer(), query, key, value, mask, **extra)
        assert torch.equal(ours, theirs)
    bf16 = [t.bfloat16() for t in (query, key, value)]
    assert torch.equal(_ChunkAttention()(_Layer(), *bf16, causal)[0], sdpa_attention_forward(_Layer(), *bf16, causal)[0])


def test_chunked_forward_takes_it_and_leaves_transformers_mapping_as_it_was(tmp_path):
    from transformers import AutoModelForCausalLM

    from ds_capture.demo import build_tiny_target

    model = AutoModelForCausalLM.from_pretrained(str(build_tiny_target(tmp_path / "qwen3", "qwen3")),
                                                 dtype=torch.float32).eval()
    seen, looked = [], []
    real, look = module.chunk_attention, _ChunkAttention._is_chunk_causal
    ids = torch.randint(0, model.config.vocab_size, (2, 96))
    padded = torch.ones(2, 96, dtype=torch.int64)
    padded[1, 90:] = 0
    try:
        module.chunk_attention = lambda *args: seen.append(args[0].shape[2]) or real(*args)
        _ChunkAttention._is_chunk_causal = lambda *args: looked.append(1) or look(*args)
        with torch.no_grad():
            whole = model.model(input_ids=ids).last_hidden_state
            for mask in (None, torch.ones(2, 96, dtype=torch.int64)):  # transformers' own masks: noted, not looked at
                inputs = {"input_ids": ids} if mask is None else {"input_ids": ids, "attention_mask": mask}
                chunked = forward_in_chunks(model.model, inputs, 32, {}).last_hidden_state
                assert (chunked - whole[:, -32:]).abs().max().item() < 1e-5
            assert set(seen) == {32} and len(seen) == 2 * 2 * model.config.num_hidden_layers and not looked
            seen.clear()
            forward_in_chunks(model.model, {"input_ids": ids, "attention_mask": padded}, 32, {})
    finally:
        module.chunk_attention, _ChunkAttention._is_chunk_causal = real, look
    # The padding enters with chunk 3: chunk 2 is noted and split; chunk 3's mask is looked at once, and refused.
    assert len(seen) == model.config.num_hidden_layers and len(looked) == 1
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    with split_chunk_attention():
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


def test_the_noted_chunk_mask_is_transformers_own():
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    built = _ChunkAttention().noting_masks(sdpa_mask)
    for batch, chunk, total in ((1, 4, 12), (3, 32, 96), (2, 256, 2048)):
        ours = built(batch, chunk, total, total - chunk, 0, causal_mask_function, torch.ones(batch, total, dtype=torch.bool))
        theirs = sdpa_mask(batch, chunk, total, total - chunk, 0, causal_mask_function, None)
        assert ours.shape == theirs.shape == (batch, 1, chunk, total) and torch.equal(ours, theirs)
