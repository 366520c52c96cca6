"""One model family: the :class:`Family` record that says where a Hugging Face causal LM keeps what the capture needs.

In: nothing (a frozen dataclass; the entries are :mod:`.family_registry`'s). Out: a :class:`Family` answers where
the decoder layers, final norm, embeddings, lm_head and routed-expert blocks live, which sub-config is the text
config, which parallel layouts and attention implementations the family supports and why not the others, and how
its config and model class are built; :func:`get_submodule` follows one of its dotted paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ds_capture.errors import CaptureError


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def mean_over_hyper_connections(hidden: torch.Tensor) -> torch.Tensor:
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
    attention_bias: Callable[[Any, int, int, int | None, int], int] | None = None
    """``(text config, B, S, chunk tokens or None, compute bytes) -> bytes`` of a dense attention bias the attention
    builds for a [B, S] batch (or one chunk of it), alive with its scores (plan)."""
    chunk_attention_keys: Callable[[Any, int, int], int] | None = None
    """Under chunked prefill, the keys each of a chunk's queries attends to, from the text config, the chunk and S,
    where fewer than the whole row's (DeepSeek-V4's sliding window tail + compressed keys; ds-capture plan)."""
    chunk_expansion: Callable[[Any, int, int, int], int] | None = None
    """Under chunked prefill, bytes per row one attention layer builds from its carried state at S for a chunk, from
    the text config, S, the compute dtype's bytes and the TP degree (GLM-5's latent attention; ds-capture plan)."""
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
    chunk_multiple: int = 1
    """``capture.chunked_prefill``: a chunk must hold a multiple of this many tokens. Gated DeltaNet / KDA layers
    compute in blocks of 64 tokens, and a chunk that splits a block sums the recurrence in another order (Qwen3-Next
    at chunk 300 of 2,048: 2.3e-4 of the row maximum off the whole row; at 320: 6.5e-6)."""
    chunk_multiple_reason: str = (
        "its linear-attention layers compute in blocks of {multiple}, and a chunk that splits a block changes the "
        "captured states")
    """Why ``chunk_multiple`` (shown when a chunk is refused; ``{multiple}`` is filled in)."""
    chunk_refusal: str = ""
    """Non-empty: the family's forward carries no state from one chunk to the next yet, so ``chunked_prefill`` with
    a chunk shorter than the row is refused (the reason); ``auto`` forwards whole rows."""
    chunk_carriers: Mapping[str, str] = field(default_factory=dict)
    """A NeMo-built family's chunked prefill (its classes take no cache): class name of a layer-kind module in
    NeMo's model -> ``module:Class`` of the carrier whose ``forward`` replaces that module's for one row's chunks
    and carries its state (:mod:`ds_capture.target.nemo_kda_mla_chunks`; installed by
    :func:`ds_capture.capture.chunked.carried_state`). Empty: transformers' cache layers carry the state."""
    chunk_query_blocks: Mapping[str, str] = field(default_factory=dict)
    """Chunked prefill of a transformers-built family: class name of a module whose activations per chunk grow
    with the row (a sparse-attention indexer's scores against the prefix) -> ``module:Class`` whose ``forward``
    runs that module's own forward over blocks of the chunk's queries, so they grow with the block
    (:mod:`ds_capture.target.query_blocks`; installed for one row's chunks like ``chunk_carriers``)."""

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


def get_submodule(root: torch.nn.Module, dotted: str) -> torch.nn.Module:
    """``root.get_submodule`` with an error that names the family path (a registry bug, not a user error)."""
    try:
        return root.get_submodule(dotted)
    except AttributeError as error:
        raise AttributeError(f"family path {dotted!r} not found on {type(root).__name__}") from error
