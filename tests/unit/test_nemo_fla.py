"""The CPU torch provider for Kimi K3's fla names (ds_capture/target/nemo_fla.py).

Against fla 0.6.0's own torch references, loaded by file path because ``import fla`` needs Triton:
``fla/ops/kda/naive.py`` (``naive_recurrent_kda``, ``naive_chunk_kda``) and the ``naive_*`` functions of
``fla/ops/kda/gate.py`` (compiled out of the file; the rest of it is Triton). Measured tolerances (fp32):
the gate and the recurrence equal fla's naive code bit for bit; the chunk form differs by summation order
only (max abs 7e-7 at |o| ~ 0.4, relative RMSE 9e-7), held to 1e-5 here. Packed (``cu_seqlens``) and
right-padded batches equal their rows alone exactly at the kernels; through NeMo's whole KDA layer they agree
within 1e-6 (6e-8 measured: NeMo's own small Linear rounds differently at another GEMM row count).

Needs: torch only for the conv / norm / packing tests (they run in CI); flash-linear-attention for the
naive-reference tests; nemo_automodel 0.7.0 for the tests that install the provider into NeMo's Kimi K3
(both are the ``nemo`` extra; skipped with the reason otherwise).
"""

from __future__ import annotations

import ast
import importlib.util
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ds_capture.target import nemo_fla

FLA_SPEC = importlib.util.find_spec("fla")  # finds the package without executing it (it imports Triton)
HAS_NEMO = importlib.util.find_spec("nemo_automodel") is not None
needs_fla = pytest.mark.skipif(FLA_SPEC is None, reason="flash-linear-attention (the nemo extra) is not installed")
needs_nemo = pytest.mark.skipif(not HAS_NEMO, reason="nemo_automodel (the nemo extra) is not installed")


def _fla_naive():
    """fla's ``ops/kda/naive.py`` module and ``ops/kda/gate.py``'s ``naive_*`` functions, without Triton."""
    root = Path(FLA_SPEC.submodule_search_locations[0])
    spec = importlib.util.spec_from_file_location("fla_kda_naive", root / "ops" / "kda" / "naive.py")
    naive = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(naive)
    tree = ast.parse((root / "ops" / "kda" / "gate.py").read_text())
    refs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("naive_")]
    gate: dict = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=refs, type_ignores=[]), str(root / "ops/kda/gate.py"), "exec"), gate)
    return naive, gate


def _inputs(batch=2, length=128, heads=2, key_dim=16, value_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, length, heads, key_dim, generator=gen) for _ in range(2))
    v = torch.randn(batch, length, heads, value_dim, generator=gen)
    raw_gate = torch.randn(batch, length, heads, key_dim, generator=gen)
    a_log, dt_bias = torch.rand(heads, generator=gen) * 2, torch.randn(heads * key_dim, generator=gen)
    beta = torch.rand(batch, length, heads, generator=gen)
    return q, k, v, raw_gate, a_log, dt_bias, beta


@needs_fla
def test_gate_equals_fla_naive_gates_exactly():
    _, gate = _fla_naive()
    _, _, _, raw, a_log, dt_bias, _ = _inputs()
    assert torch.equal(nemo_fla.fused_kda_gate(raw, a_log, dt_bias), gate["naive_kda_gate"](raw, a_log, dt_bias))
    assert torch.equal(nemo_fla.fused_kda_gate(raw, a_log, dt_bias, lower_bound=-5.0),
                       gate["naive_kda_lowerbound_gate"](raw, a_log, dt_bias, -5.0))


