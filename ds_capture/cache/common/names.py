"""The names both cache kinds share: the manifest file, shard files (``shard-NNNNNN.safetensors``) and their
checksum sidecars under the bookkeeping directory, the cache dtypes, and the shard count. Pure names, no I/O.
"""

from __future__ import annotations

import math
import re

import torch

from ds_capture.capture.safety import BOOKKEEPING_DIR  # noqa: F401 - a name of the cache directory too

MANIFEST_NAME = "manifest.json"
RUN_COMMAND_NAME = "run_command.json"
"""Under ``.ds_capture/``: the ``ds-capture run`` command line that last wrote the cache (verify's repairs)."""
NUMERICS_NAME = "numerics.json"
"""Under ``.ds_capture/``: what decides the bits of the cache beyond its identity: compute dtype, device, engine and
the CPU threads per rank (``capture.cpu_threads``) its shards were computed with."""
SKIPPED_ROWS_NAME = "skipped_rows.json"
"""Under ``.ds_capture/``: the rows ``capture.invalid_rows: skip`` left out, each with the refusal's reason."""


SHARD_RE = re.compile(r"^shard-(\d{6})\.safetensors$")


CHECKSUMS_DIR = "checksums"


DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def shard_name(index: int) -> str:
    """``shard-000007.safetensors`` for index 7."""
    return f"shard-{index:06d}.safetensors"


def checksum_name(index: int) -> str:
    """Name of the checksum sidecar of shard ``index`` under ``.ds_capture/checksums/``."""
    return f"shard-{index:06d}.checksum"


def legacy_checksum_name(index: int) -> str:
    """The sidecar earlier versions wrote: the shard's plain sha256, in sha256sum's format."""
    return f"shard-{index:06d}.sha256"


def num_shards(num_samples: int, shard_size: int) -> int:
    """ceil(num_samples / shard_size): the last shard may be shorter."""
    return math.ceil(num_samples / shard_size)
