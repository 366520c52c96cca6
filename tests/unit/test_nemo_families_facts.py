"""The facts docs/nemo_families_notes.md records about NeMo AutoModel 0.7.0's DeepSeek-V4.1 and Kimi K3 classes,
held as tests so the integration's assumptions fail loudly if NeMo (or transformers) changes under them.

Tiny random models from tools/nemo_oracle/probe_v41_k3.py (NeMo's own classes, the CPU backend, Kimi K3's fla names
from ds_capture.nemo_fla). Needs the nemo extra; skipped with the reason otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("nemo_automodel") is None,
                                reason="nemo_automodel (the nemo extra) is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "nemo_oracle"))


@pytest.fixture(scope="module", autouse=True)
def no_dynamo():
    """NeMo's expert activations are torch.compile'd; the CPU path runs them eagerly (as TORCHDYNAMO_DISABLE=1)."""
    previous = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import torch._dynamo

    torch._dynamo.config.disable = True
    yield
    torch._dynamo.config.disable = False
    if previous is None:
        os.environ.pop("TORCHDYNAMO_DISABLE")
    else:
        os.environ["TORCHDYNAMO_DISABLE"] = previous


@pytest.fixture(scope="module")
def tiny():
    import probe_v41_k3

    return probe_v41_k3


def _v41(tiny, engram=(1, 3), meta=False):
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    torch.manual_seed(0)
    build = lambda: DeepseekV41ForCausalLM(tiny.v41_config("float32", engram_layer_ids=engram),  # noqa: E731
                                           backend=tiny.cpu_backend(), tokenizer=tiny.word_level_tokenizer())
    if meta:
        with torch.device("meta"):
            return build()
    model = build()
    model.initialize_weights(torch.device("cpu"), dtype=torch.float32)
    tiny.randomize(model, seed=3, std=0.1)
    return model.eval()


def _ids(vocab, length=12, seed=1):
    return torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


def test_v41_features_are_attn_hc_inputs_after_engram_and_minus_one_is_refused(tiny):
    model = _v41(tiny)
    mods = model.get_dspark_target_feature_modules([0, 1, 2, 3])
    assert [m for m in mods] == [model.model.layers[str(i)].attn_hc for i in range(4)]
    with pytest.raises(ValueError, match="DSpark target layer IDs"):
        model.get_dspark_target_feature_modules([-1])
    seen = {}
    # V4.1 blocks return (streams [B, S, hc, H], carried mHC coefficients, attention state): streams first.
    hooks = [model.model.layers[i].register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o[0]))
             for i in ("0", "1", "2")]
    hooks.append(model.model.embed_tokens.register_forward_hook(lambda m, a, o: seen.__setitem__("embed", o)))
    ids = _ids(64)
    with torch.no_grad():
        batch = tiny.capture(model, [0, 1, 2, 3], ids)
    for hook in hooks:
        hook.remove()
    feats = batch.target_hidden_states.split(16, dim=-1)
    assert torch.equal(feats[0], seen["embed"])  # id 0: the embedding output
    assert torch.equal(feats[2], seen["1"].mean(dim=2))  # no Engram at layer 2: the previous layer's stream mean
    for engram_id in (1, 3):  # Engram layers: their own update first, so not the previous layer's output
        assert (feats[engram_id] - seen[str(engram_id - 1)].mean(dim=2)).abs().max() > 1e-3


def test_v41_width_changes_content_positions_so_rows_must_be_computed_at_nemo_width(tiny):
    model = _v41(tiny, engram=())
    ids = _ids(64)
    with torch.no_grad():
        wide, narrow = tiny.capture(model, [0, 2, 5], ids), tiny.capture(model, [0, 2, 5], ids[:, :8])
        alone = tiny.capture(model, [0, 2, 5], ids[1:2])
    assert (wide.target_last_hidden_states[:, :8] - narrow.target_last_hidden_states).abs().max() > 1e-3
    assert torch.equal(wide.target_last_hidden_states[1:2], alone.target_last_hidden_states)  # batch: exact


def test_v41_meta_build_needs_engram_hash_init_weights(tiny):
    real = _v41(tiny)
    meta = _v41(tiny, meta=True)
    meta.to_empty(device="cpu")
    meta.load_state_dict(real.state_dict(), strict=True)
    nonpersistent = sorted(n for n, _ in real.named_buffers() if n not in real.state_dict())
    assert nonpersistent == [f"model.engram_hash.{n}" for n in ("multipliers", "offsets", "primes", "token_map")]
    meta.model.engram_hash.init_weights()
    ids = _ids(64)
    with torch.no_grad():
        assert torch.equal(meta.eval()(ids).logits, real(ids).logits)


def test_k3_features_are_layer_outputs0_and_last_id_is_final_norm(tiny):
    tiny.install_cpu_fla()
    from nemo_automodel.components.models.kimi_k3.model import KimiK3ForCausalLM

    model = KimiK3ForCausalLM(tiny.k3_text_config(2), backend=tiny.cpu_backend())
    tiny.randomize(model, std=0.1)
    model.eval()
    assert not hasattr(model, "get_dspark_target_feature_modules")  # NeMo's generic capture rule applies
    seen = {}
    hooks = [model.model.layers[i].register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o))
             for i in ("0", "1")]
    with torch.no_grad():
        batch = tiny.capture(model, [0, 1, 3], _ids(128, length=10))
    for hook in hooks:
        hook.remove()
    feats = batch.target_hidden_states.split(64, dim=-1)
    assert isinstance(seen["0"], tuple) and len(seen["0"]) == 2  # (partial block sum, block_residual)
    assert torch.equal(feats[0], seen["0"][0]) and torch.equal(feats[1], seen["1"][0])
    assert torch.equal(feats[2], batch.target_last_hidden_states)


def test_k3_adapter_round_trip_and_release_keys(tiny):
    tiny.install_cpu_fla()
    from nemo_automodel.components.models.kimi_k3.model import KimiK3ForCausalLM
    from nemo_automodel.components.models.kimi_k3.state_dict_adapter import KimiK3StateDictAdapter

    model = KimiK3ForCausalLM(tiny.k3_text_config(2), backend=tiny.cpu_backend())
    tiny.randomize(model, std=0.1)
    adapter = KimiK3StateDictAdapter(model.config, model.model.moe_config, model.backend, dtype=torch.float32)
    native = model.state_dict()
    release = adapter.to_hf(native)
    prefix = "language_model.model.layers.0.self_attn."
    assert tuple(release[prefix + "q_conv1d.weight"].shape) == (32, 1, 4)  # fla's ShortConvolution shape
    assert tuple(release[prefix + "A_log"].shape) == (128,)  # zero-padded to a multiple of 128
    assert "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight" in release
    back = adapter.from_hf(release)
    assert sorted(back) == sorted(native) and all(torch.equal(back[k], native[k]) for k in native)
