"""Progress beside the output, crash-safe: one fsync'd record per finished row, then the output assembled atomically.

In:  OUT's path, the run's identity (a fingerprint of the selected input rows and the generation settings) and,
     as rows finish in any order, their output rows or refusals.
Out, beside OUT:

- ``OUT.partial`` while the run is unfinished: a header line (the identity), then one JSON line per finished row
  ``{"index": i, "row": {...}, "turns", "cut", "kept_tool_turns", "tokens"}`` or ``{"index": i, "refused":
  {...}}``, in the order rows finished, each appended with one write and fsync'd. A run holds its flock.
- when every row has its record: ``OUT.refused.jsonl`` (one line per refused row: ``index``, ``where``,
  ``message``, ``status``, ``reason``; absent when none), ``OUT.regenerate.json`` (the identity and counts of
  the complete OUT), then OUT itself (rows in input order, refused rows left out) renamed into place, and
  ``OUT.partial`` deleted.

Killed at any moment (SIGKILL included), at most the last record is torn; the next run cuts it off and redoes
that row. A row is recorded once and the output is written from the records in input order, so OUT never has
a duplicate, a gap or a torn line, and appears under its name only complete. A changed identity over an
unfinished or complete OUT is refused, naming the fields that differ.
"""

from __future__ import annotations

import fcntl
import json
import os
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ds_capture.durable import fsync_dir, write_atomic
from ds_capture.errors import CaptureError

JOURNAL_FORMAT = 1


def dumps_line(value: Any) -> bytes:
    """One JSONL line: ASCII only, so no U+2028 / U+0085 ever splits it for NeMo (which splits lines as
    ``str.splitlines`` does) and no lone surrogate fails to encode."""
    return json.dumps(value, ensure_ascii=True).encode() + b"\n"


@dataclass
class Counts:
    """What the records of one run add up to."""

    rows: int = 0
    """Rows written to OUT."""
    refused: int = 0
    """Rows a server refused (listed in ``OUT.refused.jsonl``, left out of OUT)."""
    turns: int = 0
    """Assistant turns rewritten."""
    cut: int = 0
    """Replies cut at ``--max-tokens`` (``finish_reason: length``), kept."""
    kept_tool_turns: int = 0
    """Assistant turns with tool calls, kept as in the data."""
    tokens: int = 0
    """Generated tokens, as the server counted them (``usage.completion_tokens``)."""

    def add(self, record: dict[str, Any]) -> None:
        if "refused" in record:
            self.refused += 1
            return
        self.rows += 1
        for key in ("turns", "cut", "kept_tool_turns", "tokens"):
            setattr(self, key, getattr(self, key) + record[key])


@dataclass(frozen=True)
class OutputPaths:
    """OUT and the files that live beside it."""

    out: Path

    def beside(self, suffix: str) -> Path:
        """``OUT<suffix>``, in OUT's directory."""
        return self.out.with_name(self.out.name + suffix)

    partial = property(lambda self: self.beside(".partial"))
    """The journal: one fsync'd record per finished row."""
    assembling = property(lambda self: self.beside(".tmp"))
    """OUT while it is assembled, renamed into place."""
    refused = property(lambda self: self.beside(".refused.jsonl"))
    """The rows a server refused."""
    record = property(lambda self: self.beside(".regenerate.json"))
    """The run's identity and counts."""


def read_complete(paths: OutputPaths, identity: dict[str, Any]) -> Counts | None:
    """The counts of a complete OUT written with this identity; None when OUT does not exist yet; refuses an
    OUT written otherwise (or not by regenerate at all)."""
    if not paths.out.exists():
        return None
    try:
        record = json.loads(paths.record.read_text())
        done, counts = record["identity"], Counts(**record["counts"])
    except (OSError, ValueError, KeyError, TypeError):
        raise CaptureError(
            f"{paths.out} exists but has no readable {paths.record.name} beside it, so it was not written by "
            f"ds-capture regenerate (or that file was removed). Choose another --output, or delete {paths.out} "
            "to regenerate it.") from None
    if done != identity:
        raise CaptureError(
            f"{paths.out} was regenerated from other input or settings ({_differences(done, identity)}). Choose "
            f"another --output, or delete {paths.out} to regenerate it with these.")
    return counts


