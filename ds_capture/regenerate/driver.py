"""``ds-capture regenerate``: every assistant turn of a dataset rewritten by the target behind an OpenAI-compatible
server, ``concurrency`` rows in flight, each finished row journaled, the output assembled in input order.

In:  :class:`RegenerateOptions` (dataset, output, server URL, :class:`GenerationSettings`, concurrency, retries).
Out: OUT (JSONL, ``messages`` form, one row per input row in input order; refused rows left out and listed in
     ``OUT.refused.jsonl``) and a :class:`RegenerateSummary`; progress on stderr (rows/s, generated tokens/s,
     ETA). Every row is validated with ``run``'s rules (``data.reading``) before any request is sent.

The run's identity is the sha256 of the selected input rows (as parsed, in order) with the split, the shuffle
seed and the generation settings; the URL, concurrency, retries and timeout are not part of it (a rerun may
point at a restarted server elsewhere). Rows within one conversation are sequential (turn k's prompt holds the
rewritten turns before it); rows run concurrently. A server that fails through every retry ends the run with
:class:`ServerUnavailable` (rows finished so far stay recorded); a refused row is recorded as refused, except
that refusals are held back until this run's first answer: eight refusals before any answer mean a wrong model
or server, not eight bad rows, and end the run with nothing recorded.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from ds_capture.data.messages import normalize_row
from ds_capture.data.reading import JSONL_SUFFIXES, ChatRows, open_dataset
from ds_capture.errors import CaptureError
from ds_capture.regenerate.client import ChatClient, GenerationSettings, Refused, ServerUnavailable
from ds_capture.regenerate.journal import Counts, Journal, OutputPaths, read_complete, remove_leftover_journal
from ds_capture.regenerate.turns import kept_tool_turns, output_row, rewritten_turns

REFUSALS_BEFORE_ANY_ANSWER = 8


@dataclass(frozen=True, kw_only=True)
class RegenerateOptions:
    """One ``ds-capture regenerate`` command."""

    data: str
    """Any dataset ``ds-capture run`` reads (JSONL / JSON / parquet / a datasets directory); the CLI resolves
    ``demo:conversations``."""
    output: Path
    """The regenerated dataset, a ``.jsonl`` file; its progress and side files live beside it."""
    url: str
    """The server's OpenAI base URL, e.g. ``http://localhost:8000/v1``."""
    generation: GenerationSettings
    split: str | None = None
    """Split expression, as ``recipe_args.train_split``."""
    shuffle_seed: int = 42
    """As ``recipe_args.shuffle_seed`` (Hugging Face datasets are shuffled with it, as ``run`` does)."""
    concurrency: int = 32
    max_retries: int = 5
    timeout_s: float = 600.0
    backoff_s: float = 0.5
    show_progress: bool = True

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise CaptureError(f"--url {self.url!r} is not an http(s) URL; give the server's OpenAI base URL, "
                               "e.g. http://localhost:8000/v1.")
        if self.concurrency < 1 or self.max_retries < 0 or self.timeout_s <= 0:
            raise CaptureError(f"--concurrency ({self.concurrency}) must be at least 1, --max-retries "
                               f"({self.max_retries}) 0 or more and --timeout ({self.timeout_s}) more than 0.")


@dataclass
class RegenerateSummary:
    output: Path
    num_input_rows: int
    counts: Counts
    already_complete: bool = False
    new_rows: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    refused_list: Path | None = None

    def format(self) -> str:
        counts = self.counts
        body = (f"{self.output}: {counts.rows} of {self.num_input_rows} rows ({counts.turns} turns rewritten, "
                f"{counts.cut} cut at --max-tokens, {counts.kept_tool_turns} tool-call turns kept as in the data, "
                f"{counts.refused} rows refused{f': {self.refused_list}' if counts.refused else ''})")
        if self.already_complete:
            return f"{body}; already complete with this input and these settings: nothing to do."
        seconds = max(self.seconds, 1e-9)
        return (f"regenerated {self.new_rows} rows in {self.seconds:.1f} s ({self.new_rows / seconds:.2f} rows/s, "
                f"{self.new_tokens / seconds:,.0f} generated tokens/s); {body}")


