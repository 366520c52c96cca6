"""Model-family registry: where a Hugging Face causal LM keeps what the capture needs.

In: a target's ``config.json`` (its ``model_type``). Out: a :class:`Family` that says where the
decoder layers, final norm, embeddings, lm_head and routed-expert blocks live, which sub-config
is the text config, how many routed experts there are, and which parallel layouts the family
supports. Every model-type difference in the project lives here as data: no other module
branches on ``model_type``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ds_capture.errors import CaptureError, parse_json
from ds_capture.target import attention_sizes


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def _mean_over_hyper_connections(hidden: torch.Tensor) -> torch.Tensor:
    # DeepSeek-V4 hyper-connection layers emit [B, S, hc, H]; the feature is the mean over hc.
    return hidden.mean(dim=-2) if hidden.dim() == 4 else hidden


@dataclass(frozen=True, kw_only=True)
class Family:
    """Where one model family keeps its parts (dotted attribute paths from the CausalLM root)."""

    model_type: str
    """``config.model_type`` of the checkpoint (the outer one for multimodal wrappers)."""
    text_config_attr: str | None = None
    """Attribute of the config holding the text decoder's config (``None``: the config itself)."""
    auto_class: str = "AutoModelForCausalLM"
    """The transformers auto class whose mapping builds the model (a multimodal wrapper's own class)."""
    drop_modules: tuple[str, ...] = ()
    """Submodules text capture never runs (a vision tower): removed before loading, their weights never read."""
    layers: str = "model.layers"
    """The ``nn.ModuleList`` of decoder layers."""
    final_norm: str = "model.norm"
    """The final norm; its output is the last hidden state (layer id L-1)."""
    embed_tokens: str = "model.embed_tokens"
    lm_head: str = "lm_head"
    embed_weight_key: str = "model.embed_tokens.weight"
    """Checkpoint key of the embedding matrix."""
    lm_head_weight_key: str = "lm_head.weight"
    """Checkpoint key of the lm_head matrix (absent when tied: the embedding is used)."""
    attention: str = "self_attn"
    """Attribute of a decoder layer holding its attention block (ds-capture plan counts its parameters)."""
    moe_block: str | None = None
    """Attribute of a decoder layer holding the sparse MoE block (``None``: dense family)."""
    experts: str = "experts"
    """Attribute of the MoE block holding the fused routed experts."""
    router: str = "gate"
    """Attribute of the MoE block holding the router."""
    num_experts_key: str | None = None
    """Text-config attribute giving the number of routed experts."""
    reduce_layer_output: Callable[[torch.Tensor], torch.Tensor] = _identity
    """Maps a decoder layer's output to its [B, S, H] feature."""
    residual_streams_key: str | None = None
    """Text-config attribute giving the residual-stream copies per token (hyper-connections); None: one."""
    keys_per_query: Callable[[Any], float] | None = None
    """Attention keys per query relative to S (compressed KV appended), from the text config (ds-capture plan)."""
    indexer_scores: Callable[[Any, int, int], int] | None = None
    """Bytes of the scores a sparse-attention indexer materialises for a [B, S] batch (ds-capture plan)."""
    attention_bias: Callable[[Any, int, int], int] | None = None
    """Bytes of a dense attention bias the attention builds for a [B, S] batch, alive with its scores (plan)."""
    supports_tp: bool = True
    """AutoTP shards this family's attention correctly."""
    tp_refusal: str = ""
    supports_ep: bool = True
    ep_refusal: str = ""
    refusal: str = ""
    """Non-empty: the family cannot be captured at all (the reason, shown to the user)."""
    attn_implementations: tuple[str, ...] = ()
    """The only attention implementations the family computes (the first is the default); empty: any."""
    attn_reason: str = ""
    """Why only ``attn_implementations`` (shown when another one is configured)."""
    build_from_text_config: bool = False
    """Build ``auto_class``'s model for the text config alone (the release's wrapper cannot run text only)."""
    checkpoint_prefix: str = ""
    """Checkpoint keys under this prefix are the built model's (prefix stripped); all other keys (a vision tower
    stored next to it) are skipped, never read. Empty: every key is the model's."""
    caveat: str = ""
    """A limit of the family's cache the user should know (shown in docs/support.md's support table)."""
    tp_plan: Mapping[str, str] = field(default_factory=dict)
    """Our own tensor-parallel plan instead of AutoTP (:mod:`ds_capture.parallel.tensor_parallel`): decoder-layer-
    relative paths -> ``colwise`` (output rows split) / ``gathered`` (input all-gathered, output rows split,
    output all-gathered: no partial sums) / ``grouped`` (a block-diagonal grouped linear's groups split) / ``heads``
    (a per-head parameter split) / ``per_rank`` (an integer attribute divided by tp); everything else is
    replicated. Empty: AutoTP shards the family."""
    tp_replicates_kv_heads: bool = False
    """``tp_plan`` keeps the key/value heads whole (DeepSeek-V4's one KV head, broadcast to each rank's query
    heads), so tp_size need not divide them."""
    implementation: str = "transformers"
    """Who builds the model: ``transformers`` (``auto_class``) or ``nemo`` (NeMo AutoModel 0.7.0's own class
    ``nemo_class``, the ``nemo`` extra: :mod:`ds_capture.target.nemo_models`)."""
    nemo_class: str = ""
    """``module:Class`` of NeMo's causal LM for this family (``implementation == "nemo"``)."""
    nemo_config_class: str = ""
    """``module:Class`` of NeMo's config for this family's ``config.json``."""
    release_placement: str = ""
    """``module:function`` ``(NeMo config, raw config.json, model's state-dict names) -> (release key -> Placement |
    None)``: where one (logical) release tensor goes in NeMo's model (:mod:`ds_capture.target.nemo_release`);
    None: never read."""
    nemo_config_overrides: Mapping[str, Any] = field(default_factory=dict)
    """Keyword overrides for NeMo's config ``from_pretrained`` (DeepSeek-V4.1: no vision tower, as NeMo's DSpark
    target builds it)."""
    planning_tokenizer: str = ""
    """``module:function`` ``(NeMo config) -> tokenizer`` the class is built with when the target directory has no
    tokenizer (``ds-capture plan`` on a release's config.json alone; DeepSeek-V4.1's Engram needs one)."""
    buffer_modules: tuple[str, ...] = ()
    """Modules of a NeMo model whose non-persistent buffers their own ``init_weights()`` recomputes after load."""
    row_parallel_tables: tuple[str, ...] = ()
    """Decoder-layer-relative paths of lookup tables (``embed(ids [...]) -> [..., dim]``, weight ``[rows, dim]``)
    that a world > 1 splits by row owner over all ranks (:mod:`ds_capture.parallel.engram_parallel`): tables too
    large for every rank to hold (DeepSeek-V4.1's Engram, ~183 GiB a layer at release size). Layers without one
    are skipped."""
    needs_fla: bool = False
    """The NeMo class imports flash-linear-attention's kernels (CPU torch providers where absent: :mod:`.nemo_fla`)."""
    feature_module: str | None = None
    """Decoder-layer-relative module whose forward *input* is feature ``i`` (NeMo's
    ``get_dspark_target_feature_modules``): ids are then ``0..L-1``, each that module's input reduced by
    ``reduce_layer_output``, the last id included (not the post-norm state), and ``-1`` is refused."""
    eagle3_refusal: str = ""
    """Non-empty: the EAGLE-3 cache kind is refused for this family (the reason)."""
    full_width: bool = False
    """Every row is computed at ``seq_length`` (as NeMo computes it): the family's output at a position depends on
    the computed width, so ``capture.pad_to_multiple_of`` does not apply."""
    width_reason: str = ""
    """Why ``full_width`` (shown when length bucketing is configured)."""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def text_config(self, config: Any) -> Any:
        """The text decoder's config object (``config`` itself for plain causal LMs)."""
        # A NeMo family's checkpoint may hold the text config alone (Kimi K3 as `kimi_linear`).
        return getattr(config, self.text_config_attr, config) if self.text_config_attr else config

    def build_config(self, config: Any) -> Any:
        """The config the model class is built from: the text config where the family builds from it."""
        return self.text_config(config) if self.build_from_text_config else config

    def model_class(self, config: Any) -> type:
        """The model class ``auto_class`` maps ``config`` (:meth:`build_config`'s) to (importing its module)."""
        import transformers

        return getattr(transformers, self.auto_class)._model_mapping[type(config)]

    def resolve_attn_implementation(self, configured: str | None, *, source: str = "the recipe") -> str | None:
        """The attention implementation to build with: ``configured`` if the family computes it, its default
        when none is configured; a ``CaptureError`` naming the allowed ones otherwise."""
        if not self.attn_implementations:
            return configured
        if configured is None:
            return self.attn_implementations[0]
        if configured not in self.attn_implementations:
            raise CaptureError(
                f"{source}: `recipe_args.target_attn_implementation` {configured!r}: model_type {self.model_type!r} computes "
                f"attention with {', '.join(map(repr, self.attn_implementations))} only ({self.attn_reason}). "
                f"Set it to {self.attn_implementations[0]!r} or leave it unset."
            )
        return configured

    def drop_unused_modules(self, model: torch.nn.Module) -> None:
        """Remove ``drop_modules`` from ``model`` (the forward skips them when given token ids only)."""
        for path in self.drop_modules:
            parent, _, leaf = path.rpartition(".")
            setattr(get_submodule(model, parent) if parent else model, leaf, None)

    @property
    def is_moe(self) -> bool:
        return self.moe_block is not None

    @property
    def is_nemo(self) -> bool:
        return self.implementation == "nemo"

    def layer(self, layers: Any, index: int) -> torch.nn.Module:
        """Decoder layer ``index`` of the ``layers`` container (a ``ModuleList``, or NeMo's ``ModuleDict`` keyed
        ``"0".."L-1"``)."""
        return layers[str(index)] if isinstance(layers, torch.nn.ModuleDict) else layers[index]


