"""The registry entries: every supported (and every refused) ``model_type`` as a :class:`~.family.Family`.

In: nothing (data). Out: ``FAMILIES`` (model_type -> Family), with the refusals each family gives for a layout it
does not support, its own tensor-parallel plans and caveats. Every model-type difference in the project lives here
as data: no other module branches on ``model_type``.
"""

from __future__ import annotations

from ds_capture.target import attention_sizes
from ds_capture.target.family import Family, mean_over_hyper_connections

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
_SHARED_EXPERT_GATE = "the shared-expert gate (mlp.shared_expert_gate)"
_KDA_FORGET_GATE = "the KDA forget gate (self_attn.forget_gate.f_a_proj, f_b_proj)"


def _no_autotp(refusal: str, what: str, model_type: str) -> dict:
    """A family AutoTP cannot shard (``refusal``: it mis-shards ``what``, or leaves a rank an empty shard of it):
    no tensor-parallel layout, expert parallelism the way to shard it."""
    return {"supports_tp": False, "tp_refusal": refusal.format(what=what, model_type=model_type, instead=_USE_EP)}

_USE_DP_OR_FSDP2 = "scale with data parallelism, or shard every parameter over the ranks with engine: fsdp2"
_DENSE_ONLY = (
    "model_type {model_type!r} is registered as a dense family here: it has no routed experts to shard. "
    "Keep ep_size 1 (use tp_size or data parallelism)."
)

