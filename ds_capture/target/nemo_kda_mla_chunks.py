"""Chunked prefill of NeMo-built KDA and MLA layers (Kimi K3): one carrier per layer kind, around NeMo's own modules.

In:  a NeMo AutoModel 0.7.0 ``KimiDeltaAttention`` or ``KimiMLAAttention`` module (``nemo_automodel.components.
     models.kimi_k3.model``), and the chunks of one micro-batch, in order. Out: :class:`KdaCarrier` and
     :class:`LatentKvCarrier`: ``forward`` replaces the module's forward for one row's chunks (installed and removed
     by :func:`ds_capture.capture.chunked.carried_state`, which a family's ``Family.chunk_carriers`` names as data)
     and computes the chunk against the state the chunks before left; ``state_bytes`` is what it carries at S
     (``ds-capture plan``).

NeMo's classes take no cache, so nothing in NeMo is patched: the carriers call NeMo's own submodules (projections,
fp32 convolution and gate holders, gated norm, output projections, its attention function) and the recurrent kernel
NeMo's module resolved (fla's, or :mod:`.nemo_fla`'s CPU provider), in the order NeMo's non-CP forward calls them.
What each kind carries from the chunks before:

- KDA: the last ``W - 1`` inputs of each short convolution (q, k, v: the chunk's convolution runs over them and
  the chunk, and keeps the chunk's outputs) and the delta rule's recurrent state ``[B, H, K, V]`` (fp32; the
  kernel's ``initial_state`` / ``output_final_state``, in the layout NeMo's kernel options choose). Chunks are whole
  64-token blocks (``Family.chunk_multiple``): fla's chunk kernel sums each block in one order.
- MLA: the latent KV of the prefix (``kv_a_proj_with_mqa``'s output, ``kv_lora_rank + qk_rope_head_dim`` per token);
  each chunk expands prefix and chunk with ``kv_a_layernorm`` / ``kv_b_proj`` and attends causally with the
  prefix's offset. K3's MLA is NoPE (``mla_use_nope``: no rotary anywhere), so no position enters.

Everything else in a K3 layer is per token (attention residuals mix a token's own block states; MoE, SiTU MLPs,
norms), so it needs nothing. Rows are right-padded (content never sees padding) and forwarded without a mask: a
padding mask is not taken here (:func:`ds_capture.capture.chunked.forward_in_chunks` drops a right-padding one).

Legend: B = rows, C = chunk tokens, P = prefix tokens, H = heads, K / V = key / value head dims, W = conv width,
R = kv_lora_rank + qk_rope_head_dim.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

NEMO_KIMI_K3_MODULE = "nemo_automodel.components.models.kimi_k3.model"
EXPAND_TOKENS = 4096
"""Prefix tokens whose keys and values MLA's carrier expands at once (``kv_b_proj``'s output is this many rows)."""


def _nemo_kimi() -> Any:
    # Looked up per call: the kernels NeMo's module holds now (fla's, or the CPU provider installed at build).
    return importlib.import_module(NEMO_KIMI_K3_MODULE)


def _refuse_nemo_only_paths(module: torch.nn.Module, packed_context: Any, kwargs: dict) -> None:
    """The carriers compute NeMo's plain path: one unpacked, unmasked row per batch entry, no context parallelism."""
    packed = {key for key in ("packed_token_indices", "cu_seqlens", "_packed_seq_ids") if kwargs.get(key) is not None}
    if packed or (packed_context is not None and (packed_context.cp_enabled or packed_context.has_multiple_documents)):
        raise AssertionError(f"{type(module).__name__}: chunked prefill forwards plain rows (got packed / CP inputs)")


