"""Dataset files -> validated chat rows, streamed: every row checked, only the wanted range kept.

In:  a dataset path (JSONL / JSON list / parquet / a ``datasets`` directory), a split expression and a
     shuffle seed.
Out: ``open_dataset`` -> :class:`ChatRows`: the number of selected rows and ``conversations(start, stop)``,
     which returns the normalised :class:`~ds_capture.data.messages.Conversation` of rows ``start..stop`` in cache
     order. ``read_conversations`` is ``open_dataset(...).conversations()``.

Invalid rows (a JSONL line that is not JSON or not UTF-8, a row whose shape NeMo refuses) are refused, the
first one named, unless ``invalid_rows="skip"`` (``capture.invalid_rows: skip``): then they are left out, each
kept as a :class:`SkippedRow` (where it is, and the very message the refusal would have given), and the handle
holds the valid rows only, in the same order. Rows refused later, at tokenization (a chat template that fails
on a row), still refuse the run.

``open_dataset`` validates every selected row once, one row in memory at a time (a JSONL keeps only the byte
offset of each line; a ``datasets`` table stays memory-mapped), so every rank raises the same first error
and no rank holds the whole dataset; ``conversations`` then parses only its range again. Orders follow NeMo
AutoModel 0.7.0: local JSON/JSONL keep file order (a split such as ``train[:100]`` or ``train[:10%]`` still
slices it); Hugging Face datasets (parquet, save_to_disk directories) are shuffled with ``shuffle_seed`` and
then sliced for ``base[a:b]``, or selected and then shuffled for any other expression.
"""

from __future__ import annotations

import logging
import re
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ds_capture.data.messages import Conversation, DroppedParts, normalize_row
from ds_capture.errors import CaptureError, parse_json

_LOG = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson")
# NeMo shuffles the base split and then slices only for this exact form; any other expression
# (percentages, negative bounds, "a+b") goes to `datasets` first and is shuffled afterwards.
_NEMO_SLICE_RE = re.compile(r"^(\w+)\[(\d*):(\d*)\]$")
_FORMATS_HINT = (
    "Use a .jsonl/.ndjson file (one row per line), a .json file (a list of rows), a .parquet file, "
    "or a directory written by datasets' save_to_disk / holding parquet files."
)
_HF_BATCH = 2048  # rows per Arrow -> Python conversion while streaming a `datasets` table


INVALID_ROWS = ("refuse", "skip")


@dataclass(frozen=True)
class SkippedRow:
    """A row ``capture.invalid_rows: skip`` left out: where it is and the refusal it would have raised."""

    where: str
    """``<path> line N`` (JSONL: the file's line number) or ``<path> row N`` (JSON list, datasets: 1-based)."""
    reason: str
    """The refusal's message, word for word."""

    def to_json(self) -> dict[str, Any]:
        unit, number = re.search(r" (line|row) (\d+)$", self.where).groups()
        return {unit: int(number), "where": self.where, "reason": self.reason}


@dataclass
class ChatRows:
    """The selected rows of one dataset, validated; ``conversations`` re-reads a range of them."""

    path: str
    num_rows: int
    _read: Callable[[int, int], Iterator[tuple[str, Any]]] = field(repr=False)
    validated: bool = False
    """Every selected row was already normalised once while the file was scanned."""
    skipped: list[SkippedRow] = field(default_factory=list)
    """Invalid rows left out (``invalid_rows="skip"``), in dataset order; they are not among ``num_rows``."""

    def __len__(self) -> int:
        return self.num_rows

    def conversations(self, start: int = 0, stop: int | None = None) -> list[Conversation]:
        """Rows ``start..stop`` (cache order), normalised again (they were validated by ``open_dataset``)."""
        stop = self.num_rows if stop is None else min(stop, self.num_rows)
        dropped = DroppedParts()  # counted and warned about once, by open_dataset
        return [_normalize(row, where, dropped) for where, row in self._read(start, stop)]

    def raw_rows(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[str, Any]]:
        """Rows ``start..stop`` (cache order) as parsed, unnormalised, each with its place ("<file> line N"),
        one at a time (``ds-capture regenerate`` keeps a row's other fields)."""
        return self._read(start, self.num_rows if stop is None else min(stop, self.num_rows))


