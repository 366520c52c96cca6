"""A CPU torch provider for the five flash-linear-attention (``fla``) names NeMo's Kimi K3 imports.

In:  nothing; :func:`install_cpu_fla` is called once before a Kimi K3 model is built with NeMo AutoModel's
     ``nemo_automodel.components.models.kimi_k3.model`` classes.
Out: where fla's Triton kernels cannot be imported (no Triton: every CPU machine), that NeMo module's
     ``ShortConvolution``, ``FusedRMSNormGated``, ``chunk_kda``, ``fused_recurrent_kda`` and ``fused_kda_gate``
     are the pure-torch versions below, so ``KimiDeltaAttention`` builds and runs. Where fla imports, nothing
     changes and fla's kernels are used.

NeMo 0.7.0 binds the five names at import (``safe_import_from("fla.modules", ...)``), keeping a placeholder and
an ``_*_OK = False`` flag when fla is absent, and derives three flags from fla's signatures. The provider sets
those module globals, and recomputes the derived flags with NeMo's own expressions, rather than planting a fake
``fla`` package in ``sys.modules`` (which would also shadow fla for transformers' Kimi-Linear and for fla's own
naive references the tests load).

Same parameters as fla's modules, so NeMo's ``KimiK3StateDictAdapter`` loads unchanged: ``ShortConvolution`` is
an ``nn.Conv1d`` (depthwise, ``weight [D, 1, W]``, no bias by default), ``FusedRMSNormGated`` has ``weight [D]``.
The math follows fla 0.6.0: the causal conv in fp32 then ``silu``; RMSNorm in fp32 times ``weight`` times
``sigmoid(g)``; the KDA gate as ``fla/ops/kda/gate.py``'s ``naive_kda_gate`` / ``naive_kda_lowerbound_gate``;
the delta rule as ``fla/ops/kda/naive.py``'s ``naive_recurrent_kda`` (both ``chunk_kda`` and
``fused_recurrent_kda``: the chunk form is the same recurrence regrouped), with fla's in-kernel l2norm
(``x / sqrt(sum(x^2) + 1e-6)`` in fp32). ``cu_seqlens`` segments are computed one at a time with the same ops
as a lone row, so a packed or right-padded batch equals its rows alone bit for bit. fla's own tests hold its
kernels to the naive recurrence within 0.5% relative RMSE: a GPU cache of K3 equals a CPU one only to that.

The recurrence is a Python loop over tokens (2.7 ms per token per layer on one thread of this box at the release's
head sizes, 96 heads x 128 x 128): a reference path, and :func:`install_cpu_fla` says so in a warning.

Legend: B = batch, T = tokens, N = sequences (``len(cu_seqlens) - 1``), H = q/k heads, HV = value heads,
K = key head dim, V = value head dim, D = channels, W = conv width.
"""

from __future__ import annotations

import importlib
import inspect
import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

NEMO_KIMI_K3_MODULE = "nemo_automodel.components.models.kimi_k3.model"
# NeMo's import-time global for each name, and the flag safe_import_from left next to it.
FLA_NAMES = {
    "ShortConvolution": "_SHORT_CONV_OK",
    "FusedRMSNormGated": "_FUSED_RMSNORM_GATED_OK",
    "chunk_kda": "_CHUNK_KDA_OK",
    "fused_recurrent_kda": "_RECURRENT_KDA_OK",
    "fused_kda_gate": "_KDA_GATE_OK",
}
INSTALLED_MARKER = "_DS_CAPTURE_CPU_FLA"  # set on NeMo's module once this provider is in it
L2NORM_EPS = 1e-6  # fla.modules.norm.l2norm.l2norm_fwd's default, the one its KDA kernels use

REFERENCE_PATH_WARNING = (
    "Kimi K3: flash-linear-attention's kernels are not importable here (no Triton), so its KDA layers run on "
    "ds_capture's CPU torch reference (ds_capture.target.nemo_fla): a Python loop over tokens, about 3 ms per token "
    "per layer per thread at the release's head sizes. Use it for tests and small runs; a GPU run with fla "
    "installed uses fla's kernels, which fla holds to this recurrence within 0.5% relative RMSE."
)