# Gated DeltaNet and KDA compute in blocks of 64 tokens (Family.chunk_multiple).
_LINEAR_ATTENTION_BLOCK = 64
# DeepSeek-V4.1's compressed layers pool groups of `compress_ratio` tokens (the release: 1 and 2).
_V41_COMPRESSION_GROUP = 2
_V41_GROUPS = (
    "its compressed attention pools groups of 1 or {multiple} tokens into one compressed key, and a chunk must end "
    "on a group's boundary"
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
_KDA_MLA_CHUNKS = "ds_capture.target.nemo_kda_mla_chunks"
_V41_CHUNKS = "ds_capture.target.nemo_v41_chunks"
_QUERY_BLOCKS = "ds_capture.target.query_blocks"
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
            embed_weight_key="embed.weight", lm_head_weight_key="head.weight", reduce_layer_output=mean_over_hyper_connections,
            residual_streams_key="hc_mult", keys_per_query=attention_sizes.compressed_keys_per_query,
            indexer_scores=attention_sizes.csa_indexer_scores,
            caveat=_DSA_TIES.format(two="2.8", sixteen="1e-5").replace("the DSA indexer", "the compressed-attention "
                                                                        "indexer (as DSA's)"),
            tp_plan=_V4_TP_PLAN, tp_replicates_kv_heads=True,
            chunk_query_blocks={"DeepseekV4Indexer": f"{_QUERY_BLOCKS}:CsaIndexerBlocks"},
            chunk_attention_keys=attention_sizes.compressed_chunk_keys,
        ),
        # GLM-5.x: dense first layers (no experts there), DSA indexer attention. AutoTP mis-shards the DSA indexer
        # (self_attn.indexer.wk), so TP is our own head-parallel MLA plan, the indexer replicated.
        Family(
            model_type="glm_moe_dsa", moe_block="mlp", num_experts_key="n_routed_experts", tp_plan=_MLA_TP_PLAN,
            indexer_scores=attention_sizes.dsa_indexer_scores,
            caveat=_DSA_TIES.format(two="10.3", sixteen="2e-6"),
            # Chunked prefill: the indexer and the MLA attention (on the cached latent) in blocks of queries.
            chunk_query_blocks={"GlmMoeDsaIndexer": f"{_QUERY_BLOCKS}:DsaIndexerBlocks",
                                "GlmMoeDsaAttention": f"{_QUERY_BLOCKS}:LatentMlaBlocks"},
            chunk_expansion=attention_sizes.latent_attention_transient,
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
            **_no_autotp(_AUTOTP_EMPTY_SHARD, _SHARED_EXPERT_GATE, "qwen3_5_moe"),
            chunk_multiple=_LINEAR_ATTENTION_BLOCK,
        ),
        # Qwen3-Next: Gated DeltaNet linear attention on 3 of 4 layers.
        Family(
            model_type="qwen3_next", moe_block="mlp", num_experts_key="num_experts",
            chunk_multiple=_LINEAR_ATTENTION_BLOCK,
            **_no_autotp(_AUTOTP_EMPTY_SHARD, _SHARED_EXPERT_GATE, "qwen3_next"),
        ),
        # DeepSeek-V3.2: DeepSeek-V3 with the DSA indexer, which AutoTP mis-shards (self_attn.indexer.wk): TP is our
        # own head-parallel MLA plan, the indexer replicated.
        Family(model_type="deepseek_v32", moe_block="mlp", num_experts_key="n_routed_experts", tp_plan=_MLA_TP_PLAN,
               caveat=_DSA_TIES.format(two="8.7", sixteen="2e-6"), indexer_scores=attention_sizes.dsa_indexer_scores,
               chunk_query_blocks={"DeepseekV32Indexer": f"{_QUERY_BLOCKS}:DsaIndexerBlocks",
                                   "DeepseekV32Attention": f"{_QUERY_BLOCKS}:V32LatentMlaBlocks"},
               chunk_expansion=attention_sizes.latent_attention_transient),
        # MiniMax-M2: q/k norms span all heads (one RMSNorm over num_heads * head_dim).
        Family(
            model_type="minimax_m2", moe_block="mlp", num_experts_key="num_local_experts",
            **_no_autotp(_AUTOTP_MISSHARDS, "the all-head q/k norms (self_attn.q_norm, self_attn.k_norm)",
                         "minimax_m2"),
        ),
        # Kimi-Linear: KDA linear attention (short convolutions over the projected channels) and MLA.
        Family(
            model_type="kimi_linear", moe_block="mlp", num_experts_key="num_local_experts",
            chunk_multiple=_LINEAR_ATTENTION_BLOCK,
            **_no_autotp(_AUTOTP_MISSHARDS, _KDA_FORGET_GATE, "kimi_linear"),
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
            moe_block="mlp", num_experts_key="n_routed_experts", reduce_layer_output=mean_over_hyper_connections,
            caveat=_DSA_TIES.format(two="6.0", sixteen="1e-5"),
            chunk_multiple=_LINEAR_ATTENTION_BLOCK,
            **_no_autotp(_AUTOTP_MISSHARDS, _KDA_FORGET_GATE, "glm5_next"),
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
            feature_module="attn_hc", reduce_layer_output=mean_over_hyper_connections,
            # Chunked prefill: window tails, compressed KV, index keys (top-k over the row's width) and the Engram
            # n-gram context, carried around NeMo's own modules; chunks end on every layer's compression groups.
            chunk_carriers={"DeepseekV41Attention": f"{_V41_CHUNKS}:CsaCarrier",
                            "DeepseekV41NgramHash": f"{_V41_CHUNKS}:EngramContextCarrier"},
            chunk_multiple=_V41_COMPRESSION_GROUP, chunk_multiple_reason=_V41_GROUPS,
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
            # Chunked prefill: KDA's short-convolution tails and recurrent state, MLA's latent KV, carried around
            # NeMo's own modules (its class takes no cache); KDA computes in 64-token blocks.
            chunk_carriers={"KimiDeltaAttention": f"{_KDA_MLA_CHUNKS}:KdaCarrier",
                            "KimiMLAAttention": f"{_KDA_MLA_CHUNKS}:LatentKvCarrier"},
            chunk_multiple=_LINEAR_ATTENTION_BLOCK,
            supports_tp=False, tp_refusal=_NEMO_NO_TP.format(model_type="kimi_k3", cls="KimiK3ForCausalLM",
                                                            what="KDA short convolutions and gates, MLA"),
        ),
    )
}
