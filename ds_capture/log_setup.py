"""What a command prints on stderr: ds_capture's own lines, and other libraries' only when a user asks for them.

In: whether this is rank 0, ``--verbose``, ``DS_CAPTURE_LOG_LEVEL``. Out: the logging and warnings set-up of
one process (each rank sets up its own; the CLI calls :func:`configure_logging` first thing).

- ds_capture's loggers (``ds_capture`` and ``ds_capture.*``) print ``[ds_capture] LEVEL message``: INFO and
  up on rank 0, WARNING and up elsewhere. Warnings about the user's own input (an ignored NeMo key, a damaged
  cache a rerun repairs) are ours, so they always show.
- Every other library's log lines (``logging``, torch's own handler, transformers' own handler) and Python
  warnings raised outside ds_capture are shown from ``DS_CAPTURE_LOG_LEVEL`` up, ERROR by default. What this
  hides by default is import noise: with the ``nemo`` extra installed, transformers' quantizer module imports
  torchao, which logs "Failed to load ..._C_mxfp8...so" and "Detected no triton", and torch's pytree logs two
  ``W`` lines about Enum constants, on every run. ``--verbose`` (or ``DS_CAPTURE_LOG_LEVEL=WARNING``, ``INFO``,
  ``DEBUG``) brings them back; ``DS_CAPTURE_LOG_LEVEL`` also sets ``TRANSFORMERS_VERBOSITY`` for the process.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

LEVEL_ENV = "DS_CAPTURE_LOG_LEVEL"
_DEFAULT_OTHERS_LEVEL = "ERROR"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Libraries whose loggers carry a level of their own (set on import), so the root's level does not reach them.
_OWN_LEVEL_LIBRARIES = ("torch", "transformers", "DeepSpeed", "torchao")


def others_level(verbose: bool) -> int:
    """The level from which other libraries' lines show: ``--verbose`` is WARNING; else ``DS_CAPTURE_LOG_LEVEL``."""
    if verbose:
        return logging.WARNING
    name = (os.environ.get(LEVEL_ENV) or _DEFAULT_OTHERS_LEVEL).strip().upper()
    if name not in _LEVELS:
        print(f"[ds_capture] WARNING {LEVEL_ENV}={os.environ[LEVEL_ENV]!r} is not one of {', '.join(_LEVELS)}; "
              f"using {_DEFAULT_OTHERS_LEVEL}", file=sys.stderr)
        name = _DEFAULT_OTHERS_LEVEL
    return getattr(logging, name)


def configure_logging(*, rank0: bool, verbose: bool = False) -> None:
    """Set up this process's logging and warnings as the module docstring says (call it after ``import torch``:
    torch resets its loggers' levels when it is imported). Where the root logger has handlers already (a test
    harness), they are kept: only levels and filters change."""
    level = others_level(verbose)
    if not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Formatter())
        logging.getLogger().addHandler(handler)
    # A logger's own level decides; its ancestors' levels do not filter what it passes up to their handlers.
    logging.getLogger().setLevel(level)
    logging.getLogger("ds_capture").setLevel(logging.INFO if rank0 else logging.WARNING)
    for name in _OWN_LEVEL_LIBRARIES:
        logging.getLogger(name).setLevel(level)
    # transformers sets its library logger's level when it first configures it (on import): tell it too.
    os.environ["TRANSFORMERS_VERBOSITY"] = logging.getLevelName(level).lower()
    if level > logging.WARNING:
        warnings.filterwarnings("ignore")
        warnings.filterwarnings("default", module=r"ds_capture(\.|$)")


class _Formatter(logging.Formatter):
    """``[ds_capture] LEVEL message`` for ours (any ``ds_capture.*`` logger), ``[name] LEVEL message`` for others."""

    def format(self, record: logging.LogRecord) -> str:
        ours = record.name == "ds_capture" or record.name.startswith("ds_capture.")
        return f"[{'ds_capture' if ours else record.name}] {record.levelname} {record.getMessage()}" + (
            "\n" + self.formatException(record.exc_info) if record.exc_info else "")