@dataclass(frozen=True)
class _Unreadable:
    """A JSONL line that is not JSON (or not UTF-8): read as a row that refuses with ``error``."""

    error: CaptureError


def _normalize(row: Any, where: str, dropped: DroppedParts) -> Conversation:
    if isinstance(row, _Unreadable):
        raise row.error
    return normalize_row(row, where, dropped)


def read_conversations(path: str, *, split: str | None, shuffle_seed: int) -> list[Conversation]:
    """Read and validate every selected row of a chat dataset, in the order the cache will hold them."""
    return open_dataset(path, split=split, shuffle_seed=shuffle_seed).conversations()


def open_dataset(path: str, *, split: str | None, shuffle_seed: int, invalid_rows: str = "refuse",
                 selected_for: str = "cache") -> ChatRows:
    """Validate every selected row (streaming) and return a re-readable handle: the first invalid row raises,
    or with ``invalid_rows="skip"`` every invalid row is left out and listed in ``ChatRows.skipped``.
    ``selected_for``: ``cache`` (a run) or ``regenerate``, whose words the line about a local file's split uses."""
    assert invalid_rows in INVALID_ROWS, invalid_rows
    skip = invalid_rows == "skip"
    source = Path(path)
    if not source.exists():
        raise CaptureError(
            f"{path}: dataset not found. Point train_data_path at an existing file or directory. {_FORMATS_HINT}"
        )
    suffix = source.suffix.lower()
    dropped = DroppedParts()
    if source.is_file() and suffix in JSONL_SUFFIXES:
        rows = _jsonl_rows(source, path, split, dropped, skip=skip, selected_for=selected_for)
    elif source.is_file() and suffix == ".json":
        rows = _json_rows(source, path, split, selected_for=selected_for)
    elif source.is_dir() or suffix == ".parquet":
        rows = _hf_rows(source, path, split, shuffle_seed)
    else:
        raise CaptureError(f"{path}: unsupported dataset file type '{source.suffix}'. {_FORMATS_HINT}")
    if not rows.num_rows:
        chosen = f" after applying split {split!r}" if split else ""
        raise CaptureError(f"{path}: the dataset has no rows{chosen}. Add rows to the dataset or widen the split.")
    if skip:
        rows = _without_invalid_rows(rows, dropped)
    elif not rows.validated:
        for where, row in rows._read(0, rows.num_rows):
            _normalize(row, where, dropped)
    dropped.warn()
    return rows


def _without_invalid_rows(rows: ChatRows, dropped: DroppedParts) -> ChatRows:
    """The valid rows of ``rows`` (same order), the invalid ones listed; refused if none is valid."""
    skipped, bad = [], set()
    for position, (where, row) in enumerate(rows._read(0, rows.num_rows)):
        try:
            _normalize(row, where, dropped)
        except CaptureError as error:
            skipped.append(SkippedRow(where, str(error)))
            bad.add(position)
    if len(bad) == rows.num_rows:
        raise CaptureError(
            f"{rows.path}: all {rows.num_rows} selected rows are invalid, so capture.invalid_rows: skip leaves "
            f"nothing to capture. The first: {skipped[0].reason}"
        )
    kept = [position for position in range(rows.num_rows) if position not in bad]

    def read(start: int, stop: int) -> Iterator[tuple[str, Any]]:
        if start >= stop:
            return
        # Valid rows start..stop sit between their underlying positions: read that span, drop the invalid.
        low, high = kept[start], kept[stop - 1] + 1
        for position, item in zip(range(low, high), rows._read(low, high)):
            if position not in bad:
                yield item

    return ChatRows(path=rows.path, num_rows=len(kept), _read=read, validated=True, skipped=skipped)


# ----------------------------------------------------------------------------- JSONL