class ShortConvolution(nn.Conv1d):
    """fla's depthwise causal conv1d + SiLU (``fla.modules.ShortConvolution``), in torch."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, activation: str | None = "silu",
                 backend: str | None = "triton", device: torch.device | None = None,
                 dtype: torch.dtype | None = None, **kwargs) -> None:
        super().__init__(in_channels=hidden_size, out_channels=hidden_size, kernel_size=kernel_size,
                         padding=kernel_size - 1, groups=hidden_size, bias=bias, device=device, dtype=dtype)
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"ShortConvolution activation {activation!r}: fla supports only 'silu' / 'swish'.")
        self.hidden_size = hidden_size
        self.activation = activation
        self.backend = backend  # kept for fla's API; there is one (torch) backend here

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                cache: torch.Tensor | None = None, output_final_state: bool = False,
                cu_seqlens: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
                **kwargs) -> tuple[torch.Tensor, None]:
        # x [B, T, D]; B == 1 with cu_seqlens. Returns (y [B, T, D] in x's dtype, no state).
        if cache is not None or output_final_state or kwargs.get("cp_context") is not None:
            raise NotImplementedError("ds_capture's CPU ShortConvolution computes whole sequences only "
                                      "(no cache, final state or context parallelism).")
        if mask is not None:
            if cu_seqlens is not None:
                raise ValueError("`mask` and `cu_seqlens` cannot be provided at the same time")
            x = x * mask.unsqueeze(-1)
        weight = self.weight[:, 0, :].float()  # [D, W]
        segments = [x] if cu_seqlens is None else _split_segments(x, cu_seqlens)
        y = torch.cat([self._causal_conv(part, weight) for part in segments], dim=1)
        if residual is not None:
            y = y + residual.float()
        return y.to(x.dtype), None

    def _causal_conv(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # y[t] = sum_j w[:, j] * x[t - (W - 1) + j], zeros before the start, summed in tap order. Elementwise
        # only (no conv kernel whose blocking depends on the length), so a row computes the same bits alone or
        # inside a longer batch.
        width, length = weight.shape[1], x.shape[1]
        padded = F.pad(x.float(), (0, 0, width - 1, 0))  # [B, W - 1 + T, D]
        y = padded[:, 0:length] * weight[:, 0]
        for tap in range(1, width):
            y = y + padded[:, tap : tap + length] * weight[:, tap]
        if self.bias is not None:
            y = y + self.bias.float()
        return F.silu(y) if self.activation is not None else y


class FusedRMSNormGated(nn.Module):
    """fla's gated RMSNorm (``fla.modules.FusedRMSNormGated``): ``rmsnorm(x) * weight * act(g)`` in fp32."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5,
                 activation: str = "swish", device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"Unsupported activation: {activation}")
        self.hidden_size, self.elementwise_affine, self.eps, self.activation = (
            hidden_size, elementwise_affine, eps, activation)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, g: torch.Tensor, residual: torch.Tensor | None = None,
                prenorm: bool = False, residual_in_fp32: bool = False) -> torch.Tensor:
        # x, g [..., D]; the result has x's dtype, as fla's kernel stores it.
        if residual is not None or prenorm:
            raise NotImplementedError("ds_capture's CPU FusedRMSNormGated has no residual / prenorm path.")
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        g32 = g.float()
        y = y * torch.sigmoid(g32) if self.activation == "sigmoid" else y * (g32 * torch.sigmoid(g32))
        return y.to(x.dtype)


