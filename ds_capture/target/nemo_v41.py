"""DeepSeek-V4.1's release checkpoint, one tensor at a time: where each release tensor goes in NeMo's model.

In:  a logical release key (``layers.3.attn.wq_a.weight``; a quantized weight and its ``.scale`` are one logical
     key, :func:`.quant.logical_keys`) and the NeMo AutoModel 0.7.0 ``DeepseekV41Config`` the model is built from.
Out: :func:`v41_placement` -> the :class:`~.nemo_release.Placement` of that tensor in
     ``DeepseekV41ForCausalLM``'s state dict, None for a tensor the model has no place for (``mtp.*``, layers >=
     ``num_hidden_layers``, the vision tower of a text-only build), a ``CaptureError`` for a key that is not
     DeepSeek-V4.1's; :func:`v41_release_info` -> the sizes a loader needs from ``config.json``.

The per-tensor form of NeMo's ``DeepseekV41StateDictAdapter.from_hf`` (which converts a whole state dict):
its ``_native_key`` renames, and its expert merge written as slices of the stacked experts
(E = n_routed_experts, D = hidden_size, I = moe_intermediate_size)::

    layers.{i}.ffn.experts.{j}.w1.weight [I, D] -> model.layers.{i}.ffn.experts.gate_and_up_projs[j][:, :I] = W1^T
    layers.{i}.ffn.experts.{j}.w3.weight [I, D] -> model.layers.{i}.ffn.experts.gate_and_up_projs[j][:, I:] = W3^T
    layers.{i}.ffn.experts.{j}.w2.weight [D, I] -> model.layers.{i}.ffn.experts.down_projs[j]               = W2^T

Dequantization is :mod:`.quant`'s (FP8 e4m3 with 32 x 32 e8m0 blocks, row-wise for the Engram tables; packed FP4
e2m1 experts with 1 x 32 e8m0 scales), bit-identical to NeMo's ``dequantize_checkpoint_weight``
(tests/unit/test_nemo_v41_release.py). No NeMo import here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from ds_capture.errors import CaptureError
from ds_capture.target.nemo_release import Placement

# Every tensor a V4.1 decoder layer has in the release (NeMo 0.7.0's DeepseekV41Block, attention, compressor,
# indexer, MoE and Engram modules), after ``layers.{i}.``.
_LAYER_TENSOR = re.compile(
    r"attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|q_norm|kv_norm)\.weight|attn\.attn_sink"
    r"|attn\.compressor\.(?:wkv|wgate|norm)\.weight|attn\.indexer\.(?:wq_b|wk|k_norm|weights_proj)\.weight"
    r"|(?:attn|ffn)_norm\.weight|hc_(?:attn|ffn)_(?:fn|base|scale)"
    r"|ffn\.gate\.(?:weight|bias|bias_vl)|ffn\.shared_experts\.w[123]\.weight"
    r"|engram\.(?:embed|wkv)\.weight|engram\.[qk]_weight"
)
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")
_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight", "norm.weight": "model.norm.weight"}
_VISION = re.compile(r"(?:vision|aligner)\..+|image_(?:start|end|newline)")
_RENAMES = {  # NeMo's _native_key, after ``layers.{i}.``; every other layer tensor keeps its name
    "attn.attn_sink": "attn.sinks_param.weight",
    "ffn.gate.bias": "ffn.gate.e_score_correction_bias",
    "ffn.shared_experts.w1.weight": "ffn.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "ffn.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "ffn.shared_experts.down_proj.weight",
}
_HYPER = re.compile(r"hc_(attn|ffn)_(fn|base|scale)")


@dataclass(frozen=True)
class V41ReleaseInfo:
    """The sizes of a DeepSeek-V4.1 release a loader needs before any model exists (``config.json``)."""

    num_hidden_layers: int
    num_routed_experts: int
    """``n_routed_experts``: E of the stacked ``[E, ...]`` expert tensors."""
    moe_intermediate_size: int
    """I: ``gate_and_up_projs`` is ``[E, D, 2 I]``, ``down_projs`` ``[E, I, D]``."""
    hidden_size: int
    """D."""


def v41_release_info(config: dict[str, Any]) -> V41ReleaseInfo:
    """In: ``config.json`` of a DeepSeek-V4.1 release (the text model nested under ``text_config``).
    Out: its :class:`V41ReleaseInfo`; a missing field is a ``CaptureError`` naming it."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CaptureError("config.json: DeepSeek-V4.1 (model_type deepseek_v41) keeps its text model under "
                           "text_config, which is missing. Use the release's own config.json.")
    fields = ("num_hidden_layers", "n_routed_experts", "moe_intermediate_size", "hidden_size")
    missing = [name for name in fields if not isinstance(text.get(name), int)]
    if missing:
        raise CaptureError(f"config.json: text_config.{missing[0]} is missing or not an integer (DeepSeek-V4.1 "
                           f"needs {', '.join(fields)}). Use the release's own config.json.")
    return V41ReleaseInfo(*(text[name] for name in fields))