_MULTIMODAL_ONLY = (
    "model_type {model_type!r} is a multimodal-only target: its cache would not be text-only, which the "
    "DSpark cache format (v1) cannot represent. Use a text-only target checkpoint."
)

# Refusals are shown after "tp_size N: " / "ep_size N: " (runner) or "distributed.tp_size (N): " (engines), so
# each one says why and what to do instead.
_AUTOTP_MISSHARDS = (
    "DeepSpeed AutoTP mis-shards {what} of model_type {model_type!r} (the sharded forward dies with shape "
    "errors), so this family has no tensor-parallel layout. Keep tp_size 1 and {instead}."
)
_AUTOTP_EMPTY_SHARD = (
    "DeepSpeed AutoTP column-splits {what} of model_type {model_type!r}, a linear layer with a single output, "
    "which leaves a rank an empty shard, so this family has no tensor-parallel layout. Keep tp_size 1 and {instead}."
)
_USE_EP = "shard the routed experts with ep_size instead (data parallel x expert parallel)"
_USE_DP_OR_FSDP2 = "scale with data parallelism, or shard every parameter over the ranks with engine: fsdp2"
_DENSE_ONLY = (
    "model_type {model_type!r} is registered as a dense family here: it has no routed experts to shard. "
    "Keep ep_size 1 (use tp_size or data parallelism)."
)