def regenerate(options: RegenerateOptions, *, transport: httpx.AsyncBaseTransport | None = None) -> RegenerateSummary:
    """Run (or continue, or confirm) one regeneration; ``transport`` replaces httpx's network transport."""
    paths = OutputPaths(Path(options.output))
    if paths.out.suffix.lower() not in JSONL_SUFFIXES:
        raise CaptureError(f"--output {paths.out}: the regenerated dataset is JSONL; name it with a "
                           f"{' or '.join(JSONL_SUFFIXES)} suffix so that ds-capture run reads it as such.")
    if Path(options.data).resolve() == paths.out.resolve():
        raise CaptureError(f"--output {paths.out} is the input dataset itself; write the regenerated rows to "
                           "another file.")
    rows = open_dataset(options.data, split=options.split, shuffle_seed=options.shuffle_seed,  # run's refusals, first
                        selected_for="regenerate")
    identity = {"input_rows_sha256": _rows_sha256(rows), "num_input_rows": rows.num_rows, "split": options.split,
                "shuffle_seed": options.shuffle_seed, **_settings_identity(options.generation)}
    complete = read_complete(paths, identity)
    if complete is not None:
        remove_leftover_journal(paths)
        return RegenerateSummary(paths.out, rows.num_rows, complete, already_complete=True,
                                 refused_list=paths.refused)
    details = {"data": options.data, "url": options.url}  # recorded for people, not compared
    with Journal(paths, identity, rows.num_rows, details) as journal:
        run = _Run(options, rows, journal)
        started = time.perf_counter()
        if journal.num_done < rows.num_rows:
            asyncio.run(run.all_rows(transport))
        journal.finish(identity)
        return RegenerateSummary(paths.out, rows.num_rows, journal.counts, new_rows=run.new_rows,
                                 new_tokens=run.new_tokens, seconds=time.perf_counter() - started,
                                 refused_list=paths.refused)


def _settings_identity(settings: GenerationSettings) -> dict[str, Any]:
    return {"model": settings.model, "max_tokens": settings.max_tokens, "temperature": settings.temperature,
            "seed": settings.seed}


def _rows_sha256(rows: ChatRows) -> str:
    """sha256 of every selected row as parsed, in order (also: every row's other fields can be written as JSON)."""
    digest = hashlib.sha256()
    for where, row in rows.raw_rows():
        try:
            digest.update(json.dumps(row, ensure_ascii=True, sort_keys=True).encode() + b"\n")
        except (TypeError, ValueError) as exc:
            raise CaptureError(f"{where}: the row holds a value JSON cannot write ({exc}); the regenerated "
                               "dataset is JSONL, so convert or drop that field.") from None
    return digest.hexdigest()