class Journal:
    """``OUT.partial`` held by this run: its records read (a torn tail cut off), new ones appended."""

    def __init__(self, paths: OutputPaths, identity: dict[str, Any], num_rows: int,
                 details: dict[str, Any]) -> None:
        self.paths = paths
        self.num_rows = num_rows
        self.counts = Counts()
        self.num_done = 0
        self._offsets = array("q", [-1]) * num_rows  # row index -> byte offset of its record
        paths.out.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(paths.partial, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise CaptureError(
                f"{paths.partial} is held by another ds-capture regenerate writing {paths.out}; wait for it to "
                "finish or stop it first (two runs on one output would record rows twice).") from None
        try:
            self._read(identity, details)
        except BaseException:
            self.close()
            raise

    def _read(self, identity: dict[str, Any], details: dict[str, Any]) -> None:
        with open(self.paths.partial, "rb") as handle:
            header = handle.readline()
            if not header.endswith(b"\n"):  # a new journal, or one killed while its header was written
                os.ftruncate(self._fd, 0)
                self._append({"ds_capture_regenerate": JOURNAL_FORMAT, "identity": identity, **details})
                fsync_dir(self.paths.partial.parent)
                return
            started = self._parse(header, 1).get("identity")
            if started != identity:
                raise CaptureError(
                    f"{self.paths.partial} holds an unfinished regenerate of other input or settings "
                    f"({_differences(started, identity)}). Rerun with the input and settings it was started with "
                    f"to finish it, or delete {self.paths.partial} to start over with these.")
            offset, number = len(header), 1
            for line in iter(handle.readline, b""):
                number += 1
                if not line.endswith(b"\n"):  # torn by a kill mid-write: that row is redone
                    os.ftruncate(self._fd, offset)
                    break
                record = self._parse(line, number)
                index = record.get("index")
                if not isinstance(index, int) or not 0 <= index < self.num_rows:
                    raise CaptureError(f"{self.paths.partial} line {number}: row index {index!r} is outside the "
                                       f"input's {self.num_rows} rows; delete {self.paths.partial} to start over.")
                if self._offsets[index] < 0:
                    self._offsets[index] = offset
                    self.num_done += 1
                    self.counts.add(record)
                offset += len(line)

    def _parse(self, line: bytes, number: int) -> dict[str, Any]:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise CaptureError(
                f"{self.paths.partial} line {number} is not a regenerate record (the file was changed by "
                f"something else); delete {self.paths.partial} to start over.")
        return record

    def is_done(self, index: int) -> bool:
        return self._offsets[index] >= 0

    def pending_ranges(self) -> list[tuple[int, int]]:
        """``(start, stop)`` runs of row indices that have no record yet."""
        ranges, start = [], None
        for index in range(self.num_rows):
            if self._offsets[index] < 0 and start is None:
                start = index
            elif self._offsets[index] >= 0 and start is not None:
                ranges.append((start, index))
                start = None
        if start is not None:
            ranges.append((start, self.num_rows))
        return ranges

    def record(self, record: dict[str, Any]) -> None:
        """Append one finished row (``{"index": i, "row": ...}`` or ``{"index": i, "refused": ...}``), fsync'd."""
        index = record["index"]
        assert self._offsets[index] < 0, f"row {index} recorded twice"
        self._offsets[index] = self._append(record)
        self.num_done += 1
        self.counts.add(record)

    def _append(self, record: dict[str, Any]) -> int:
        """Write one line at the end with one call (so a kill tears at most this line); its offset."""
        line = dumps_line(record)
        offset = os.lseek(self._fd, 0, os.SEEK_END)
        written = 0
        while written < len(line):
            written += os.write(self._fd, line[written:])
        os.fsync(self._fd)
        return offset

    def finish(self, identity: dict[str, Any]) -> None:
        """Every row has its record: write the refused list, the completion record and OUT, drop the journal."""
        assert self.num_done == self.num_rows, f"{self.num_rows - self.num_done} rows have no record"
        refused = []
        with open(self.paths.partial, "rb") as journal, open(self.paths.assembling, "wb") as out:
            for index in range(self.num_rows):
                journal.seek(self._offsets[index])
                record = json.loads(journal.readline())
                if "refused" in record:
                    refused.append({"index": index, **record["refused"]})
                else:
                    out.write(dumps_line(record["row"]))
            out.flush()
            os.fsync(out.fileno())
        if refused:
            data = b"".join(dumps_line(entry) for entry in refused)
            write_atomic(self.paths.refused, lambda tmp: tmp.write_bytes(data))
        else:
            self.paths.refused.unlink(missing_ok=True)
        # The completion record goes before OUT: an OUT under its name always has one that says what it is.
        record = json.dumps({"ds_capture_regenerate": JOURNAL_FORMAT, "complete": True, "identity": identity,
                             "counts": asdict(self.counts)}, indent=2, sort_keys=True) + "\n"
        write_atomic(self.paths.record, lambda tmp: tmp.write_bytes(record.encode()))
        os.replace(self.paths.assembling, self.paths.out)
        fsync_dir(self.paths.out.parent)
        self.paths.partial.unlink()
        fsync_dir(self.paths.out.parent)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the flock
            self._fd = -1

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def remove_leftover_journal(paths: OutputPaths) -> None:
    """A journal left beside a complete OUT (killed between OUT's rename and the journal's removal)."""
    if paths.partial.exists():
        fd = os.open(paths.partial, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            paths.partial.unlink()
        except BlockingIOError:
            pass  # another run holds it; it will find OUT complete too
        finally:
            os.close(fd)


def _differences(before: Any, now: dict[str, Any]) -> str:
    if not isinstance(before, dict):
        return "its header names no identity"
    keys = sorted(set(before) | set(now))
    return "; ".join(f"{key}: was {before.get(key)!r}, now {now.get(key)!r}"
                     for key in keys if before.get(key) != now.get(key))