_NEMO_NO_TP = (
    "model_type {model_type!r} is built by NeMo AutoModel's {cls}, which declares no tensor-parallel plan "
    "(ModelCapabilities.supports_tp is False) and whose attention ({what}) DeepSpeed AutoTP cannot shard "
    "correctly. Keep tp_size 1: use ep_size for the routed experts and data parallelism for throughput."
)
_V41_WIDTH = (
    "DeepSeek-V4.1's indexer keeps its top-k of exactly tied (ReLU-summed) scores differently at different "
    "computed widths, so a row's states depend on how wide it is computed; NeMo computes every row at seq_length"
)
_V41_EAGLE3 = (
    "model_type 'deepseek_v41' has no EAGLE-3 contract to match: NeMo AutoModel 0.7.0's EAGLE-3 target wrapper "
    "(HFEagle3TargetModel) concatenates the decoder layers' outputs, which for DeepSeek-V4.1 are the 4 residual "
    "streams [B, S, 4, H], into a tensor its trainer cannot read (it expects [B, S, 3H]). Use cache_kind: dspark "
    "(NeMo's DSpark wrapper captures this family's own feature points)."
)
_NEMO = "nemo_automodel.components.models"
_NEMO_SDPA = "NeMo's class is built with its torch backend, BackendConfig(attn='sdpa', experts='torch')"