def fused_kda_gate(g: torch.Tensor, A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                   lower_bound: float | None = None, output_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fla 0.6.0's KDA decay gate: ``-exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound``
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``. g [..., H, K], A_log [H], dt_bias [H * K]."""
    num_heads = g.shape[-2]
    g = g.float()
    if dt_bias is not None:
        g = g + dt_bias.float().view(num_heads, -1)
    if lower_bound is None:
        if A_log is None:
            raise ValueError("fused_kda_gate: A_log is required unless lower_bound is set.")
        return (-A_log.view(num_heads, 1).float().exp() * F.softplus(g)).to(output_dtype)
    if A_log is not None:
        g = A_log.view(num_heads, 1).float().exp() * g
    return (lower_bound * torch.sigmoid(g)).to(output_dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's in-kernel l2norm: fp32 ``x / sqrt(sum(x^2) + eps)``, stored back in x's dtype."""
    x32 = x.float()
    return (x32 / torch.sqrt(x32.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def _split_segments(x: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """``x [1, T, ...]`` -> the N segments ``x[:, cu[i]:cu[i+1]]`` (fla's varlen layout: batch must be 1)."""
    if x.shape[0] != 1:
        raise ValueError(f"The batch size is expected to be 1 rather than {x.shape[0]} when using `cu_seqlens`.")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != x.shape[1] or any(b > a for b, a in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds} must rise from 0 to the token count {x.shape[1]}.")
    return [x[:, start:end] for start, end in zip(bounds, bounds[1:])]


def _recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                scale: float, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of equal-length rows through ``naive_recurrent_kda``'s delta rule, its ops in its order.

    q, k [B, T, H, K] fp32; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; state [B, HV, K, V] or None.
    Returns o [B, T, HV, V] fp32 and the final state [B, HV, K, V].
    """
    batch, length, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[-1]
    group = value_heads // heads
    q = q.repeat_interleave(group, dim=2) * scale
    k = k.repeat_interleave(group, dim=2)
    S = q.new_zeros(batch, value_heads, key_dim, value_dim)
    if state is not None:
        S = S + state
    o = q.new_zeros(batch, length, value_heads, value_dim)
    for t in range(length):
        q_t, k_t, v_t, g_t, b_t = q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t]
        S = S * g_t[..., None].exp()
        S = S + torch.einsum("b h k, b h v -> b h k v", b_t[..., None] * k_t, v_t - (k_t[..., None] * S).sum(-2))
        o[:, t] = torch.einsum("b h k, b h k v -> b h v", q_t, S)
    return o, S


def _kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
         scale: float | None, initial_state: torch.Tensor | None, output_final_state: bool,
         use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
         allow_neg_eigval: bool, lower_bound: float | None, state_v_first: bool,
         cu_seqlens: torch.Tensor | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
         cp_context) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What ``chunk_kda`` and ``fused_recurrent_kda`` share: fla's in-kernel pre-steps, then the recurrence."""
    if cp_context is not None:
        raise NotImplementedError("ds_capture's CPU KDA has no context-parallel path (fla's cp_context).")
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    if use_gate_in_kernel:
        g = fused_kda_gate(g, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.float()) * (2.0 if allow_neg_eigval else 1.0)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    # fla's transposed state layout ([V, K]) exists only at the interface; the recurrence keeps [K, V].
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    out_dtype = v.dtype  # fla returns o in v's dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if cu_seqlens is None:
        o, final = _recurrence(q, k, v, g, beta, scale, initial_state)
    else:
        parts = [_split_segments(t, cu_seqlens) for t in (q, k, v, g, beta)]
        outs, finals = [], []
        for index, (q_i, k_i, v_i, g_i, b_i) in enumerate(zip(*parts)):
            state = None if initial_state is None else initial_state[index : index + 1]
            o_i, final_i = _recurrence(q_i, k_i, v_i, g_i, b_i, scale, state)
            outs.append(o_i)
            finals.append(final_i)
        o, final = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    if not output_final_state:
        final = None
    elif state_v_first:
        final = final.transpose(-1, -2)
    return o.to(out_dtype), final


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None,
              output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
              use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
              allow_neg_eigval: bool = False, safe_gate: bool = False, lower_bound: float | None = None,
              disable_recompute: bool = False, return_intermediate_states: bool = False,
              state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None,
              cu_seqlens_cpu: torch.Tensor | None = None, cp_context=None, **kwargs):
    """fla 0.6.0's ``chunk_kda`` signature over the token recurrence (equal to the chunk form in exact
    arithmetic). ``safe_gate`` / ``disable_recompute`` only steer fla's kernels; ``transpose_state_layout``
    (NeMo passes it; fla 0.6.0 takes it into ``**kwargs``) is accepted the same way."""
    if return_intermediate_states:
        raise NotImplementedError("ds_capture's CPU chunk_kda does not return intermediate chunk states.")
    return _kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                A_log=kwargs.get("A_log"), dt_bias=kwargs.get("dt_bias"), cp_context=cp_context)


def fused_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                        scale: float | None = None, initial_state: torch.Tensor | None = None,
                        output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                        use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                        allow_neg_eigval: bool = False, lower_bound: float | None = None,
                        state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None, **kwargs):
    """fla 0.6.0's ``fused_recurrent_kda`` signature over the same token recurrence."""
    return _kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                A_log=A_log, dt_bias=dt_bias, cp_context=kwargs.get("cp_context"))


