"""The tiny configs the demo builds its targets from: per model family, a tiny but real architecture (data only).

In: nothing. Out: ``TINY_CONFIGS`` (model_type -> kwargs of its transformers config class) and
``RELEASE_CLASSES`` (the auto class a release is saved with, where it is not ``AutoModelForCausalLM``), read by
:func:`ds_capture.demo.build_tiny_target` (which re-exports both) and by the tests' family matrices.
"""

# model_type -> kwargs of its transformers config class. Tiny but real architectures; the
# initializer_range is large on purpose: HF's default 0.02 leaves a tiny model's hidden
# states nearly constant across layers and its routing nearly uniform.
_COMMON = dict(
    num_hidden_layers=4,
    num_attention_heads=4,
    max_position_embeddings=4096,
    initializer_range=0.15,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    use_cache=False,
)
TINY_CONFIGS: dict[str, dict] = {
    "qwen3": dict(_COMMON, hidden_size=64, intermediate_size=128, num_key_value_heads=2, head_dim=16),
    "qwen3_moe": dict(
        _COMMON, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
    ),
    "deepseek_v3": dict(
        _COMMON, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    ),
    "mixtral": dict(
        _COMMON, hidden_size=64, intermediate_size=64, num_key_value_heads=2, head_dim=16,
        num_local_experts=8, num_experts_per_tok=2,
    ),
    # One hash-routed layer then top-k layers (as V4's 3 hash layers), CSA (with indexer) and HCA attention
    # with compression rates small enough to compress within a 32-token row, 2 hyper-connection streams, 16
    # indexer heads (as the DSA families': with 2, ReLU zero ties make a padded row's top-k differ). A freshly
    # initialised hash router's tid2eid table is all zeros (real values come from the checkpoint).
    "deepseek_v4": dict(
        _COMMON, hidden_size=64, moe_intermediate_size=32, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
        qk_rope_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, hc_mult=2,
        hc_sinkhorn_iters=3, sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=16,
        index_topk=4, mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    ),
    # GLM-5.x: first layer dense, DSA indexer attention (index_topk below the row length, so it selects; 16
    # indexer heads: with 2, ReLU zero ties make the top-k of a padded row differ from the row alone, up to 10.3
    # in the hidden states).
    "glm_moe_dsa": dict(
        _COMMON, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8,
        n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, index_topk=8, index_head_dim=16, index_n_heads=16,
    ),
    # Gemma 4 (text only: no vision / audio towers). The size fields live in text_config, so its vocab is
    # fixed here at the demo tokenizer's upper bound (train_tokenizer's vocab_size, specials included).
    "gemma4": dict(
        tie_word_embeddings=False, initializer_range=0.15,
        text_config=dict(
            vocab_size=2048, vocab_size_per_layer_input=2048, hidden_size=64, intermediate_size=128,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=16,
            hidden_size_per_layer_input=16, sliding_window=8, max_position_embeddings=4096, rms_norm_eps=1e-6,
            initializer_range=0.15, tie_word_embeddings=False, use_cache=False, pad_token_id=0, eos_token_id=2,
            bos_token_id=None,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        ),
        vision_config=None, audio_config=None,
    ),
    # Kimi-K2.5: a DeepSeek-V3 text decoder in the vision-language wrapper, with a one-block vision tower
    # (dropped at capture; kept here so the checkpoint has the release's layout).
    "kimi_k25": dict(
        tie_word_embeddings=False, projection_hidden_size=32,
        text_config=dict(
            model_type="deepseek_v3", vocab_size=2048, hidden_size=64, intermediate_size=128,
            moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096,
            initializer_range=0.15, rms_norm_eps=1e-6, tie_word_embeddings=False, use_cache=False,
            pad_token_id=0, eos_token_id=2, bos_token_id=None,
        ),
        vision_config=dict(patch_size=14, num_attention_heads=2, num_hidden_layers=1, hidden_size=32,
                           intermediate_size=64, pos_emb_height=4, pos_emb_width=4, pos_emb_time=1),
    ),
    # GLM-4.5 / 4.6 / 4.7: DeepSeek-style sigmoid router, first layer dense, partial rotary, qk norm.
    "glm4_moe": dict(
        _COMMON, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=2,
        head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
    ),
    # Qwen3.5 MoE as released: the vision-language wrapper (a one-block vision tower, dropped at capture);
    # Gated DeltaNet linear attention on 3 of 4 layers, gated full attention on the 4th.
    "qwen3_5_moe": dict(
        tie_word_embeddings=False,
        text_config=dict(
            vocab_size=2048, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=4096, initializer_range=0.15, rms_norm_eps=1e-6, tie_word_embeddings=False,
            use_cache=False, pad_token_id=0, eos_token_id=2, bos_token_id=None,
        ),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, num_position_embeddings=16),
    ),
    # Qwen3-Next: Gated DeltaNet linear attention on 3 of 4 layers, gated full attention on the 4th.
    "qwen3_next": dict(
        _COMMON, hidden_size=64, intermediate_size=128, num_key_value_heads=2, head_dim=16,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
    ),
    # DeepSeek-V3.2: DeepSeek-V3 with the DSA indexer (16 indexer heads, as for glm_moe_dsa; index_topk below the
    # row length, so it selects).
    "deepseek_v32": dict(
        _COMMON, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=8, index_head_dim=16,
        index_n_heads=16,
    ),
    # MiniMax-M2: sigmoid router with a correction bias, qk norm, partial rotary.
    "minimax_m2": dict(
        _COMMON, hidden_size=64, intermediate_size=32, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=2,
    ),
    # Kimi-Linear: KDA linear attention on 3 of 4 layers, MLA on the 4th; first layer dense.
    "kimi_linear": dict(
        _COMMON, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
        num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
        linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, first_k_dense_replace=1,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    ),
    # gpt-oss: attention sinks (eager attention only), sliding / full layers, biased experts with clamped SwiGLU.
    "gpt_oss": dict(
        _COMMON, hidden_size=64, intermediate_size=32, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    ),
    # GLM-5.3 (glm5_next): the vision-language wrapper (one-block vision tower, dropped at capture) around a
    # text decoder with KDA linear attention and NoPE DSA-indexed MLA (16 indexer heads), hyper-connection
    # streams ([B, S, hc, H] layer outputs), first layer dense.
    "glm5_next": dict(
        tie_word_embeddings=False,
        text_config=dict(
            vocab_size=2048, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=2, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=0,
            v_head_dim=16, qk_nope_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=16, index_kpool=2,
            linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, hc_mult=2, hc_sinkhorn_iters=3,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
            max_position_embeddings=4096, initializer_range=0.15, rms_norm_eps=1e-6, tie_word_embeddings=False,
            use_cache=False, pad_token_id=0, eos_token_id=2, bos_token_id=None,
        ),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, image_size=28, projection_intermediate_size=64),
    ),
    # Llama 4 as released: the vision-language wrapper (one-block vision tower, dropped at capture); MoE on
    # every layer (one routed expert per token plus a shared one), chunked attention, NoPE every 4th layer.
    "llama4": dict(
        tie_word_embeddings=False,
        text_config=dict(
            vocab_size=2048, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=1,
            attention_chunk_size=16, max_position_embeddings=4096, initializer_range=0.15, rms_norm_eps=1e-6,
            tie_word_embeddings=False, use_cache=False, pad_token_id=0, eos_token_id=2, bos_token_id=None,
        ),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                           vision_output_dim=64, image_size=28, patch_size=14, projector_input_dim=64,
                           projector_output_dim=64),
    ),
}

# Families whose release is saved by another class than the one their registry entry builds.
# The transformers auto class each release is saved with, where it is not AutoModelForCausalLM: the
# vision-language releases, and Llama 4's wrapper (its family builds the text model). The demo sits below the
# family registry, so it keeps this table itself; tests/unit/test_demo.py checks it against the registry.
RELEASE_CLASSES = {name: "AutoModelForImageTextToText" for name in ("kimi_k25", "qwen3_5_moe", "glm5_next", "llama4")}
