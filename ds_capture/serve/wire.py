"""NeMo AutoModel 0.7.0's binary tensor format (``speculative/eagle/remote/wire.py``), read strictly.

In: an HTTP body from a client we do not trust. Out: ``{name: tensor or None}`` on the CPU, or a
:class:`WireError` naming what is wrong (bad magic, a truncated entry, an unknown dtype code, a byte count that
does not match the shape). ``encode`` writes the same format back (little-endian, self-delimiting)::

    [4B magic 0x4E4D4554 "NMET"] then per entry: [4B key_len][key UTF-8][1B flags: bit0 = None]
    and unless None: [1B dtype code][1B ndim][ndim x 8B int64 shape][8B uint64 nbytes][nbytes raw bytes]
"""

from __future__ import annotations

import struct

import torch

MAGIC = 0x4E4D4554
DTYPE_CODES: dict[int, torch.dtype] = {
    0: torch.float32, 1: torch.float64, 2: torch.float16, 3: torch.bfloat16, 4: torch.int64,
    5: torch.int32, 6: torch.int16, 7: torch.int8, 8: torch.uint8, 9: torch.bool,
}
CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}
_MAX_NDIM = 8


class WireError(ValueError):
    """The body is not a well-formed wire blob (the message says where and why)."""


def encode(tensors: dict[str, torch.Tensor | None]) -> bytes:
    """NeMo's ``wire.encode_to_bytes``: CPU tensors (made contiguous) and ``None`` values, in dict order."""
    return bytes(encode_view(tensors))


def encode_view(tensors: dict[str, torch.Tensor | None]) -> memoryview:
    """:func:`encode` assembled in one buffer, each tensor's bytes copied once, as a ``memoryview``."""
    size, pieces = encode_pieces(tensors)
    buffer = bytearray(size)
    pos = 0
    for piece in pieces:
        buffer[pos:pos + len(piece)] = piece
        pos += len(piece)
    return memoryview(buffer)


def encode_pieces(tensors: dict[str, torch.Tensor | None]) -> tuple[int, list[bytes | memoryview]]:
    """:func:`encode` as its total size and the pieces that make it, in order, none copied: the magic and each
    entry's head as ``bytes``, each tensor's data as a view of the (CPU, contiguous) tensor's own memory. An HTTP
    answer writes them as they are (``generate``'s answers are tens of MB: measured, a 35 MB answer streamed from
    its tensors took 72-92 ms against 179-200 ms assembled first, httpx client included)."""
    pieces: list[bytes | memoryview] = [struct.pack("<I", MAGIC)]
    size = 4
    for key, tensor in tensors.items():
        name = key.encode("utf-8")
        if tensor is None:
            pieces.append(struct.pack("<I", len(name)) + name + struct.pack("<B", 1))
            size += len(pieces[-1])
            continue
        tensor = tensor.detach().cpu().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        pieces.append(struct.pack("<I", len(name)) + name + struct.pack("<BBB", 0, CODE_OF[tensor.dtype], tensor.ndim)
                      + struct.pack(f"<{tensor.ndim}q", *tensor.shape) + struct.pack("<Q", nbytes))
        size += len(pieces[-1]) + nbytes
        if nbytes:
            pieces.append(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return size, pieces


def decode(raw: bytes) -> dict[str, torch.Tensor | None]:
    """The tensors of ``raw``; every length is checked against what is left of the body before it is read."""
    view = memoryview(raw)
    pos = 0

    def take(size: int, what: str) -> memoryview:
        nonlocal pos
        if size > len(view) - pos:
            raise WireError(f"truncated body: {what} needs {size} bytes at offset {pos}, {len(view) - pos} left")
        chunk = view[pos:pos + size]
        pos += size
        return chunk

    if len(view) < 4 or struct.unpack_from("<I", view, 0)[0] != MAGIC:
        raise WireError("not a NeMo wire blob (the body does not start with the magic 0x4E4D4554)")
    pos = 4
    result: dict[str, torch.Tensor | None] = {}
    while pos < len(view):
        (key_len,) = struct.unpack("<I", take(4, "a key length"))
        try:
            key = bytes(take(key_len, "a key")).decode("utf-8")
        except UnicodeDecodeError as error:
            raise WireError(f"a key at offset {pos - key_len} is not UTF-8") from error
        (flags,) = struct.unpack("<B", take(1, f"the flags of {key!r}"))
        if flags & 1:
            result[key] = None
            continue
        code, ndim = struct.unpack("<BB", take(2, f"the dtype and ndim of {key!r}"))
        if code not in DTYPE_CODES:
            raise WireError(f"{key!r}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        if ndim > _MAX_NDIM:
            raise WireError(f"{key!r}: {ndim} dimensions (at most {_MAX_NDIM})")
        shape = struct.unpack(f"<{ndim}q", take(8 * ndim, f"the shape of {key!r}"))
        if any(dim < 0 for dim in shape):
            raise WireError(f"{key!r}: negative dimension in shape {list(shape)}")
        (nbytes,) = struct.unpack("<Q", take(8, f"the byte count of {key!r}"))
        dtype = DTYPE_CODES[code]
        numel = 1
        for dim in shape:
            numel *= dim
        expected = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes != expected:
            raise WireError(f"{key!r}: {nbytes} bytes for shape {list(shape)} {dtype} (needs {expected})")
        data = bytearray(take(nbytes, f"the data of {key!r}"))
        tensor = torch.frombuffer(data, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        result[key] = tensor.view(dtype).reshape(shape)
    return result
