"""How a raw recipe mapping becomes typed values: one section built into its dataclass, every value type-checked,
unknown keys refused (NeMo's own backend keys warned about and ignored), ``--set`` overrides, the DeepSpeed JSON.

In: the YAML's mapping (or one section of it), the dataclass a section becomes, the recipe's path for messages.
Out: frozen section objects or a ``CaptureError`` naming the file, the YAML path of the bad value and the fix.
:mod:`ds_capture.recipe.config` declares the sections and calls these; nothing here knows a key's meaning.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml

from ds_capture.errors import CaptureError, parse_json

_LOG = logging.getLogger("ds_capture")

# Keys NeMo's own recipes use for backends this project does not have: accepted with one
# warning each, so a NeMo YAML runs unchanged. Anything else unknown is an error.
NEMO_BACKEND_KEYS = {
    "distributed": {
        "dp_size", "dp_replicate_size", "sequence_parallel", "activation_checkpointing", "moe", "pipeline",
        "mesh_dims", "multimodal", "vision", "frame_sharding", "defer_fsdp_grad_sync", "_target_",
    },
    "recipe_args": {
        "target_attn_backend", "target_dispatcher", "target_experts", "target_enable_fsdp_optimizations",
        "target_force_hf",
    },
    "": {"backend", "model", "step_scheduler", "rng", "checkpoint", "wandb", "optimizer", "lr_scheduler"},
}

def build_section(cls: type, values: Mapping[str, Any], section: str, source: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    warn_or_refuse_unknown(values, section, set(fields), source)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in values.items():
        if name in fields:
            kwargs[name] = check_type(value, hints[name], f"{section}.{name}", source)
    missing = [
        name for name, f in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise CaptureError(
            f"{source}: required key{'s' if len(missing) > 1 else ''} "
            + ", ".join(f"`{section}.{name}`" for name in missing)
            + f" missing. Add {'them' if len(missing) > 1 else 'it'} under `{section}:`."
        )
    try:
        return cls(**kwargs)
    except ValueError as error:
        raise as_capture_error(error, section, source) from None


def as_capture_error(error: ValueError, section: str, source: str) -> CaptureError:
    message, key = error.args if len(error.args) == 2 else (str(error), "?")
    path = f"{section}.{key}" if section else key
    return CaptureError(f"{source}: `{path}` {message.rstrip('.')}.")


def warn_or_refuse_unknown(values: Mapping[str, Any], section: str, valid: set[str], source: str) -> None:
    for key in values:
        if key in valid:
            continue
        where = f"{section}.{key}" if section else key
        if key in NEMO_BACKEND_KEYS.get(section, ()):
            _LOG.warning("%s: `%s` is a NeMo backend setting; it does not apply to ds_capture and is ignored.",
                         source, where)
            continue
        raise CaptureError(
            f"{source}: unknown key `{where}`. Valid keys{' under `' + section + '`' if section else ''}: "
            + ", ".join(sorted(valid)) + ". Fix the spelling or remove the key."
        )


def check_type(value: Any, hint: Any, where: str, source: str) -> Any:
    """Return ``value`` converted to ``hint`` (lists -> tuples) or raise a CaptureError naming ``where``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return check_type(value, option, where, source)
            except CaptureError as error:
                errors.append(error)
        raise errors[0]
    if origin is tuple:
        (item_hint, _ellipsis) = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise CaptureError(f"{source}: `{where}` must be a list, got {value!r}.")
        return tuple(check_type(item, item_hint, f"{where}[{i}]", source) for i, item in enumerate(value))
    if origin is not None and issubclass(origin, Mapping):
        if not isinstance(value, Mapping):
            raise CaptureError(f"{source}: `{where}` must be a mapping, got {value!r}.")
        return value
    # bool is a subclass of int in Python; a YAML `true` is not a size.
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise CaptureError(f"{source}: `{where}` must be an integer, got {value!r}.")
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CaptureError(f"{source}: `{where}` must be a number, got {value!r}.")
        return float(value)
    if hint is bool and not isinstance(value, bool):
        raise CaptureError(f"{source}: `{where}` must be true or false, got {value!r}.")
    if hint is str and not isinstance(value, str):
        raise CaptureError(f"{source}: `{where}` must be a string, got {value!r}.")
    return value


def load_deepspeed_config(value: Any, base_dir: Path, source: str) -> tuple[Mapping[str, Any] | None, str]:
    if value is None:
        return None, "<none>"
    if isinstance(value, dict):
        return types.MappingProxyType(dict(value)), f"{source} (inline deepspeed_config)"
    if not isinstance(value, str):
        raise CaptureError(f"{source}: `deepspeed_config` must be a path or a mapping, got {value!r}.")
    ds_path = (base_dir / value) if not Path(value).is_absolute() else Path(value)
    if not ds_path.is_file():
        raise CaptureError(
            f"{source}: `deepspeed_config` {value!r} does not exist (looked for {ds_path}; paths are relative to "
            "the YAML file). Point it into ds_configs/, e.g. ../ds_configs/tp2.json."
        )
    loaded = parse_json(ds_path.read_text(), str(ds_path), "Fix the file (a DeepSpeed config is one JSON object).")
    if not isinstance(loaded, dict):
        raise CaptureError(f"{ds_path}: a DeepSpeed config must be a JSON object.")
    return types.MappingProxyType(loaded), str(ds_path)


def apply_override(raw: dict, override: str, path: Path) -> None:
    """Apply ``dotted.key=value`` (value parsed as YAML) to the raw mapping; types are checked later."""
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise CaptureError(f"--set {override!r}: expected dotted.key=value, e.g. --set recipe_args.seq_length=512.")
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise CaptureError(f"--set {override!r}: `{part}` in {path} is not a section.")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(text) if text else None
    except yaml.YAMLError as error:
        raise CaptureError(f"--set {override!r}: the value is not valid YAML ({error}).") from error
