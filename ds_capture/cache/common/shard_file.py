"""Shard files written in place: the safetensors layout is known before the first row arrives.

In: a file's tensors as ``name -> (shape, dtype)`` (for a DSpark shard, ``Manifest.expected_shard_tensors``)
and, as micro-batches complete, rows of each tensor at their row positions. Out: a safetensors file
byte-identical to ``safetensors.torch.save_file`` of the assembled tensors, without ever assembling them:

- :class:`SafetensorsLayout` computes the header exactly as safetensors writes it (tensors ordered by
  dtype, largest first, then by name; compact JSON; padded with spaces to a multiple of 8) and each
  tensor's data offset, so row ``r`` of a tensor lives at a known file offset.
- :class:`ShardFile` creates ``<name>.tmp`` at its full length (``ftruncate``), writes the header, then
  ``os.pwrite``\\ s rows as they come. Tensors named in ``zero_tail`` (the hidden states) are written only
  up to each row's real length: the padded tail is a hole that reads back as zeros, so disk use and bytes
  written follow real tokens (where the filesystem has no holes the file is simply dense). ``finish``
  fsyncs, renames over the final name and returns the checksum, computed from the rows it was handed
  (zeros for the holes): the finished file is never read back.

Checksum (:data:`ROWS_DIGEST`): xxh3-128 over the header bytes, then the xxh3-128 digest of every row of
every tensor in file order, then the file length (8 bytes little-endian). Rows arrive in any order (shards
are batched sorted by length), so the writer keeps one 16-byte digest per row and folds them at the end;
:func:`file_digest` computes the same from a file on disk (``verify --checksums``, resume).

Reading back (:func:`read_tensors`, every reader of ours: verify, inspect, compare) uses plain reads, never a
memory map: mapped holes on a full tmpfs kill the reader with SIGBUS.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
import xxhash

from ds_capture.capture.liveness import refuse_if_frozen
from ds_capture.durable import fsync_dir

ROWS_DIGEST = "xxh3-128-rows"
"""Tag of the checksum defined in the module docstring (sidecars say which algorithm they hold)."""

# safetensors orders tensors by its Dtype enum, descending (then by name): the enum's positions.
_DTYPE_RANK = {
    torch.bool: 0, torch.uint8: 4, torch.int8: 5, torch.float8_e5m2: 6, torch.float8_e4m3fn: 7,
    torch.int16: 9, torch.uint16: 10, torch.float16: 11, torch.bfloat16: 12, torch.int32: 13,
    torch.uint32: 14, torch.float32: 15, torch.float64: 17, torch.int64: 18, torch.uint64: 19,
}
_DTYPE_NAME = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3", torch.int16: "I16", torch.uint16: "U16", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32", torch.float32: "F32",
    torch.float64: "F64", torch.int64: "I64", torch.uint64: "U64",
}
_DTYPE_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAME.items()}
_ZEROS = bytes(1 << 22)  # fed to the row digests for holes, 4 MiB at a time
_READ_CHUNK = 1 << 24


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor's data lives in the file: ``num_rows`` rows of ``row_bytes`` from ``offset``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    """Absolute file offset of the tensor's first byte."""
    num_rows: int
    row_bytes: int