# Head-parallel MLA (the low-rank q_a / kv_a projections, their norms and the DSA indexer replicated: the indexer
# scores every key with all its heads, so it cannot be head-split without changing its top-k), o_proj gathered, and
# the dense / shared-expert MLPs split by their intermediate dim (down_proj gathered).
_DSA_TIES = (
    "the DSA indexer keeps the top index_topk keys by a sum over heads of ReLU'd scores; keys whose scores tie "
    "(exactly 0, common with few indexer heads) are chosen by torch.topk differently for a row padded in a "
    "micro-batch than for the row alone. So the cache can depend on how rows are batched (micro_batch_size, "
    "capture.pad_to_multiple_of, capture.sort_by_length), never on the parallel layout (every layout forwards the "
    "same micro-batches). Measured on the tiny targets (benchmarks/dsa_ties.py): up to {two} in the hidden states "
    "with 2 indexer heads, {sixteen} with 16 (transformers' default configs have 32 or 64). A batching-independent cache is possible: "
    "micro_batch_size 1 with capture.pad_to_multiple_of 1 forwards every row alone at its own length."
)
_MLP_TP_PLAN = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "gathered"}
_MLA_TP_PLAN = {
    "self_attn.q_b_proj": "colwise", "self_attn.kv_b_proj": "colwise", "self_attn.o_proj": "gathered",
    **{f"mlp.{leaf}": style for leaf, style in _MLP_TP_PLAN.items()},
    **{f"mlp.shared_experts.{leaf}": style for leaf, style in _MLP_TP_PLAN.items()},
}

# Head-parallel grouped-query attention (q / k / v by heads, o_proj gathered) and the MLP by its intermediate dim.
_GQA_TP_PLAN = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "gathered", **{f"mlp.{leaf}": style for leaf, style in _MLP_TP_PLAN.items()},
}

# DeepSeek-V4 (AutoTP mis-shards its compressor): head-parallel queries, sinks and grouped output projection (a
# rank's o_groups/tp groups read exactly its heads), o_b_proj gathered; the one KV head, the compressors, the
# indexer and q_a_proj stay whole (the KV head is broadcast to the rank's heads: num_key_value_groups / tp).
_V4_TP_PLAN = {
    "self_attn.q_b_proj": "colwise", "self_attn.sinks": "heads", "self_attn.num_key_value_groups": "per_rank",
    "self_attn.o_a_proj": "grouped", "self_attn.o_b_proj": "gathered",
    **{f"mlp.shared_experts.{leaf}": style for leaf, style in _MLP_TP_PLAN.items()},
}

FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family(model_type="llama"),
        Family(model_type="qwen2"),
        Family(model_type="qwen3"),
        Family(model_type="mistral"),
        Family(model_type="qwen3_moe", moe_block="mlp", num_experts_key="num_experts"),
        # On disk: block_sparse_moe.experts.E.w1/w2/w3; transformers' conversion mapping renames them.
        Family(model_type="mixtral", moe_block="mlp", num_experts_key="num_local_experts"),
        # DeepSeek-V3 and Kimi-K2 (a deepseek_v3 checkpoint with more experts).
        Family(model_type="deepseek_v3", moe_block="mlp", num_experts_key="n_routed_experts"),
        # Hyper-connection layers emit [B, S, hc, H]; hash-routed first layers read input_ids, which the
        # model itself threads to every layer. Keys as DeepSeek's release stores them (`embed.weight`,
        # `head.weight`, `layers.N.attn...`, no `model.` prefix); transformers' conversion mapping renames them.
        Family(
            model_type="deepseek_v4", moe_block="mlp", num_experts_key="n_routed_experts",
            embed_weight_key="embed.weight", lm_head_weight_key="head.weight", reduce_layer_output=_mean_over_hyper_connections,
            residual_streams_key="hc_mult", keys_per_query=attention_sizes.compressed_keys_per_query,
            indexer_scores=attention_sizes.csa_indexer_scores,
            caveat=_DSA_TIES.format(two="2.8", sixteen="1e-5").replace("the DSA indexer", "the compressed-attention "
                                                                        "indexer (as DSA's)"),
            tp_plan=_V4_TP_PLAN, tp_replicates_kv_heads=True,
        ),
        # GLM-5.x: dense first layers (no experts there), DSA indexer attention. AutoTP mis-shards the DSA indexer
        # (self_attn.indexer.wk), so TP is our own head-parallel MLA plan, the indexer replicated.
        Family(
            model_type="glm_moe_dsa", moe_block="mlp", num_experts_key="n_routed_experts", tp_plan=_MLA_TP_PLAN,
            indexer_scores=attention_sizes.dsa_indexer_scores,
            caveat=_DSA_TIES.format(two="10.3", sixteen="2e-6"),
        ),
        # Gemma 4 loads as Gemma4ForConditionalGeneration: the text stack sits under `language_model` and the
        # size fields live in `text_config`; only the text decoder is captured.
        # AutoTP mis-shards the per-layer input gate (per_layer_input_gate): TP is our own head-parallel plan,
        # the per-layer input gate and projection replicated.
        Family(
            model_type="gemma4", text_config_attr="text_config",
            layers="model.language_model.layers", final_norm="model.language_model.norm",
            embed_tokens="model.language_model.embed_tokens",
            embed_weight_key="model.language_model.embed_tokens.weight",
            tp_plan=_GQA_TP_PLAN,
            supports_ep=False,
            ep_refusal=_DENSE_ONLY.format(model_type="gemma4")
            + " Gemma 4's MoE variant keeps its experts on the decoder layer itself, which the expert-parallel "
            "layer does not handle.",
        ),
        # Kimi-K2.5 / K2.6: a DeepSeek-V3 text decoder under `model.language_model` of the vision-language
        # wrapper (AutoModelForCausalLM has no mapping for it). The vision tower and projector are dropped:
        # text capture never runs them. On disk: `language_model.model.layers...`, `language_model.lm_head`;
        # transformers' conversion mapping renames them.
        Family(
            model_type="kimi_k25", text_config_attr="text_config", auto_class="AutoModelForImageTextToText",
            drop_modules=("model.vision_tower", "model.mm_projector"),
            layers="model.language_model.layers", final_norm="model.language_model.norm",
            embed_tokens="model.language_model.embed_tokens",
            embed_weight_key="language_model.model.embed_tokens.weight",
            lm_head_weight_key="language_model.lm_head.weight",
            moe_block="mlp", num_experts_key="n_routed_experts",
        ),
        # GLM-4.5 / 4.6 / 4.7. Releases carry the MTP layer as `model.layers.<L>` (skipped, never read).
        Family(model_type="glm4_moe", moe_block="mlp", num_experts_key="n_routed_experts"),
        # Qwen3.5 MoE is released as its vision-language wrapper: the text decoder under `model.language_model`
        # (Gated DeltaNet + gated full attention), the vision tower `model.visual` dropped, never read.
        Family(
            model_type="qwen3_5_moe", text_config_attr="text_config", auto_class="AutoModelForImageTextToText",
            drop_modules=("model.visual",), layers="model.language_model.layers",
            final_norm="model.language_model.norm", embed_tokens="model.language_model.embed_tokens",
            embed_weight_key="model.language_model.embed_tokens.weight",
            moe_block="mlp", num_experts_key="num_experts",
            supports_tp=False,
            tp_refusal=_AUTOTP_EMPTY_SHARD.format(what="the shared-expert gate (mlp.shared_expert_gate)",
                                                   model_type="qwen3_5_moe", instead=_USE_EP),
        ),
        # Qwen3-Next: Gated DeltaNet linear attention on 3 of 4 layers.
        Family(
            model_type="qwen3_next", moe_block="mlp", num_experts_key="num_experts",
            supports_tp=False,
            tp_refusal=_AUTOTP_EMPTY_SHARD.format(what="the shared-expert gate (mlp.shared_expert_gate)",
                                                   model_type="qwen3_next", instead=_USE_EP),
        ),
        # DeepSeek-V3.2: DeepSeek-V3 with the DSA indexer, which AutoTP mis-shards (self_attn.indexer.wk): TP is our
        # own head-parallel MLA plan, the indexer replicated.
        Family(model_type="deepseek_v32", moe_block="mlp", num_experts_key="n_routed_experts", tp_plan=_MLA_TP_PLAN,
               caveat=_DSA_TIES.format(two="8.7", sixteen="2e-6")),
        # MiniMax-M2: q/k norms span all heads (one RMSNorm over num_heads * head_dim).
        Family(
            model_type="minimax_m2", moe_block="mlp", num_experts_key="num_local_experts",
            supports_tp=False,
            tp_refusal=_AUTOTP_MISSHARDS.format(what="the all-head q/k norms (self_attn.q_norm, self_attn.k_norm)",
                                                model_type="minimax_m2", instead=_USE_EP),
        ),
        # Kimi-Linear: KDA linear attention (short convolutions over the projected channels) and MLA.
        Family(
            model_type="kimi_linear", moe_block="mlp", num_experts_key="num_local_experts",
            supports_tp=False,
            tp_refusal=_AUTOTP_MISSHARDS.format(what="the KDA forget gate (self_attn.forget_gate.f_a_proj, f_b_proj)",
                                                model_type="kimi_linear", instead=_USE_EP),
        ),
        # gpt-oss: the router is `mlp.router`; attention sinks are computed by the eager attention only here.
        Family(
            model_type="gpt_oss", moe_block="mlp", router="router", num_experts_key="num_local_experts",
            attn_implementations=("eager",),
            attn_reason="its attention sinks are in transformers' eager attention; sdpa does not support them",
            # AutoTP mis-shards the per-head sinks: our own head-parallel plan splits them with the heads.
            tp_plan={**_GQA_TP_PLAN, "self_attn.sinks": "heads"},
        ),
        # GLM-5.3 (glm5_next): no causal-LM mapping, so it loads through the vision-language class (vision tower
        # dropped, never read); KDA + DSA-indexed MLA, hyper-connection layers ([B, S, hc, H]: mean over hc).
        Family(
            model_type="glm5_next", text_config_attr="text_config", auto_class="AutoModelForImageTextToText",
            drop_modules=("model.visual",), layers="model.language_model.layers",
            final_norm="model.language_model.norm", embed_tokens="model.language_model.embed_tokens",
            embed_weight_key="model.language_model.embed_tokens.weight",
            moe_block="mlp", num_experts_key="n_routed_experts", reduce_layer_output=_mean_over_hyper_connections,
            caveat=_DSA_TIES.format(two="6.0", sixteen="1e-5"),
            supports_tp=False,
            tp_refusal=_AUTOTP_MISSHARDS.format(what="the KDA forget gate (self_attn.forget_gate.f_a_proj, f_b_proj)",
                                                model_type="glm5_next", instead=_USE_EP),
        ),
        # Llama 4 is released as its vision-language wrapper, whose forward needs image outputs: the text model
        # (Llama4ForCausalLM) is built from text_config and read from the `language_model.` keys; the vision
        # tower and projector keys are skipped, never read.
        Family(
            model_type="llama4", text_config_attr="text_config", build_from_text_config=True,
            checkpoint_prefix="language_model.", embed_weight_key="language_model.model.embed_tokens.weight",
            lm_head_weight_key="language_model.lm_head.weight",
            moe_block="feed_forward", router="router", num_experts_key="num_local_experts",
            supports_tp=False,
            tp_refusal="DeepSpeed AutoTP replaces the router (feed_forward.router, a linear layer returning "
            "(scores, logits)) of model_type 'llama4' with a plain linear layer, so the sharded forward dies "
            f"unpacking it and this family has no tensor-parallel layout. Keep tp_size 1 and {_USE_DP_OR_FSDP2}.",
            supports_ep=False,
            ep_refusal="Llama 4's experts (feed_forward.experts) take every token pre-weighted by its router "
            "score through all experts densely (no (hidden, top_k_index, top_k_weights) call), which the "
            "expert-parallel layer cannot split exactly. Keep ep_size 1 (use data parallelism, or engine: fsdp2).",
        ),
        Family(model_type="minimax_m3_vl", refusal=_MULTIMODAL_ONLY),
        # No transformers implementation; NeMo AutoModel 0.7.0's classes build and run on CPU but cannot be
        # driven through this project's layers yet (see the reasons: measured with its tiny CPU build).
        # DeepSeek-V4.1: NeMo's class (no transformers implementation). Features are the streams entering layer i
        # (the input of its attention hyper-connection, after the layer's Engram update), mean over the 4 streams.
        Family(
            model_type="deepseek_v41", implementation="nemo", text_config_attr="text_config",
            nemo_class=f"{_NEMO}.deepseek_v41.model:DeepseekV41ForCausalLM",
            nemo_config_class=f"{_NEMO}.deepseek_v41.config:DeepseekV41Config",
            release_placement="ds_capture.target.nemo_v41:v41_placer", buffer_modules=("model.engram_hash",),
            row_parallel_tables=("engram.embed",),
            nemo_config_overrides={"vision_config": {"num_hidden_layers": 0}},
            planning_tokenizer="ds_capture.target.nemo_v41:planning_tokenizer",
            embed_weight_key="embed.weight", lm_head_weight_key="head.weight", attention="attn", moe_block="ffn",
            num_experts_key="n_routed_experts", residual_streams_key="hc_mult",
            feature_module="attn_hc", reduce_layer_output=_mean_over_hyper_connections,
            eagle3_refusal=_V41_EAGLE3, full_width=True, width_reason=_V41_WIDTH, attention_bias=attention_sizes.v41_dense_attention_bias, attn_implementations=("sdpa",), attn_reason=_NEMO_SDPA,
            supports_tp=False, tp_refusal=_NEMO_NO_TP.format(model_type="deepseek_v41", cls="DeepseekV41ForCausalLM",
                                                            what="one shared KV head, grouped low-rank output, "
                                                            "compressed KV and its indexer"),
        ),
        # Kimi K3: NeMo's class, released as its vision-language wrapper (text keys under `language_model.`); KDA
        # layers need fla's kernels (CPU torch providers where absent). NeMo's generic capture rule.
        Family(
            model_type="kimi_k3", implementation="nemo", text_config_attr="text_config", needs_fla=True,
            nemo_class=f"{_NEMO}.kimi_k3.model:KimiK3ForCausalLM",
            nemo_config_class=f"{_NEMO}.kimi_k3.config:KimiK3Config",
            release_placement="ds_capture.target.nemo_k3:k3_placer",
            embed_weight_key="language_model.model.embed_tokens.weight",
            lm_head_weight_key="language_model.lm_head.weight", moe_block="mlp", num_experts_key="num_experts",
            attn_implementations=("sdpa",), attn_reason=_NEMO_SDPA,
            supports_tp=False, tp_refusal=_NEMO_NO_TP.format(model_type="kimi_k3", cls="KimiK3ForCausalLM",
                                                            what="KDA short convolutions and gates, MLA"),
        ),
    )
}


