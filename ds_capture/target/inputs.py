"""Damaged or missing target inputs -> one-paragraph ``CaptureError`` before anything is written.

In:  a resolved :class:`~ds_capture.target.families.TargetInfo` (its directory), the tokenized rows of a rank.
Out: ``check_checkpoint_files`` (every safetensors file's header is readable, its data is all there and its
     tensors are plain floating point), ``load_tokenizer`` (the target's tokenizer, refused when its files are
     missing or it knows no tokens), ``check_token_ids`` (no token id beyond the model's vocabulary) and
     ``require_tokens`` (a run whose rows hold no tokens at all is refused).

Each check reads headers and sizes only (no tensor data), so it runs on every rank inside the runner's error
agreement and every rank reports the same message.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from ds_capture.data.tokenization import pad_token_id
from ds_capture.errors import CaptureError
from ds_capture.target.families import TargetInfo

# Storage types of a checkpoint ds_capture can load (it computes in capture.compute_dtype).
_FLOAT_DTYPES = {"BF16", "F16", "F32", "F64"}
# Non-float storage the loaders copy as is (integer buffers such as position ids, boolean masks).
_OTHER_OK = {"I64", "I32", "BOOL"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tiktoken.model")


def tokenizer_files(target_dir: Path) -> list[str]:
    """The tokenizer files (``_TOKENIZER_FILES``) that ``target_dir`` holds."""
    return [name for name in _TOKENIZER_FILES if (Path(target_dir) / name).is_file()]


def checkpoint_files(target_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint (the index's files, or model.safetensors)."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise CaptureError(
                f"{index}: not a safetensors index ({type(error).__name__}: {error}); it must be JSON with a "
                "`weight_map` of tensor name -> file. Re-save the target with save_pretrained."
            ) from None
        files = sorted({target_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CaptureError(
                f"{index} names {len(missing)} file(s) that do not exist ({', '.join(missing[:3])}). The "
                "checkpoint is incomplete; finish the download or copy of the target."
            )
        return files
    single = target_dir / "model.safetensors"
    if not single.is_file():
        raise CaptureError(
            f"recipe_args.target_model_name_or_path: {target_dir} has no model.safetensors(.index.json). "
            "Save the target with save_pretrained(safe_serialization=True)."
        )
    return [single]


def check_checkpoint_files(target: TargetInfo) -> None:
    """Every safetensors file is complete (header parses, data reaches the size it declares) and stores
    floating-point tensors, or quantized weights with their scales (:mod:`ds_capture.target.quant` decides per
    tensor from its dtype and scale sibling). An 8-bit / 4-bit tensor with no scale sibling is refused."""
    from ds_capture.target import quant

    index: dict[str, Path] = {}
    headers: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in checkpoint_files(target.path):
        header, data_start = _read_header(path)
        size = path.stat().st_size
        end = max((int(meta["data_offsets"][1]) for name, meta in header.items() if name != "__metadata__"),
                  default=0)
        if data_start + end > size:
            raise CaptureError(
                f"{path}: the file is truncated ({size:,} bytes; its header describes {data_start + end:,}). "
                "The download or copy did not finish; fetch the file again."
            )
        for name, meta in header.items():
            if name != "__metadata__":
                index[name], headers[name] = path, (meta.get("dtype"), tuple(meta.get("shape", ())))
    logical, parts = quant.logical_keys(index, headers)
    for name, path in index.items():
        dtype = headers[name][0]
        if dtype in _FLOAT_DTYPES or dtype in _OTHER_OK or name in parts or quant.has_scale(index, headers, name):
            continue
        raise CaptureError(
            f"{path}: tensor {name!r} is stored as {dtype}, which is not a bf16 / fp16 / fp32 weight "
            "(8-bit and 4-bit storage means a quantized checkpoint). Convert the checkpoint to bf16 first "
            "and point recipe_args.target_model_name_or_path at the converted directory."
        )


def _read_header(path: Path) -> tuple[dict, int]:
    """(safetensors header, offset of the data section)."""
    with path.open("rb") as handle:
        head = handle.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        size = path.stat().st_size
        text = handle.read(length) if length is not None and 8 + length <= size else None
    try:
        if text is None:
            raise ValueError("the header is cut short")
        header = json.loads(text)
        if not isinstance(header, dict) or not all(
            isinstance(meta, dict) and len(meta.get("data_offsets", ())) == 2
            for name, meta in header.items() if name != "__metadata__"
        ):
            raise ValueError("the header is not a tensor table")
    except (ValueError, UnicodeDecodeError) as error:
        raise CaptureError(
            f"{path}: not a readable safetensors file ({error}; {size:,} bytes). The file is damaged or was not "
            "fully written; fetch it again or re-save the target with save_pretrained."
        ) from None
    return header, 8 + length


def load_tokenizer(target: TargetInfo, *, trust_remote_code: bool):
    """The target's tokenizer; refused when the directory holds no tokenizer files or the loaded tokenizer
    has no vocabulary (transformers then builds an empty one that renders every row to nothing)."""
    from transformers import AutoTokenizer

    present = tokenizer_files(target.path)
    present += [p.name for p in target.path.glob("*.tiktoken")]
    advice = ("Copy the tokenizer files of the released model (tokenizer.json, tokenizer_config.json, "
              "special_tokens_map.json) into the target directory.")
    if not present:
        raise CaptureError(f"{target.path}: no tokenizer files (looked for {', '.join(_TOKENIZER_FILES)}). {advice}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target.path), trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - tokenizers / sentencepiece raise many types on damaged files
        reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        raise CaptureError(
            f"{target.path}: the tokenizer cannot be loaded from {', '.join(present)} ({type(error).__name__}: "
            f"{reason}). The files are damaged or incomplete. {advice}"
        ) from None
    if len(tokenizer) == 0:
        raise CaptureError(f"{target.path}: the tokenizer loaded from {', '.join(present)} has no tokens. {advice}")
    pad_token_id(tokenizer, where=f"{target.path}: the tokenizer")  # refused here, before any row is read
    return tokenizer


def check_token_ids(input_ids: torch.Tensor, num_tokens: torch.Tensor, wheres: list[str], vocab_size: int,
                    target_dir: Path) -> None:
    """No content token id reaches the model's vocabulary size (the embedding would index out of range)."""
    if not len(input_ids):
        return
    content = torch.arange(input_ids.shape[1])[None, :] < num_tokens[:, None]
    beyond = (input_ids >= vocab_size) & content
    if bool(beyond.any()):
        row = int(beyond.any(dim=1).nonzero()[0])
        token = int(input_ids[row][beyond[row]][0])
        raise CaptureError(
            f"{wheres[row]}: renders token id {token}, but the target's embedding has {vocab_size} rows "
            f"(vocab_size in {target_dir / 'config.json'}). The tokenizer does not belong to this model: use the "
            "model's own tokenizer files."
        )


def require_tokens(max_tokens: int, data_path: str) -> None:
    """Refuse a run whose rows all render to zero tokens (it would publish a cache of empty rows)."""
    if max_tokens == 0:
        raise CaptureError(
            f"{data_path}: every selected row renders to 0 tokens with this tokenizer and chat template, so the "
            "cache would hold no data. Check the chat template (recipe_args.chat_template) and the tokenizer files."
        )
