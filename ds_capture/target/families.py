"""A target's family and what the run knows about it before any weight loads.

In: a target's ``config.json`` (its ``model_type``). Out: :func:`get_family` -> its registry entry
(:mod:`.family_registry`'s ``FAMILIES``; a :class:`~.family.Family` says where the decoder layers, final norm,
embeddings, lm_head and routed-expert blocks live and which parallel layouts the family supports);
:func:`read_target_info` -> a :class:`TargetInfo` (sizes, experts, tied embeddings) read from ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from ds_capture.errors import CaptureError, parse_json
from ds_capture.target.family import Family
from ds_capture.target.family_registry import FAMILIES


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