def resolve_model_type(raw: Mapping[str, Any]) -> str:
    """The registry key for a raw ``config.json``: its ``model_type``, except that Kimi K3's text config claims
    ``kimi_linear`` (Kimi-Linear's type, a transformers family): K3-only fields make it ``kimi_k3``, as NeMo reads it."""
    model_type = raw.get("model_type", "")
    if model_type == "kimi_linear":
        from ds_capture.target.nemo_k3 import is_kimi_k3

        if is_kimi_k3(dict(raw)):
            return "kimi_k3"
    return model_type


def get_family(model_type: str, *, source: str = "config.json") -> Family:
    """The registry entry for ``model_type``; a ``CaptureError`` naming the supported ones otherwise."""
    family = FAMILIES.get(model_type)
    if family is None:
        supported = ", ".join(sorted(name for name, f in FAMILIES.items() if not f.refusal))
        raise CaptureError(
            f"{source}: model_type {model_type!r} is not a supported target family. Supported: {supported}."
        )
    if family.refusal:
        raise CaptureError(f"{source}: " + family.refusal.format(model_type=model_type))
    return family


@dataclass(frozen=True, kw_only=True)
class TargetInfo:
    """What the run needs to know about the target before any weight loads (from ``config.json``)."""

    path: Path
    family: Family
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None
    num_experts: int | None
    tie_word_embeddings: bool
    checkpoint_num_hidden_layers: int | None = None
    """Set when ``recipe_args.target_num_hidden_layers`` builds only the first ``num_hidden_layers`` of them."""

    def with_depth(self, num_layers: int | None, *, source: str) -> "TargetInfo":
        """NeMo's reduced-depth diagnostic: only the first ``num_layers`` decoder layers (1..L), or self."""
        if num_layers is None:
            return self
        if not 1 <= num_layers <= self.num_hidden_layers:
            raise CaptureError(
                f"{source}: recipe_args.target_num_hidden_layers={num_layers} must be in [1, "
                f"{self.num_hidden_layers}] (the checkpoint's depth, {self.path / 'config.json'})."
            )
        return replace(self, num_hidden_layers=num_layers, checkpoint_num_hidden_layers=self.num_hidden_layers)

    @property
    def tp_key_value_heads(self) -> int | None:
        """The key/value heads tensor parallelism splits (None: no GQA, or kept whole by the family's plan)."""
        return None if self.family.tp_replicates_kv_heads else self.num_key_value_heads

    @property
    def skipped_layer_modules(self) -> tuple[str, ...]:
        """Module paths of the decoder layers a reduced-depth build leaves out (their weights are never read)."""
        if self.checkpoint_num_hidden_layers is None:
            return ()
        return tuple(f"{self.family.layers}.{i}" for i in range(self.num_hidden_layers, self.checkpoint_num_hidden_layers))