@dataclass
class _Run:
    """The rows of one invocation in flight."""

    options: RegenerateOptions
    rows: ChatRows
    journal: Journal
    new_rows: int = 0
    new_tokens: int = 0
    answered: bool = False
    held_refusals: list[dict[str, Any]] = field(default_factory=list)

    async def all_rows(self, transport: httpx.AsyncBaseTransport | None) -> None:
        options = self.options
        workers = min(options.concurrency, self.rows.num_rows - self.journal.num_done)
        queue: asyncio.Queue = asyncio.Queue(maxsize=2 * workers)
        bar = tqdm(total=self.rows.num_rows, initial=self.journal.num_done, unit="row", desc="regenerate",
                   file=sys.stderr, dynamic_ncols=True, disable=not options.show_progress)
        started = time.perf_counter()

        async def produce() -> None:
            for start, stop in self.journal.pending_ranges():
                for index, (where, row) in enumerate(self.rows.raw_rows(start, stop), start):
                    await queue.put((index, where, row))
            for _ in range(workers):
                await queue.put(None)

        async def work(client: ChatClient) -> None:
            while (item := await queue.get()) is not None:
                self._record(await _regenerate_row(client, *item))
                bar.update(1)
                bar.set_postfix_str(f"{self.new_tokens / (time.perf_counter() - started):,.0f} tok/s", refresh=False)

        try:
            async with ChatClient(options.url, options.generation, concurrency=options.concurrency,
                                  timeout_s=options.timeout_s, max_retries=options.max_retries,
                                  backoff_s=options.backoff_s, transport=transport) as client:
                try:
                    async with asyncio.TaskGroup() as group:
                        group.create_task(produce())
                        for _ in range(workers):
                            group.create_task(work(client))
                except BaseExceptionGroup as group_error:
                    # The first failure ends the run; the other rows in flight were cancelled unrecorded.
                    raise _first_error(group_error) from None
            self._flush_held_refusals()
        except ServerUnavailable as error:
            raise ServerUnavailable(
                f"{error} {self.journal.num_done} of {self.rows.num_rows} rows are recorded in "
                f"{self.journal.paths.partial}; once the server answers again, rerun the same command to "
                "continue.") from None
        finally:
            bar.close()

    def _record(self, record: dict[str, Any]) -> None:
        if "refused" in record and not self.answered:
            self.held_refusals.append(record)
            if len(self.held_refusals) >= REFUSALS_BEFORE_ANY_ANSWER:
                first = self.held_refusals[0]["refused"]
                raise CaptureError(
                    f"the server at {self.options.url} refused the first {len(self.held_refusals)} requests of this "
                    f"run and answered none (first: {first['where']}, message {first['message']}: HTTP "
                    f"{first['status']}: {first['reason']}). That is a wrong --model or server setting rather than "
                    "bad rows; nothing was recorded for them. Fix it and rerun.")
            return
        if "row" in record:
            self.answered = self.answered or record["turns"] > 0  # a row with nothing to rewrite asked nothing
            self.new_rows += 1
            self.new_tokens += record["tokens"]
        self.journal.record(record)
        if self.answered:
            self._flush_held_refusals()

    def _flush_held_refusals(self) -> None:
        """Refusals held back before the first answer are rows' own once one row was answered (or none was
        answered but too few were asked to tell)."""
        while self.held_refusals:
            self.journal.record(self.held_refusals.pop(0))


async def _regenerate_row(client: ChatClient, index: int, where: str, row: dict[str, Any]) -> dict[str, Any]:
    """One row, turn by turn: its journal record (the output row and its counts, or the refusal)."""
    conversation = normalize_row(row, where)
    messages = [dict(message) for message in conversation]
    cut = tokens = 0
    turns = rewritten_turns(conversation)
    for turn in turns:
        try:
            reply = await client.complete(messages[:turn], conversation.tools, f"{where}, message {turn + 1}")
        except Refused as refusal:
            return {"index": index, "refused": {"where": where, "message": turn + 1, "status": refusal.status,
                                                "reason": refusal.reason}}
        messages[turn] = reply.message
        cut += reply.finish_reason == "length"
        tokens += reply.completion_tokens
    regenerated = output_row(row, messages)
    try:
        normalize_row(regenerated, where)  # what ds-capture run will read must pass its rules
    except CaptureError as error:
        return {"index": index, "refused": {"where": where, "message": None, "status": None,
                                            "reason": f"a reply makes the row invalid: {error}"}}
    return {"index": index, "row": regenerated, "turns": len(turns), "cut": cut,
            "kept_tool_turns": kept_tool_turns(conversation), "tokens": tokens}


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The error to report from a task group: a KeyboardInterrupt wins, then the first other one."""
    errors = list(_leaves(group))
    return next((e for e in errors if isinstance(e, KeyboardInterrupt)), errors[0])


def _leaves(group: BaseExceptionGroup):
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            yield from _leaves(error)
        else:
            yield error