class KdaCarrier:
    """A ``KimiDeltaAttention`` layer over one row's chunks: short-convolution tails and the recurrent state."""

    def __init__(self, module: torch.nn.Module, row_tokens: int) -> None:
        self.module = module  # (K3's state does not depend on the row's length)
        self.conv_tails: dict[str, torch.Tensor] = {}  # "q" / "k" / "v" -> [B, W - 1, D], the inputs before
        self.recurrent: torch.Tensor | None = None  # [B, H, K, V] or [B, H, V, K] (the kernel's layout), fp32

    @staticmethod
    def state_bytes(module: torch.nn.Module, batch: int, seq_length: int, dtype: torch.dtype) -> int:
        """What one layer carries for ``batch`` rows (any S: the state does not grow with the row)."""
        channels = 2 * module.num_k_heads * module.head_k_dim + module.num_heads * module.head_dim
        recurrent = module.num_heads * module.head_k_dim * module.head_dim * 4  # the kernel's fp32 state
        return batch * ((module.conv_size - 1) * channels * torch.empty((), dtype=dtype).element_size() + recurrent)

    def _conv(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The causal short convolution of chunk ``x [B, C, D]`` continuing the inputs before it (its tail)."""
        conv = getattr(self.module, f"{name}_conv1d")
        tail = self.conv_tails.get(name)
        width = self.module.conv_size
        inputs = x if tail is None else torch.cat((tail, x), dim=1)
        y, _ = conv(x=inputs, cache=None, output_final_state=False, cu_seqlens=None)
        self.conv_tails[name] = inputs[:, -(width - 1):].clone()
        return y if tail is None else y[:, tail.shape[1]:]

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                packed_context: Any = None, **kwargs: Any) -> torch.Tensor:
        """NeMo's ``_kda_core`` for one chunk ``[B, C, hidden]``, continuing the carried state."""
        del attention_mask  # rows are forwarded unmasked (module docstring)
        _refuse_nemo_only_paths(self.module, packed_context, kwargs)
        module, nemo = self.module, _nemo_kimi()
        config = module.config
        if getattr(config, "kda_chunk_impl", "fla") == "fused":
            raise AssertionError("Kimi K3 kda_chunk_impl='fused' takes no initial state: chunked prefill needs fla's")
        q = self._conv("q", module.q_proj(hidden_states))
        k = self._conv("k", module.k_proj(hidden_states))
        v = self._conv("v", module.v_proj(hidden_states))
        g = module.f_b_proj(module.f_a_proj(hidden_states)).contiguous()
        beta = module.b_proj(hidden_states).float().sigmoid().contiguous()
        q = q.reshape(*q.shape[:-1], module.num_k_heads, module.head_k_dim).contiguous()
        k = k.reshape(*k.shape[:-1], module.num_k_heads, module.head_k_dim).contiguous()
        v = v.reshape(*v.shape[:-1], module.num_heads, module.head_dim).contiguous()
        g = module._fp32_params(g, module.head_dim, module.gate_lower_bound,
                                getattr(config, "kda_use_fused_gate", True)).contiguous()
        use_qk_l2norm_in_kernel = getattr(config, "kda_use_qk_l2norm_in_kernel", True)
        if not use_qk_l2norm_in_kernel:
            q = torch.nn.functional.normalize(q.float(), p=2, dim=-1, eps=1e-6).to(q.dtype)
            k = torch.nn.functional.normalize(k.float(), p=2, dim=-1, eps=1e-6).to(k.dtype)
        # NeMo's kernel options for its mode (the state's layout among them), plus the carried state.
        options: dict[str, Any] = {"use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
                                   "transpose_state_layout": bool(getattr(config, "kda_transpose_state_layout", True))}
        if module.mode == "chunk":
            options["safe_gate"] = module.gate_lower_bound is not None
            kernel = nemo.chunk_kda
        else:
            kernel = nemo.fused_recurrent_kda
        o, self.recurrent = kernel(q=q, k=k, v=v, g=g, beta=beta, initial_state=self.recurrent,
                                   output_final_state=True, cu_seqlens=None, **options)
        gate = module.g_proj(hidden_states) if module.use_full_rank_gate else module.g_b_proj(
            module.g_a_proj(hidden_states))
        gate = gate.reshape(*hidden_states.shape[:-1], module.num_heads, module.head_dim)
        o = module.o_norm(o, gate).to(hidden_states.dtype)
        return module.o_proj(o.reshape(o.shape[0], o.shape[1], -1).contiguous())


class LatentKvCarrier:
    """A ``KimiMLAAttention`` layer over one row's chunks: the prefix's latent KV (what MLA caches in decoding)."""

    def __init__(self, module: torch.nn.Module, row_tokens: int) -> None:
        self.module = module  # (K3's state does not depend on the row's length)
        self.latent: torch.Tensor | None = None  # [B, P, R]

    @staticmethod
    def state_bytes(module: torch.nn.Module, batch: int, seq_length: int, dtype: torch.dtype) -> int:
        """The latent KV of a whole row: ``batch x S x R`` in the model dtype."""
        width = module.kv_lora_rank + module.qk_rope_head_dim
        return batch * seq_length * width * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def expansion_bytes(module: torch.nn.Module, batch: int, seq_length: int, dtype: torch.dtype) -> int:
        """The keys and values the last chunk expands from the row's latent at S (``ds-capture plan``'s transient
        of that chunk's attention; the ``EXPAND_TOKENS`` rows of ``kv_b_proj``'s output beside them are left out)."""
        per_token = module.num_heads * (module.q_head_dim + module.v_head_dim)
        return batch * seq_length * per_token * torch.empty((), dtype=dtype).element_size()

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NeMo's keys ``[B, H, T, nope + rope]`` and values ``[B, H, T, V]`` of ``latent [B, T, R]``, expanded
        ``EXPAND_TOKENS`` at a time straight into place (the prefix's keys and values are this carrier's largest
        transient; ``kv_b_proj``'s output never exists for the whole row)."""
        module = self.module
        nope, rope, value_dim = module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim
        batch, total = latent.shape[:2]
        key = latent.new_empty(batch, module.num_heads, total, nope + rope)
        value = latent.new_empty(batch, module.num_heads, total, value_dim)
        for start in range(0, total, EXPAND_TOKENS):
            part = latent[:, start:start + EXPAND_TOKENS]
            k_pass, k_rot = torch.split(part, [module.kv_lora_rank, rope], dim=-1)
            kv = module.kv_b_proj(module.kv_a_layernorm(k_pass)).view(*part.shape[:2], -1, nope + value_dim)
            kv = kv.transpose(1, 2)  # [B, H_kv, t, nope + V]
            k_pass, v_part = torch.split(kv, [nope, value_dim], dim=-1)
            k_full = torch.cat((k_pass, k_rot[:, None].expand(*k_pass.shape[:-1], -1)), dim=-1)
            k_full, v_part = module._expand_key_value_groups(k_full, v_part, part.shape[1])
            key[:, :, start:start + EXPAND_TOKENS] = k_full
            value[:, :, start:start + EXPAND_TOKENS] = v_part
        return key, value

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                padding_mask: torch.Tensor | None = None, packed_context: Any = None, **kwargs: Any) -> torch.Tensor:
        """NeMo's non-CP MLA forward for one chunk ``[B, C, hidden]`` against the carried prefix."""
        del attention_mask, padding_mask  # rows are forwarded unmasked (module docstring)
        _refuse_nemo_only_paths(self.module, packed_context, kwargs)
        module = self.module
        if module.backend.attn != "sdpa":
            raise AssertionError(f"Kimi K3 MLA's carrier computes NeMo's sdpa path, not {module.backend.attn!r}")
        batch, length = hidden_states.shape[:-1]
        if module.q_lora_rank is not None:
            q_states = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
        else:
            q_states = module.q_proj(hidden_states)
        query = q_states.view(batch, length, -1, module.q_head_dim)  # [B, C, H, K]: NeMo's layout for its SDPA
        latent = module.kv_a_proj_with_mqa(hidden_states)  # [B, C, R]
        prefix = 0 if self.latent is None else self.latent.shape[1]
        self.latent = latent if self.latent is None else torch.cat((self.latent, latent), dim=1)  # [B, P + C, R]
        total = prefix + length
        key, value = self._expand(self.latent)
        # The first chunk is NeMo's own call (causal over itself); later ones see the prefix: query i of the chunk
        # is position P + i and sees keys 0..P + i (an explicit mask: SDPA's is_causal aligns a non-square
        # mask top-left).
        causal = None
        if prefix:
            positions = torch.arange(total, device=hidden_states.device)
            causal = (positions[None, :] <= positions[prefix:, None])[None, None]  # [1, 1, C, P + C]
        # NeMo's own SDPA call; key / value are [B, H, P + C, *] already, so its transposes copy nothing.
        query, key, value, attention_kwargs = _nemo_attention_inputs()(
            query, key.transpose(1, 2), value.transpose(1, 2), causal, "sdpa")
        if prefix:
            # NeMo's SDPA function with this mask would repeat_interleave keys and values by their group count
            # (a copy of the prefix's, even at 1); the call it then makes, on the tensors as they are.
            assert module.num_key_value_groups == 1, "K3's MLA has as many key/value heads as query heads"
            output = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, dropout_p=0.0, scale=module.scaling, enable_gqa=False, **attention_kwargs)
        else:
            output = module.attn_func(query, key, value, dropout_p=0.0, **attention_kwargs)
        output = _nemo_attention_output()(output, "sdpa").reshape(batch, length, -1)
        if module.use_output_gate:
            output = output * module.g_proj(hidden_states).sigmoid()
        return module.o_proj(output)


def _nemo_attention_inputs() -> Any:
    return _nemo_kimi().preprocess_args_and_kwargs_for_attn


def _nemo_attention_output() -> Any:
    return _nemo_kimi().postprocess_output_for_attn
