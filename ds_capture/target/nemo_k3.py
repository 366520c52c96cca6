"""Kimi K3's release checkpoint, one tensor at a time: which config is K3, and where each release tensor goes.

In:  ``config.json`` as a dict; the logical keys of the release checkpoint (:func:`.quant.logical_keys`: a
     quantized ``X.weight_packed`` + ``X.weight_scale`` pair is one key ``X.weight``); the state-dict names of
     NeMo AutoModel 0.7.0's ``KimiK3ForCausalLM`` built on ``meta``.
Out: :func:`is_kimi_k3` (the family decision); :func:`read_k3_layout` -> :class:`K3Layout`;
     :func:`k3_placement` -> a :class:`.nemo_release.Placement` per release key (None: never read);
     :func:`place` writes one read (and dequantized) release tensor into the model's tensor.

Together they repeat, per tensor, what NeMo's ``KimiK3StateDictAdapter.from_hf`` does to a whole dict (the tests
hold the two bitwise equal):

- the release is the vision-language wrapper: text keys ``language_model.{model,lm_head}.*``; ``vision_tower.*``
  and ``mm_projector.*`` are never read, nor layers ``>= num_hidden_layers`` (multi-token prediction);
- the MoE block's children are ``block_sparse_moe.{gate, shared_experts, routed_expert_*}`` in the release and
  ``mlp.*`` in the model; the dense first layer is ``mlp.*`` in both;
- KDA's fp32 holders: release ``self_attn.{A_log, dt_bias}`` -> ``self_attn._fp32_params.*``, release
  ``self_attn.{q,k,v}_conv1d.weight`` / ``o_norm.weight`` -> ``self_attn.<name>._fp32_params.weight``; ``A_log``
  is stored zero-padded to a multiple of 128 heads and cut back to ``num_heads`` (NeMo also upcasts these to
  fp32: the model holds them in fp32 whatever its dtype, so :func:`place`'s copy does the same);
- routed experts ``experts.{j}.w1/w3/w2.weight`` (``[I, D]``, ``[I, D]``, ``[D, I]``; D is the latent width
  ``routed_expert_hidden_size``) stack into ``mlp.experts.gate_and_up_projs [E, D, 2I]`` (``w1^T`` in columns
  ``[0, I)``, ``w3^T`` in ``[I, 2I)``) and ``mlp.experts.down_projs [E, I, D]`` (``w2^T``). In the release they are
  MXFP4 (:mod:`.quant`'s ``mxfp4``): dequantize in the release's ``[out, in]`` layout first, then transpose.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Callable

from ds_capture.errors import CaptureError
from ds_capture.target.nemo_release import Placement

TEXT_PREFIX = "language_model."
NEVER_READ_PREFIXES = ("vision_tower.", "mm_projector.")
"""The vision-language wrapper's own modules: a text-only capture never reads them."""

K3_ONLY_FIELDS = ("attn_res_block_size", "activation_situ_beta", "activation_situ_linear_beta",
                  "routed_expert_hidden_size", "latent_moe_use_norm", "mla_use_output_gate")
"""Fields of NeMo's ``KimiK3TextConfig`` that transformers' ``KimiLinearConfig`` (Kimi-Linear-48B-A3B) lacks:
attention residuals, SiTU, the latent MoE, gated MLA."""
K3_ONLY_LINEAR_ATTN_FIELDS = ("gate_lower_bound", "use_full_rank_gate")
"""``linear_attn_config`` entries only K3's KDA reads (the bounded, full-rank gate)."""
K3_ARCHITECTURES = ("KimiK3ForCausalLM", "KimiK3ForConditionalGeneration")

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_MOE_CHILDREN = ("gate.", "shared_experts.", "routed_expert_down_proj.", "routed_expert_up_proj.",
                 "routed_expert_norm.")
_KDA_FP32_PARAMS = ("A_log", "dt_bias")
_KDA_FP32_MODULES = ("q_conv1d", "k_conv1d", "v_conv1d", "o_norm")


def is_kimi_k3(raw_config: dict) -> bool:
    """Whether ``config.json`` (as a dict) is Kimi K3, built with NeMo's ``KimiK3ForCausalLM``.

    ``kimi_k3`` (the vision-language release) is; so is a ``kimi_linear`` config (the release's own
    ``text_config``, or a text-only export) that names a K3 architecture or carries a K3-only field. A
    ``kimi_linear`` config as Kimi-Linear-48B-A3B publishes it has none of them: transformers' Kimi-Linear.
    Moonshot publishes both under ``kimi_linear`` / ``KimiLinearForCausalLM``, so the model type alone cannot say.
    """
    model_type = raw_config.get("model_type")
    if model_type == "kimi_k3":
        return True
    if model_type != "kimi_linear":
        return False
    linear_attn = raw_config.get("linear_attn_config") or {}
    return (any(name in K3_ARCHITECTURES for name in raw_config.get("architectures") or ())
            or any(field in raw_config for field in K3_ONLY_FIELDS)
            or any(field in linear_attn for field in K3_ONLY_LINEAR_ATTN_FIELDS))


