"""NeMo AutoModel 0.7.0 as an optional dependency: whether it is there, and its config of a checkpoint.

In:  a registry :class:`~ds_capture.target.family.Family` of a NeMo-built family, the checkpoint directory.
Out: :func:`require_nemo` (a ``CaptureError`` naming the fix when NeMo 0.7.0 is not importable),
:func:`read_nemo_config` (NeMo's config class read from ``config.json``), :func:`resolve` (``module:attr``).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from ds_capture.errors import CaptureError

INSTALL_HINT = (
    "Install the nemo extra: `pip install 'ds-capture[nemo]'` then `pip install --no-deps nemo_automodel==0.7.0` "
    "(scripts/install_nemo_extra.sh does both; NeMo pins transformers 5.18, so pip cannot resolve it as a "
    "plain requirement, and its model classes run with this project's transformers)."
)


def resolve(dotted: str) -> Any:
    """``"package.module:attribute"`` -> the attribute (imports the module)."""
    module, _, attribute = dotted.partition(":")
    return getattr(importlib.import_module(module), attribute)


def require_nemo(model_type: str, source: str) -> None:
    """A ``CaptureError`` naming the fix when NeMo AutoModel 0.7.0 is not importable."""
    try:
        import nemo_automodel
    except ImportError:
        raise CaptureError(
            f"{source}: model_type {model_type!r} is built by NeMo AutoModel 0.7.0's model class, which is not "
            f"installed. {INSTALL_HINT}"
        ) from None
    version = getattr(nemo_automodel, "__version__", "unknown")
    if not str(version).startswith("0.7.0"):
        raise CaptureError(
            f"{source}: model_type {model_type!r} needs nemo_automodel 0.7.0 (its model classes and state-dict "
            f"adapters are this project's contract); {version} is installed. {INSTALL_HINT}"
        )


def read_nemo_config(family: Any, path: Path) -> Any:
    """NeMo's config class read from ``path/config.json`` (nested text config included)."""
    require_nemo(family.model_type, str(path / "config.json"))
    config_class = resolve(family.nemo_config_class)
    raw_type = json.loads((path / "config.json").read_text()).get("model_type")
    if raw_type != config_class.model_type:  # the text config alone (Kimi K3's `kimi_linear` form)
        config_class = config_class.sub_configs["text_config"]
    try:
        config = config_class.from_pretrained(str(path), **dict(family.nemo_config_overrides))
    except (ValueError, OSError, TypeError, KeyError) as error:
        raise CaptureError(f"{path / 'config.json'}: NeMo's {config_class.__name__} cannot read this config "
                           f"({type(error).__name__}: {error}).") from error
    config._name_or_path = str(path)  # where DeepSeek-V4.1's Engram finds the release's tokenizer
    return config