@needs_fla
@pytest.mark.parametrize("kernel", ["fused_recurrent_kda", "chunk_kda"])
def test_recurrence_equals_naive_recurrent_kda_exactly_with_state(kernel):
    naive, gate = _fla_naive()
    q, k, v, raw, a_log, dt_bias, beta = _inputs()
    g = gate["naive_kda_gate"](raw, a_log, dt_bias)
    h0 = torch.randn(2, 2, 16, 16, generator=torch.Generator().manual_seed(1))
    # The in-kernel l2norm is applied outside for the reference (naive.py has none).
    ref, ref_state = naive.naive_recurrent_kda(nemo_fla._l2norm(q), nemo_fla._l2norm(k), v, g, beta,
                                               initial_state=h0, output_final_state=True)
    out, state = getattr(nemo_fla, kernel)(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
    assert torch.equal(out, ref) and torch.equal(state, ref_state)


@needs_fla
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_chunk_kda_matches_naive_chunk_form(lower_bound):
    naive, gate = _fla_naive()
    q, k, v, raw, a_log, dt_bias, beta = _inputs()
    g = nemo_fla.fused_kda_gate(raw, a_log, dt_bias, lower_bound=lower_bound)
    qn, kn = nemo_fla._l2norm(q), nemo_fla._l2norm(k)
    ref, ref_state = naive.naive_chunk_kda(qn, kn, v, g, beta, output_final_state=True)
    # What NeMo passes (transpose_state_layout, safe_gate) and fla's in-kernel gate.
    out, state = nemo_fla.chunk_kda(q, k, v, raw, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                    use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias, lower_bound=lower_bound,
                                    safe_gate=lower_bound is not None, transpose_state_layout=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)


def test_in_kernel_l2norm_is_fla_formula():
    x = torch.randn(3, 5, 2, 16, dtype=torch.bfloat16)
    x32 = x.float()
    assert torch.equal(nemo_fla._l2norm(x), (x32 / torch.sqrt((x32 * x32).sum(-1, keepdim=True) + 1e-6)).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_and_right_padded_batches_equal_rows_alone(dtype):
    q, k, v, raw, a_log, dt_bias, beta = _inputs(length=70)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    g = nemo_fla.fused_kda_gate(raw, a_log, dt_bias, lower_bound=-5.0)
    lengths = [70, 23]
    rows = [nemo_fla.chunk_kda(*(t[i : i + 1, :n] for t in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True)[0]
            for i, n in enumerate(lengths)]
    padded, _ = nemo_fla.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert padded.dtype == dtype
    for i, n in enumerate(lengths):
        assert torch.equal(padded[i : i + 1, :n], rows[i])
    packed_inputs = [torch.cat([t[i : i + 1, :n] for i, n in enumerate(lengths)], dim=1) for t in (q, k, v, g, beta)]
    packed, _ = nemo_fla.fused_recurrent_kda(*packed_inputs, cu_seqlens=torch.tensor([0, 70, 93]),
                                             use_qk_l2norm_in_kernel=True)
    assert torch.equal(packed, torch.cat(rows, dim=1))


def test_short_convolution_is_fla_module_shape_and_causal_conv_silu():
    conv = nemo_fla.ShortConvolution(hidden_size=32, kernel_size=4, activation="silu", dtype=torch.float32)
    # fla's ShortConvolution is an nn.Conv1d(D, D, W, groups=D, padding=W-1, bias=False): same state dict.
    assert isinstance(conv, torch.nn.Conv1d) and {n: tuple(p.shape) for n, p in conv.state_dict().items()} == {
        "weight": (32, 1, 4)}
    torch.nn.init.normal_(conv.weight)
    x = torch.randn(2, 50, 32, dtype=torch.bfloat16)
    y, state = conv(x=x, cache=None, output_final_state=False, cu_seqlens=None)
    ref = F.silu(F.conv1d(x.float().transpose(1, 2), conv.weight, padding=3, groups=32)[..., :50]).transpose(1, 2)
    assert state is None and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)  # bf16 output rounding
    y32, _ = conv(x.float())
    torch.testing.assert_close(y32, ref, rtol=1e-6, atol=1e-6)  # measured 9.5e-7: tap-order summation
    packed, _ = conv(torch.cat([x[0:1, :30], x[1:2, :20]], dim=1), cu_seqlens=torch.tensor([0, 30, 50]))
    assert torch.equal(packed[:, :30], conv(x[0:1, :30])[0]) and torch.equal(packed[:, 30:], conv(x[1:2, :20])[0])
    assert torch.equal(y[0:1, :30], conv(x[0:1, :30])[0])
    with pytest.raises(NotImplementedError):
        conv(x, cache=torch.zeros(2, 32, 4))


def test_fused_rms_norm_gated_is_rmsnorm_times_weight_times_sigmoid_gate():
    norm = nemo_fla.FusedRMSNormGated(16, eps=1e-5, activation="sigmoid", dtype=torch.float32)
    assert {n: tuple(p.shape) for n, p in norm.state_dict().items()} == {"weight": (16,)}
    torch.nn.init.normal_(norm.weight)
    x, g = torch.randn(3, 5, 2, 16), torch.randn(3, 5, 2, 16)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight * torch.sigmoid(g)
    torch.testing.assert_close(norm(x, g), ref, rtol=0, atol=0)
    assert norm(x.bfloat16(), g.bfloat16()).dtype == torch.bfloat16


def _tiny_k3_text_config(**overrides):
    from nemo_automodel.components.models.kimi_k3.config import KimiK3TextConfig

    values = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                  moe_intermediate_size=32, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
                  routed_expert_hidden_size=32, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, attn_res_block_size=None,
                  linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                                      "kda_layers": [1], "full_attn_layers": [2], "use_full_rank_gate": True,
                                      "gate_lower_bound": -5.0},
                  torch_dtype="float32")
    values.update(overrides)
    return KimiK3TextConfig(**values)