def _jsonl_rows(source: Path, path: str, split: str | None, dropped: DroppedParts, *, skip: bool,
                selected_for: str) -> ChatRows:
    """One pass records where each row's line starts (8 bytes a row) and, without a split (every row is
    selected) and without ``skip``, validates each row as it goes; rows are parsed again when read. With
    ``skip`` a line that is not UTF-8 is a row too (piece -1), which reads as its refusal."""
    offsets, pieces, numbers = array("q"), array("l"), array("q")
    undecodable: dict[int, CaptureError] = {}
    number = 0
    with source.open("rb") as handle:
        offset = 0
        for raw in handle:
            try:
                text = _decode(raw, source, offset, number + 1)
            except CaptureError as error:
                if not skip:
                    raise
                number += 1
                undecodable[number] = error
                offsets.append(offset)
                pieces.append(-1)
                numbers.append(number)
                offset += len(raw)
                continue
            # NeMo splits the decoded file with str.splitlines (U+2028 and friends end a line too).
            lines = text.splitlines()
            for piece, line in enumerate(lines):
                number += 1
                if line.strip():
                    if split is None and not skip:
                        row = _parse_line(line, source, number, broken=len(lines) > 1)
                        normalize_row(row, f"{path} line {number}", dropped)
                    offsets.append(offset)
                    pieces.append(piece)
                    numbers.append(number)
            offset += len(raw)
    order = _select_local(len(offsets), path, split, selected_for)

    def read(start: int, stop: int) -> Iterator[tuple[str, Any]]:
        with source.open("rb") as handle:
            for k in order[start:stop]:
                if pieces[k] < 0:
                    yield f"{path} line {numbers[k]}", _Unreadable(undecodable[numbers[k]])
                    continue
                handle.seek(offsets[k])
                lines = handle.readline().decode("utf-8").splitlines()
                try:
                    row = _parse_line(lines[pieces[k]], source, numbers[k], broken=len(lines) > 1)
                except CaptureError as error:
                    row = _Unreadable(error)
                yield f"{path} line {numbers[k]}", row

    return ChatRows(path=path, num_rows=len(order), _read=read, validated=split is None and not skip)