@dataclass(frozen=True, kw_only=True)
class K3Layout:
    """What :func:`k3_placement` needs to know about the model: sizes from ``config.json``, names from the model."""

    num_hidden_layers: int
    """Decoder layers the model has; release layers at or past it (multi-token prediction) are never read."""
    num_experts: int
    num_kda_heads: int
    """``linear_attn_config.num_heads``: the release's ``A_log`` is zero-padded past it."""
    moe_intermediate_size: int
    """I: ``gate_and_up_projs`` holds ``w1^T`` in columns ``[0, I)`` and ``w3^T`` in ``[I, 2I)``."""
    native_keys: frozenset[str]
    """The state-dict names of ``KimiK3ForCausalLM`` (built on meta): a release key mapped elsewhere is unknown."""


def read_k3_layout(raw_config: dict, native_keys) -> K3Layout:
    """:class:`K3Layout` from ``config.json`` (the wrapper's ``text_config``, or a text-only K3 config)."""
    text = raw_config["text_config"] if raw_config.get("model_type") == "kimi_k3" else raw_config
    return K3Layout(num_hidden_layers=int(text["num_hidden_layers"]), num_experts=int(text["num_experts"]),
                    num_kda_heads=int(text["linear_attn_config"]["num_heads"]),
                    moe_intermediate_size=int(text["moe_intermediate_size"]), native_keys=frozenset(native_keys))


def k3_placement(release_key: str, layout: K3Layout) -> Placement | None:
    """Where the logical release tensor ``release_key`` goes in ``KimiK3ForCausalLM``; None if it is never read.

    A key that is neither the vision tower / projector, a layer past ``num_hidden_layers``, nor a tensor of the
    model is a ``CaptureError`` naming it.
    """
    if release_key.startswith(NEVER_READ_PREFIXES):
        return None
    key = release_key.removeprefix(TEXT_PREFIX) if release_key.startswith(TEXT_PREFIX) else None
    layer = _LAYER.fullmatch(key or "")
    if layer and int(layer.group(1)) >= layout.num_hidden_layers:
        return None
    placement = _layer_placement(int(layer.group(1)), layer.group(2), layout) if layer else Placement(key or "")
    if placement.native not in layout.native_keys or (placement.expert or 0) >= layout.num_experts:
        raise CaptureError(
            f"{release_key}: not a tensor of Kimi K3's release (no {placement.native or release_key!r} in NeMo's "
            f"KimiK3ForCausalLM with {layout.num_hidden_layers} layers and {layout.num_experts} experts). Expected "
            f"{TEXT_PREFIX}model.* / {TEXT_PREFIX}lm_head.* and the never-read "
            f"{' / '.join(p + '*' for p in NEVER_READ_PREFIXES)}: check that the checkpoint is the one config.json "
            "describes (num_hidden_layers, num_experts)."
        )
    return placement


def _layer_placement(layer: int, rest: str, layout: K3Layout) -> Placement:
    prefix = f"model.layers.{layer}."
    expert = _EXPERT.fullmatch(rest)
    if expert:
        j, projection = int(expert.group(1)), expert.group(2)
        size = layout.moe_intermediate_size
        if projection == "w2":
            return Placement(f"{prefix}mlp.experts.down_projs", expert=j, transpose=True)
        columns = slice(0, size) if projection == "w1" else slice(size, 2 * size)
        return Placement(f"{prefix}mlp.experts.gate_and_up_projs", expert=j, index=(slice(None), columns),
                         transpose=True)
    for child in _MOE_CHILDREN:
        if rest.startswith(f"block_sparse_moe.{child}"):
            return Placement(prefix + "mlp." + rest.removeprefix("block_sparse_moe."))
    for name in _KDA_FP32_PARAMS:
        if rest == f"self_attn.{name}":
            narrow = (-1, 0, layout.num_kda_heads) if name == "A_log" else None
            return Placement(f"{prefix}self_attn._fp32_params.{name}", narrow=narrow)
    for module in _KDA_FP32_MODULES:
        if rest == f"self_attn.{module}.weight":
            return Placement(f"{prefix}self_attn.{module}._fp32_params.weight")
    return Placement(prefix + rest)



def k3_placer(config: Any, raw_config: dict, native_keys) -> Callable[[str], Placement | None]:
    """The family's ``release_placement``: release key -> :class:`Placement` for the model built from ``config``
    (NeMo's config; its text ``num_hidden_layers`` may be reduced) with state-dict names ``native_keys``."""
    layout = replace(read_k3_layout(raw_config, native_keys),
                     num_hidden_layers=getattr(config, "text_config", config).num_hidden_layers)
    return lambda key: k3_placement(key, layout)