@needs_nemo
def test_install_into_nemo_kimi_k3_warns_and_kda_layer_runs_padded(caplog):
    from nemo_automodel.components.models.kimi_k3 import model as k3

    already = getattr(k3, nemo_fla.INSTALLED_MARKER, False)
    with caplog.at_level(logging.WARNING, logger="ds_capture.target.nemo_fla"):
        installed = nemo_fla.install_cpu_fla()
    if not installed:
        pytest.skip("fla's own kernels import here: the provider is not used")
    if not already:  # a CPU run is told, once, that this is the reference path
        assert nemo_fla.REFERENCE_PATH_WARNING in caplog.text
    assert k3.chunk_kda is nemo_fla.chunk_kda and k3.ShortConvolution is nemo_fla.ShortConvolution
    assert k3._FUSED_KDA_GATE_HAS_LOWER_BOUND and not k3._FUSED_KDA_GATE_HAS_G_BIAS
    assert nemo_fla.install_cpu_fla() is True  # idempotent
    torch.manual_seed(0)
    layer = k3.KimiDeltaAttention(_tiny_k3_text_config(), layer_idx=0)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.2)
    # NeMo's adapter keys: the fp32 conv / norm weights sit under _fp32_params, in fla's shapes.
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters() if "conv1d" in n or "o_norm" in n}
    assert shapes["q_conv1d._fp32_params.weight"] == (32, 1, 4) and shapes["o_norm._fp32_params.weight"] == (16,)
    hidden = torch.randn(2, 12, 64)
    mask = torch.tensor([[1] * 12, [1] * 7 + [0] * 5])
    with torch.no_grad():
        unpadded = layer(hidden, attention_mask=mask)  # NeMo unpads to one cu_seqlens row
        padded = layer(hidden)  # ds_capture's forward: right padding, no mask
        rows = [layer(hidden[0:1]), layer(hidden[1:2, :7])]
    # Not bitwise at this level, and not because of the provider (its kernels are, above): NeMo's own
    # ``b_proj`` Linear (2 output columns) rounds differently once the GEMM has >= 19 rows on this CPU
    # (7e-7 in beta), which reaches the output as ~6e-8.
    for out in (unpadded, padded):
        torch.testing.assert_close(out[0:1], rows[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(out[1:2, :7], rows[1], rtol=0, atol=1e-6)