def v41_placement(release_key: str, config: Any) -> Placement | None:
    """Where the logical release tensor ``release_key`` goes in NeMo's ``DeepseekV41ForCausalLM``.

    In:  ``config`` the NeMo ``DeepseekV41Config`` the model is built from (read: ``text_config.num_hidden_layers``
         / ``n_routed_experts`` / ``moe_intermediate_size``, ``vision_config.num_hidden_layers``).
    Out: the :class:`Placement`; None for ``mtp.*`` (the DSpark draft), layers >= ``num_hidden_layers`` and, in a
         text-only build (NeMo's DSpark target sets ``vision_config.num_hidden_layers = 0``), ``vision.*`` /
         ``aligner.*`` / ``image_*``: never read; a ``CaptureError`` naming the key for anything else.
    """
    text = config.text_config
    if release_key in _TOP:
        return Placement(_TOP[release_key])
    if release_key.startswith("mtp."):
        return None
    if _VISION.fullmatch(release_key):
        return Placement(f"model.{release_key}") if config.vision_config.num_hidden_layers > 0 else None
    layer = re.fullmatch(r"layers\.(\d+)\.(.+)", release_key)
    if layer is None:
        raise _unknown(release_key, text.num_hidden_layers)
    i, rest = int(layer[1]), layer[2]
    if i >= text.num_hidden_layers:
        return None
    expert = _EXPERT.fullmatch(rest)
    if expert:
        return _expert_placement(release_key, i, int(expert[1]), expert[2], text)
    if not _LAYER_TENSOR.fullmatch(rest):
        raise _unknown(release_key, text.num_hidden_layers)
    hyper = _HYPER.fullmatch(rest)
    native = f"{hyper[1]}_hc.{hyper[2]}" if hyper else _RENAMES.get(rest, rest)
    return Placement(f"model.layers.{i}.{native}")


def _expert_placement(release_key: str, layer: int, expert: int, which: str, text: Any) -> Placement:
    if expert >= text.n_routed_experts:
        raise CaptureError(
            f"{release_key}: expert {expert}, but config.json's text_config.n_routed_experts is "
            f"{text.n_routed_experts}. The checkpoint and its config.json disagree: use the release's own config.json."
        )
    experts, size = f"model.layers.{layer}.ffn.experts", text.moe_intermediate_size
    if which == "w2":
        return Placement(f"{experts}.down_projs", expert=expert, transpose=True)
    columns = slice(0, size) if which == "w1" else slice(size, 2 * size)
    return Placement(f"{experts}.gate_and_up_projs", expert=expert, index=(slice(None), columns), transpose=True)


def _unknown(release_key: str, num_hidden_layers: int) -> CaptureError:
    return CaptureError(
        f"{release_key}: not a tensor of DeepSeek-V4.1's release (neither a tensor of NeMo AutoModel 0.7.0's "
        f"DeepseekV41ForCausalLM nor mtp.*, vision.* / aligner.* / image_*, or a layer >= num_hidden_layers "
        f"{num_hidden_layers}). The checkpoint is not DeepSeek-V4.1's release layout: check config.json's "
        "model_type and the checkpoint's model.safetensors.index.json."
    )


def v41_placer(config: Any, raw_config: dict, native_keys) -> Callable[[str], Placement | None]:
    """The family's ``release_placement``: release key -> :class:`Placement` for the model built from ``config``."""
    return lambda key: v41_placement(key, config)


def planning_tokenizer(config: Any) -> Any:
    """A stand-in for the release's tokenizer when only ``config.json`` is there (``ds-capture plan`` on a typed-in
    release config): Engram builds its hash tables from a tokenizer whose normalised vocabulary must have
    ``engram_compressed_vocab_size`` entries. Word-level, ``vocab_size`` tokens: that many distinct lowercase
    words, then capitalised copies that normalise onto them. Sizes only; a capture always uses the release's own."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    text = config.text_config
    distinct = int(text.engram_compressed_vocab_size)
    vocab = {f"w{i}": i for i in range(distinct)}
    vocab.update({f"W{i}": distinct + i for i in range(max(0, int(text.vocab_size) - distinct))})
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")))