def read_target_info(target_dir: Path, *, trust_remote_code: bool = False) -> TargetInfo:
    """Read ``target_dir/config.json`` (through ``AutoConfig``: attribute maps included) and resolve the family."""
    from transformers import AutoConfig

    config_path = Path(target_dir) / "config.json"
    if not Path(target_dir).is_dir():
        what = "is a file, not a directory" if Path(target_dir).exists() else "does not exist"
        raise CaptureError(
            f"recipe_args.target_model_name_or_path: {target_dir} {what}. Point it at a local Hugging Face "
            "checkpoint directory (config.json + *.safetensors + tokenizer files)."
        )
    if not config_path.is_file():
        raise CaptureError(
            f"recipe_args.target_model_name_or_path: {target_dir} has no config.json. Point it at a local "
            "Hugging Face checkpoint directory (config.json + *.safetensors + tokenizer files)."
        )
    raw = parse_json(config_path.read_text(), str(config_path), "Fix the file, or point "
                     "recipe_args.target_model_name_or_path at an intact Hugging Face checkpoint directory.")
    model_type = resolve_model_type(raw)
    family = get_family(model_type, source=str(config_path))
    from ds_capture.target.quant import read_quant_config

    read_quant_config(raw, config_path)  # an unsupported quant_method is refused before any weight loads
    if family.is_nemo:
        from ds_capture.target.nemo_config import read_nemo_config

        config = read_nemo_config(family, Path(target_dir))
    else:
        try:
            config = AutoConfig.from_pretrained(str(target_dir), trust_remote_code=trust_remote_code)
        except (ValueError, OSError, TypeError) as error:
            raise CaptureError(f"{config_path}: transformers cannot read this config ({error}).") from error
    text = family.text_config(config)
    num_experts = getattr(text, family.num_experts_key, None) if family.num_experts_key else None
    return TargetInfo(
        path=Path(target_dir),
        family=family,
        model_type=raw.get("model_type", ""),  # as config.json says it (NeMo's manifests record this one)
        vocab_size=int(text.vocab_size),
        hidden_size=int(text.hidden_size),
        num_hidden_layers=int(text.num_hidden_layers),
        num_attention_heads=int(text.num_attention_heads),
        num_key_value_heads=getattr(text, "num_key_value_heads", None),
        num_experts=int(num_experts) if num_experts else None,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


def get_submodule(root: torch.nn.Module, dotted: str) -> torch.nn.Module:
    """``root.get_submodule`` with an error that names the family path (a registry bug, not a user error)."""
    try:
        return root.get_submodule(dotted)
    except AttributeError as error:
        raise AttributeError(f"family path {dotted!r} not found on {type(root).__name__}") from error