def _decode(raw: bytes, source: Path, offset: int, number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CaptureError(
            f"{source} line {number}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte {offset + exc.start} "
            "of the file). Datasets must be UTF-8 text; re-encode the file (e.g. iconv -f <encoding> -t utf-8) or "
            "delete the line."
        ) from None


def _parse_line(line: str, source: Path, number: int, *, broken: bool = False) -> Any:
    hint = (" The line holds a raw Unicode line break (U+2028, U+2029, U+0085, form feed, ...), where NeMo "
            "AutoModel splits JSONL lines as Python's str.splitlines does; write those characters escaped "
            "(json.dumps with ensure_ascii=True writes \\u2028)." if broken else "")
    return parse_json(line, f"{source} line {number}",
                      f"Each line of a JSONL file must be one JSON object; fix or delete this line.{hint}")


# ----------------------------------------------------------------------------- JSON list


def _json_rows(source: Path, path: str, split: str | None, *, selected_for: str) -> ChatRows:
    """A .json file is one document: parsed whole (as NeMo does), then sliced."""
    raw = source.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise CaptureError(
            f"{source}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start}, line {line}). "
            "Datasets must be UTF-8 text; re-encode the file (e.g. iconv -f <encoding> -t utf-8)."
        ) from None
    rows = parse_json(text, str(source), "A .json dataset must be one JSON list of rows; fix the file or convert "
                      "it to JSONL.")
    if not isinstance(rows, list):
        raise CaptureError(
            f"{source}: a .json dataset must be a JSON list of rows, got a JSON {type(rows).__name__}. "
            "Wrap the rows in a list, or write one row per line as .jsonl."
        )
    order = _select_local(len(rows), path, split, selected_for)

    def read(start: int, stop: int) -> Iterator[tuple[str, Any]]:
        for k in order[start:stop]:
            yield f"{path} row {k + 1}", rows[k]

    return ChatRows(path=path, num_rows=len(order), _read=read)


def _absolute_ranges(split: str, split_sizes: dict[str, int], path: str) -> list[tuple[str, int, int]]:
    """Resolve a `datasets` split expression to (split name, start, stop) ranges."""
    import datasets

    try:
        instructions = datasets.ReadInstruction.from_spec(split).to_absolute(split_sizes)
    except (ValueError, AssertionError, KeyError) as exc:
        raise CaptureError(
            f"{path}: cannot apply split {split!r} ({exc}). Available splits: {sorted(split_sizes)}; "
            "use a split expression such as 'train', 'train[:100]', 'train[10:20]' or 'train[:10%]'."
        ) from None
    return [(i.splitname, i.from_, i.to) for i in instructions]


def _select_local(num_rows: int, path: str, split: str | None, selected_for: str) -> range | list[int]:
    """Indices of a local file's rows picked by a split expression, in file order (no shuffle); a split that
    leaves rows out is said once, for a cache (NeMo ignores it there) or for ``ds-capture regenerate``."""
    if split is None:
        return range(num_rows)
    ranges = _absolute_ranges(split, {"train": num_rows}, path)
    selected = (range(ranges[0][1], ranges[0][2]) if len(ranges) == 1
                else [k for _, start, stop in ranges for k in range(start, stop)])
    if len(selected) != num_rows and selected_for == "regenerate":
        _LOG.info("%s: --split %r selects %d of its %d rows (in file order); the regenerated dataset holds only the "
                  "%d selected.", path, split, len(selected), num_rows, len(selected))
    elif len(selected) != num_rows:
        _LOG.warning("%s: train_split %r selects %d of its %d rows. NeMo AutoModel 0.7.0 ignores train_split for "
                     "local JSON/JSONL files (its precompute would capture all %d); this cache holds the %d selected.",
                     path, split, len(selected), num_rows, num_rows, len(selected))
    return selected


# ----------------------------------------------------------------------------- Hugging Face datasets


def _load_hf_splits(source: Path) -> dict[str, Any]:
    """Every split of a parquet file or a dataset directory, as (memory-mapped) `datasets.Dataset` objects."""
    import datasets

    try:
        if source.is_dir() and ((source / "state.json").exists() or (source / "dataset_dict.json").exists()):
            loaded = datasets.load_from_disk(str(source))
        elif source.is_dir():
            loaded = datasets.load_dataset(str(source))
        else:
            loaded = datasets.load_dataset("parquet", data_files={"train": str(source)})
    except Exception as exc:  # `datasets` raises many types for unreadable input; all are user errors here
        raise CaptureError(f"{source}: cannot load the dataset with `datasets` ({exc}). {_FORMATS_HINT}") from None
    if isinstance(loaded, datasets.Dataset):
        return {"train": loaded}
    return dict(loaded)


def _hf_rows(source: Path, path: str, split: str | None, shuffle_seed: int) -> ChatRows:
    """NeMo's order for HF data: `base[a:b]` -> shuffle the base split, then slice; any other expression ->
    `datasets` selects first, then the selection is shuffled."""
    splits = _load_hf_splits(source)
    sizes = {name: len(ds) for name, ds in splits.items()}
    match = _NEMO_SLICE_RE.match(split) if split is not None else None
    base = match.group(1) if match else None
    if match and base in splits:
        order = _shuffled(sizes[base], shuffle_seed)
        start, stop = (int(g) if g else None for g in match.group(2, 3))
        picks = [(base, i) for i in order[start:stop]]
    else:
        ranges = _absolute_ranges(split or "train", sizes, path)
        picks = [(name, i) for name, start, stop in ranges for i in range(start, stop)]
        picks = [picks[i] for i in _shuffled(len(picks), shuffle_seed)]

    def read(start: int, stop: int) -> Iterator[tuple[str, Any]]:
        # One `select` per split and batch: row-by-row indexing of an Arrow table is slow.
        for lo in range(start, stop, _HF_BATCH):
            batch = picks[lo : min(stop, lo + _HF_BATCH)]
            wanted: dict[str, list[int]] = {}
            for name, index in batch:
                wanted.setdefault(name, []).append(index)
            records = {
                name: dict(zip(indices, splits[name].select(indices).to_list())) for name, indices in wanted.items()
            }
            for name, index in batch:
                yield f"{path} row {index + 1}", records[name][index]

    return ChatRows(path=path, num_rows=len(picks), _read=read)


def _shuffled(length: int, shuffle_seed: int) -> list[int]:
    """The permutation `Dataset.shuffle(seed=shuffle_seed)` applies to a dataset of this length."""
    import datasets

    return datasets.Dataset.from_dict({"i": list(range(length))}).shuffle(seed=shuffle_seed)["i"]