@dataclass(frozen=True)
class SafetensorsLayout:
    """The header bytes and every tensor's place, for tensors described by name -> (shape, dtype)."""

    header: bytes
    """The first bytes of the file: 8-byte little-endian JSON length, JSON, space padding."""
    slots: tuple[TensorSlot, ...]
    """In file order."""
    total_bytes: int

    @classmethod
    def build(cls, tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> "SafetensorsLayout":
        order = sorted(tensors, key=lambda name: (-_DTYPE_RANK[tensors[name][1]], name))
        entries, spans, start = {}, [], 0
        for name in order:
            shape, dtype = tuple(tensors[name][0]), tensors[name][1]
            num_bytes = _numel(shape) * dtype.itemsize
            entries[name] = {"dtype": _DTYPE_NAME[dtype], "shape": list(shape),
                             "data_offsets": [start, start + num_bytes]}
            spans.append((name, shape, dtype, start, num_bytes))
            start += num_bytes
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        header = struct.pack("<Q", len(text)) + text
        slots = tuple(
            TensorSlot(name, shape, dtype, len(header) + begin, shape[0] if shape else 1,
                       num_bytes // shape[0] if shape and shape[0] else num_bytes)
            for name, shape, dtype, begin, num_bytes in spans
        )
        return cls(header=header, slots=slots, total_bytes=len(header) + start)

    def slot(self, name: str) -> TensorSlot:
        return next(slot for slot in self.slots if slot.name == name)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


class ShardFile:
    """One shard being written: ``write_rows`` as micro-batches complete, then ``finish`` (or ``abort``).

    Holds an open file descriptor and one 16-byte digest per row, never the shard's data.
    """

    def __init__(self, path: Path, layout: SafetensorsLayout, *, zero_tail: frozenset[str] = frozenset()) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.layout = layout
        self.zero_tail = zero_tail
        self.bytes_written = 0
        self._slots = {slot.name: slot for slot in layout.slots}
        self._row_digests: dict[str, list[bytes | None]] = {s.name: [None] * s.num_rows for s in layout.slots}
        refuse_if_frozen()  # a rank woken after its peers gave up starts no shard
        self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # what safetensors.save_file (and so NeMo) leaves
        try:
            os.ftruncate(self._fd, layout.total_bytes)  # the full length first: unwritten ranges stay holes
            self._pwrite(layout.header, 0)
        except BaseException:
            self.abort()
            raise

    def write_rows(self, rows: torch.Tensor, tensors: Mapping[str, torch.Tensor], num_tokens: torch.Tensor) -> None:
        """Write row ``rows[b]`` of every tensor from ``tensors[name][b]`` (contiguous CPU tensors).

        Shapes (B rows, T <= S): a ``zero_tail`` tensor is [B, T, ...] and only its first
        ``num_tokens[b]`` positions are written (the rest of the row is zeros, a hole); any other tensor
        is [B, *row shape] and written whole.
        """
        refuse_if_frozen()  # nor adds rows to one
        positions = [int(r) for r in rows]
        lengths = [int(n) for n in num_tokens]
        for name, data in tensors.items():
            slot = self._slots[name]
            assert data.device.type == "cpu" and data.is_contiguous() and data.dtype == slot.dtype, name
            raw = data.view(torch.uint8).numpy()  # bytes of every element, any dtype (bf16 included)
            per_row = raw.reshape(len(positions), -1)
            if name in self.zero_tail:
                assert data.shape[2:] == slot.shape[2:] and data.shape[1] <= slot.shape[1], (name, data.shape)
                position_bytes = slot.row_bytes // slot.shape[1]
                for b, row in enumerate(positions):
                    real = per_row[b, :lengths[b] * position_bytes]
                    self._write_row(slot, row, real, slot.row_bytes - len(real))
            else:
                assert per_row.shape[1] == slot.row_bytes, (name, per_row.shape[1], slot.row_bytes)
                for b, row in enumerate(positions):
                    self._write_row(slot, row, per_row[b], 0)

    def _write_row(self, slot: TensorSlot, row: int, real, num_zero_bytes: int) -> None:
        assert self._row_digests[slot.name][row] is None, f"{slot.name} row {row} written twice"
        digest = xxhash.xxh3_128(real)
        while num_zero_bytes > 0:
            step = min(num_zero_bytes, len(_ZEROS))
            digest.update(memoryview(_ZEROS)[:step])
            num_zero_bytes -= step
        self._row_digests[slot.name][row] = digest.digest()
        if len(real):
            self._pwrite(memoryview(real), slot.offset + row * slot.row_bytes)

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            refuse_if_frozen()  # a writer thread stopped mid-shard writes no further byte once woken
            done = os.pwrite(self._fd, view, offset)
            view, offset = view[done:], offset + done
            self.bytes_written += done

    @property
    def missing_rows(self) -> dict[str, int]:
        return {name: sum(d is None for d in digests) for name, digests in self._row_digests.items()
                if any(d is None for d in digests)}

    def finish(self) -> str:
        """fsync, rename over the final name (and flush the directory); return the tagged checksum."""
        assert not self.missing_rows, f"{self.path.name}: rows never written: {self.missing_rows}"
        try:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            refuse_if_frozen()  # a rank woken after its peers gave up renames nothing into place
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        fsync_dir(self.path.parent)
        folded = xxhash.xxh3_128(self.layout.header)
        for slot in self.layout.slots:
            for digest in self._row_digests[slot.name]:
                folded.update(digest)
        folded.update(struct.pack("<Q", self.layout.total_bytes))
        return f"{ROWS_DIGEST}:{folded.hexdigest()}"

    def abort(self) -> None:
        """Close and delete the ``.tmp``: nothing of this shard is left behind."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.tmp.unlink(missing_ok=True)


def file_digest(path: Path) -> str:
    """:data:`ROWS_DIGEST` of a safetensors file on disk, from its own header (the module's definition).

    ValueError if the file is not a readable safetensors layout (a damaged header).
    """
    with open(path, "rb") as f:
        try:
            size, head, text = _read_header_bytes(f)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
        layout = _layout_from_header(text, path)
        if layout.header != head + text:
            raise ValueError(f"{path}: header is not laid out as safetensors writes it")
        folded = xxhash.xxh3_128(layout.header)
        for slot in layout.slots:
            f.seek(slot.offset)
            for _ in range(slot.num_rows):
                digest, remaining = xxhash.xxh3_128(), slot.row_bytes
                while remaining:
                    chunk = f.read(min(remaining, _READ_CHUNK))
                    if not chunk:
                        raise ValueError(f"{path}: truncated inside {slot.name}")
                    digest.update(chunk)
                    remaining -= len(chunk)
                folded.update(digest.digest())
        folded.update(struct.pack("<Q", size))
    return f"{ROWS_DIGEST}:{folded.hexdigest()}"


def read_tensors(path: Path, names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file (all of them, or ``names``), read with plain reads, never a memory map.

    Why not ``safe_open``: it maps the file, and on tmpfs a page fault inside a hole (the shards' padding
    tails) allocates a page, so once the filesystem is full the reader dies of SIGBUS with no message; a
    ``read`` of a hole returns zeros and allocates nothing. ValueError for a file that is not a complete
    safetensors file (as safetensors checks it: the header parses, the data offsets tile the data section,
    which ends where the file ends); OSError as the read raises it.
    """
    with open(path, "rb") as f:
        size, _, text = _read_header_bytes(f)
        length = len(text)
        try:
            entries = json.loads(text)
            spans = sorted((int(e["data_offsets"][0]), int(e["data_offsets"][1]), name, _DTYPE_BY_NAME[e["dtype"]],
                            tuple(int(n) for n in e["shape"]))
                           for name, e in entries.items() if name != "__metadata__")
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
            raise ValueError(f"unreadable safetensors header ({type(error).__name__}: {error})") from None
        data_start, position = 8 + length, 0
        for begin, end, name, dtype, shape in spans:
            if begin != position or end - begin != _numel(shape) * dtype.itemsize:
                raise ValueError(f"{name}: data_offsets [{begin}, {end}] do not tile the data section")
            position = end
        if data_start + position != size:
            raise ValueError(f"the data section ends at byte {data_start + position}, the file at {size} "
                             "(truncated or extended)")
        tensors = {}
        for begin, end, name, dtype, shape in spans:
            if names is not None and name not in names:
                continue
            tensor = torch.empty(shape, dtype=dtype)
            buffer = memoryview(tensor.view(-1).view(torch.uint8).numpy()) if end > begin else memoryview(b"")
            f.seek(data_start + begin)
            while len(buffer):
                done = f.readinto(buffer)
                if not done:
                    raise ValueError(f"{name}: the file ends inside its data")
                buffer = buffer[done:]
            tensors[name] = tensor
    return tensors


def _read_header_bytes(f: BinaryIO) -> tuple[int, bytes, bytes]:
    """``(file size, the 8-byte length prefix, the JSON header)`` of an open safetensors file, read from its start;
    ValueError where the prefix is cut short or names a header longer than the file."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) != 8:
        raise ValueError(f"{len(head)} bytes, shorter than the 8-byte length prefix")
    (length,) = struct.unpack("<Q", head)
    if length > size - 8:
        raise ValueError(f"header length {length} exceeds the file size {size}")
    return size, head, f.read(length)


def _layout_from_header(text: bytes, path: Path) -> SafetensorsLayout:
    try:
        entries = json.loads(text)
        tensors = {name: (tuple(e["shape"]), _DTYPE_BY_NAME[e["dtype"]])
                   for name, e in entries.items() if name != "__metadata__"}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path}: unreadable safetensors header ({error})") from None
    return SafetensorsLayout.build(tensors)