PROVIDED = {
    "ShortConvolution": ShortConvolution,
    "FusedRMSNormGated": FusedRMSNormGated,
    "chunk_kda": chunk_kda,
    "fused_recurrent_kda": fused_recurrent_kda,
    "fused_kda_gate": fused_kda_gate,
}


def fla_kernels_importable() -> bool:
    """Whether the real fla modules NeMo imports from load here (they need Triton)."""
    try:
        for module in ("fla.modules", "fla.ops.kda", "fla.ops.kda.gate"):
            importlib.import_module(module)
    except ImportError:
        return False
    return True


def install_cpu_fla() -> bool:
    """Give NeMo's Kimi K3 module the torch provider where fla's kernels are absent; True if installed.

    Idempotent. Raises ImportError when NeMo AutoModel is not installed, and AssertionError when its
    Kimi K3 module no longer has the globals this provider replaces (another NeMo version than 0.7.0).
    """
    module = importlib.import_module(NEMO_KIMI_K3_MODULE)
    if all(getattr(module, flag) for flag in FLA_NAMES.values()):
        return getattr(module, INSTALLED_MARKER, False)  # fla's own kernels, or this provider already in
    if fla_kernels_importable():
        # fla loads now but did not when NeMo's module was imported: keep NeMo's own view, do not mix.
        raise AssertionError(f"{NEMO_KIMI_K3_MODULE} was imported before fla became importable.")
    derived = ("_CHUNK_KDA_HAS_DISABLE_RECOMPUTE", "_FUSED_KDA_GATE_HAS_G_BIAS", "_FUSED_KDA_GATE_HAS_LOWER_BOUND")
    missing = [name for name in (*FLA_NAMES, *FLA_NAMES.values(), *derived) if not hasattr(module, name)]
    assert not missing, f"{NEMO_KIMI_K3_MODULE} lacks {missing}: the provider was written against NeMo 0.7.0"
    for name, flag in FLA_NAMES.items():
        setattr(module, name, PROVIDED[name])
        setattr(module, flag, True)
    # NeMo's own expressions for the flags it derives from fla's signatures (kimi_k3/model.py, top).
    module._CHUNK_KDA_HAS_DISABLE_RECOMPUTE = "disable_recompute" in inspect.signature(chunk_kda).parameters
    module._FUSED_KDA_GATE_HAS_G_BIAS = "g_bias" in inspect.signature(fused_kda_gate).parameters
    module._FUSED_KDA_GATE_HAS_LOWER_BOUND = "lower_bound" in inspect.signature(fused_kda_gate).parameters
    setattr(module, INSTALLED_MARKER, True)
    logger.warning(REFERENCE_PATH_WARNING)
    return True
