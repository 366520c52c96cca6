"""capture: DESIGN §3 default layer ids, id range checks, and hook semantics against HF output_hidden_states."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from ds_capture.capture.hooks import capture_hidden_states, default_layer_ids, resolve_layer_ids
from ds_capture.errors import CaptureError
from ds_capture.target.families import get_family


# Worked by hand from DESIGN §3: n = min(5, L-1) ids round(1 + i*(L-2)/(n-1)), round half to even.
#   L=12: 1, 3.5, 6, 8.5, 11      -> 1, 4, 6, 8, 11
#   L=36: 1, 9.5, 18, 26.5, 35    -> 1, 10, 18, 26, 35  (9.5 -> 10 and 26.5 -> 26: half to even)
@pytest.mark.parametrize("num_layers, expected", [
    (4, [1, 2, 3]),
    (8, [1, 2, 4, 6, 7]),
    (12, [1, 4, 6, 8, 11]),
    (28, [1, 8, 14, 20, 27]),
    (36, [1, 10, 18, 26, 35]),
    (2, [1]),
    (3, [1, 2]),
])
def test_default_layer_ids(num_layers, expected):
    assert default_layer_ids(num_layers) == expected
    assert resolve_layer_ids(None, num_layers, 5, source="r.yaml") == expected


@pytest.mark.parametrize("num_layers, draft_layers, expected", [
    (8, 1, [7]),          # n == 1: only the post-norm output
    (8, 3, [1, 4, 7]),    # 1, 4, 7
    (28, 2, [1, 27]),
    (10, 4, [1, 4, 6, 9]),  # 1, 3.667, 6.333, 9 -> 1, 4, 6, 9
])
def test_default_layer_ids_follow_draft_layers(num_layers, draft_layers, expected):
    assert default_layer_ids(num_layers, draft_layers) == expected
    assert resolve_layer_ids(None, num_layers, draft_layers, source="r.yaml") == expected


def test_configured_ids_pass_through():
    assert resolve_layer_ids((-1, 0, 3), 4, 5, source="r.yaml") == [-1, 0, 3]


@pytest.mark.parametrize("ids, bad", [((1, 4), "4"), ((-2, 1), "-2"), ((-3, 2, 9, 10), "-3, 9, 10")])
def test_out_of_range_ids_are_refused(ids, bad):
    with pytest.raises(CaptureError) as caught:
        resolve_layer_ids(ids, 4, 5, source="r.yaml")
    assert str(caught.value) == (
        f"r.yaml: `recipe_args.target_layer_ids` {list(ids)} has ids outside -1..3 ({bad}); the target has 4 decoder "
        "layers (-1 = embeddings, 3 = post-final-norm output).")


@pytest.fixture(scope="module")
def qwen3(tiny_target):
    path = tiny_target("qwen3")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(5, 300, (2, 24), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 17:] = 0  # a right-padded row
    return input_ids, attention_mask


def test_layer_ids_match_hf_hidden_states(qwen3, batch):
    input_ids, attention_mask = batch
    num_layers = qwen3.config.num_hidden_layers
    assert num_layers == 4
    family = get_family("qwen3")
    with torch.no_grad():
        reference = qwen3(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                          use_cache=False)
        base = qwen3.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        ids = [-1, 0, 1, 2, 3]
        with capture_hidden_states(qwen3, family, ids, num_layers) as hooks:
            qwen3(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            hidden, last = hooks.collect(torch.float32)
    H = qwen3.config.hidden_size
    assert hidden.shape == (2, 24, H * len(ids)) and last.shape == (2, 24, H)
    hf = reference.hidden_states
    assert len(hf) == num_layers + 1
    features = hidden.split(H, dim=-1)
    torch.testing.assert_close(features[0], hf[0], rtol=0, atol=0)  # id -1: the embedding output
    for layer_id in range(num_layers - 1):  # id i: decoder layer i's output, HF hidden_states[i + 1]
        torch.testing.assert_close(features[layer_id + 1], hf[layer_id + 1], rtol=0, atol=0)
    # id L-1: the post-final-norm output, == the last hidden state, == target_last_hidden_states.
    torch.testing.assert_close(features[-1], hf[num_layers], rtol=0, atol=0)
    torch.testing.assert_close(features[-1], base.last_hidden_state, rtol=0, atol=0)
    torch.testing.assert_close(last, base.last_hidden_state, rtol=0, atol=0)
    # The lm_head applied to it gives the model's logits: it really is the post-norm state.
    torch.testing.assert_close(qwen3.lm_head(last), reference.logits, rtol=1e-6, atol=1e-6)


def test_id_l_minus_1_is_not_the_raw_last_layer_output(qwen3, batch):
    input_ids, attention_mask = batch
    raw = []
    handle = qwen3.model.layers[3].register_forward_hook(
        lambda _m, _a, out: raw.append(out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad(), capture_hidden_states(qwen3, get_family("qwen3"), [3], 4) as hooks:
            qwen3(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            hidden, last = hooks.collect(torch.float32)
    finally:
        handle.remove()
    assert torch.equal(hidden, last)
    assert (hidden - raw[0]).abs().max() > 0.1
    torch.testing.assert_close(hidden, qwen3.model.norm(raw[0]), rtol=0, atol=0)


def test_concatenation_follows_layer_id_order_and_casts(qwen3, batch):
    input_ids, attention_mask = batch
    with torch.no_grad():
        reference = qwen3(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                          use_cache=False).hidden_states
        with capture_hidden_states(qwen3, get_family("qwen3"), [0, 2], 4) as hooks:
            qwen3(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            hidden, last = hooks.collect(torch.bfloat16)
    assert hidden.dtype == last.dtype == torch.bfloat16
    assert torch.equal(hidden, torch.cat([reference[1], reference[3]], dim=-1).to(torch.bfloat16))
    assert torch.equal(last, reference[4].to(torch.bfloat16))


def test_reset_forgets_the_previous_forward(qwen3, batch):
    input_ids, attention_mask = batch
    with torch.no_grad(), capture_hidden_states(qwen3, get_family("qwen3"), [1, 3], 4) as hooks:
        qwen3(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hooks.reset()
        with pytest.raises(RuntimeError) as caught:
            hooks.collect(torch.float32)
    assert str(caught.value) == (
        "layer ids [1, 3] never fired during the forward pass: the family entry for 'qwen3' does not match the "
        "model's module layout")


def test_a_layer_that_never_fires_is_an_error(qwen3, batch):
    input_ids, attention_mask = batch
    # The "embeddings" now point at the lm_head, which a forward of the base model never runs.
    family = dataclasses.replace(get_family("qwen3"), embed_tokens="lm_head")
    with torch.no_grad(), capture_hidden_states(qwen3, family, [-1, 1, 3], 4) as hooks:
        qwen3.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        with pytest.raises(RuntimeError) as caught:
            hooks.collect(torch.float32)
    assert str(caught.value) == (
        "layer ids [-1] never fired during the forward pass: the family entry for 'qwen3' does not match the "
        "model's module layout")


def test_hooks_are_removed_on_exit_and_on_error(qwen3, batch):
    def hook_count() -> int:
        return sum(len(m._forward_hooks) for m in qwen3.modules())

    before = hook_count()
    with capture_hidden_states(qwen3, get_family("qwen3"), [-1, 0, 2, 3], 4):
        assert hook_count() == before + 4  # embeddings, layers 0 and 2, final norm
    assert hook_count() == before
    with pytest.raises(ValueError, match="boom"):
        with capture_hidden_states(qwen3, get_family("qwen3"), [1, 3], 4):
            raise ValueError("boom")
    assert hook_count() == before
