"""Data stage: a chat dataset on disk -> validated conversations -> tokenized rows with loss masks.

In:  a dataset path (JSONL / JSON list / parquet / a ``datasets`` directory), a split expression and
     a shuffle seed; then a tokenizer, the effective chat template, ``seq_length`` and the two mask flags.
Out: ``read_conversations`` -> ``list[list[Message]]`` (OpenAI-format messages, every row validated);
     ``tokenize_conversations`` -> ``TokenizedRows`` (input_ids / loss_mask [N, S], num_tokens [N]).

The tokenization reproduces NeMo AutoModel 0.7.0's ``ChatDataset(unshifted=True, padding="max_length",
truncation=True)`` exactly (DESIGN §4), checked against the reference caches in the shared fixtures:

- render with ``apply_chat_template`` (no extra special tokens), right-truncate to S, right-pad to S;
- loss_mask from ``{% generation %}`` markers when the template has them (tokens overlapping a marked
  character span), otherwise each assistant message spans ``len(render(m[:i]))..len(render(m[:i+1]))``;
- ``mask_generation_prompt`` clears, per assistant turn, the block that ``add_generation_prompt=True``
  appends to the rendered prefix (when the turn opens with that whole block);
- ``mask_reasoning_content`` clears the tokens that change when that turn's reasoning is emptied.

Message = ``{"role": system|user|assistant|tool, "content": str, "reasoning_content"?: str, ...}``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ds_capture.errors import CaptureError

logger = logging.getLogger(__name__)

Message = dict[str, Any]

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT ``from`` -> OpenAI role; NeMo's plain-chat map plus ``tool``.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "tool": "tool",
}
JSONL_SUFFIXES = (".jsonl", ".ndjson")
# NeMo shuffles the base split and then slices only for this exact form; any other expression
# (percentages, negative bounds, "a+b") goes to `datasets` first and is shuffled afterwards.
_NEMO_SLICE_RE = re.compile(r"^(\w+)\[(\d*):(\d*)\]$")
_FORMATS_HINT = (
    "Use a .jsonl/.ndjson file (one row per line), a .json file (a list of rows), a .parquet file, "
    "or a directory written by datasets' save_to_disk / holding parquet files."
)


# ----------------------------------------------------------------------------- reading


def read_conversations(path: str, *, split: str | None, shuffle_seed: int) -> list[list[Message]]:
    """Read and validate every selected row of a chat dataset, in the order the cache will hold them.

    Local JSON/JSONL keep file order (a split expression such as ``train[:100]`` or ``train[:10%]``
    still slices it; the file is the split ``train``). Hugging Face datasets (parquet, save_to_disk
    directories) are shuffled with ``shuffle_seed`` and then sliced, as NeMo does.
    """
    source = Path(path)
    if not source.exists():
        raise CaptureError(
            f"{path}: dataset not found. Point train_data_path at an existing file or directory. {_FORMATS_HINT}"
        )
    if source.is_file() and source.suffix.lower() in (*JSONL_SUFFIXES, ".json"):
        rows = _read_json_rows(source)
        selected = _select_local(rows, path, split)
        where = "line" if source.suffix.lower() in JSONL_SUFFIXES else "row"
    elif source.is_dir() or source.suffix.lower() == ".parquet":
        selected = _select_hf(_load_hf_splits(source), path, split, shuffle_seed)
        where = "row"
    else:
        raise CaptureError(f"{path}: unsupported dataset file type '{source.suffix}'. {_FORMATS_HINT}")
    if not selected:
        chosen = f" after applying split {split!r}" if split else ""
        raise CaptureError(
            f"{path}: the dataset has no rows{chosen}. Add rows to the dataset or widen the split."
        )
    return [normalize_row(row, f"{path} {where} {number}") for number, row in selected]


def _read_json_rows(source: Path) -> list[tuple[int, Any]]:
    """(1-based line or row number, parsed row) for a JSONL file or a JSON list; blank lines skipped."""
    text = source.read_text(encoding="utf-8")
    if source.suffix.lower() == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CaptureError(
                f"{source}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}). "
                "A .json dataset must be one JSON list of rows; fix the file or convert it to JSONL."
            ) from None
        if not isinstance(rows, list):
            raise CaptureError(
                f"{source}: a .json dataset must be a JSON list of rows, got a JSON {type(rows).__name__}. "
                "Wrap the rows in a list, or write one row per line as .jsonl."
            )
        return list(enumerate(rows, start=1))
    parsed = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            parsed.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise CaptureError(
                f"{source} line {number}: not valid JSON ({exc.msg} at column {exc.colno}). "
                "Each line of a JSONL file must be one JSON object; fix or delete this line."
            ) from None
    return parsed


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


def _select_local(rows: list[tuple[int, Any]], path: str, split: str | None) -> list[tuple[int, Any]]:
    """Slice a local file's rows by a split expression, keeping file order (no shuffle)."""
    if split is None:
        return rows
    selected = []
    for _, start, stop in _absolute_ranges(split, {"train": len(rows)}, path):
        selected.extend(rows[start:stop])
    return selected


def _load_hf_splits(source: Path) -> dict[str, Any]:
    """Every split of a parquet file or a dataset directory, as `datasets.Dataset` objects."""
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


def _select_hf(splits: dict[str, Any], path: str, split: str | None, shuffle_seed: int) -> list[tuple[int, Any]]:
    """NeMo's order for HF data: `base[a:b]` -> shuffle the base split, then slice; any other
    expression -> `datasets` selects first, then the selection is shuffled. Returns (row number, row)."""
    sizes = {name: len(ds) for name, ds in splits.items()}
    match = _NEMO_SLICE_RE.match(split) if split is not None else None
    base = match.group(1) if match else None
    if match and base in splits:
        order = _shuffled(range(sizes[base]), shuffle_seed)
        start, stop = (int(g) if g else None for g in match.group(2, 3))
        picks = [(base, i) for i in order[start:stop]]
    else:
        ranges = _absolute_ranges(split or "train", sizes, path)
        picks = [(name, i) for name, start, stop in ranges for i in range(start, stop)]
        picks = [picks[i] for i in _shuffled(range(len(picks)), shuffle_seed)]
    # One `select` per split: row-by-row indexing of an Arrow table is slow for large datasets.
    wanted: dict[str, list[int]] = {}
    for name, index in picks:
        wanted.setdefault(name, []).append(index)
    records = {
        name: dict(zip(indices, splits[name].select(indices).to_list())) for name, indices in wanted.items()
    }
    return [(index + 1, records[name][index]) for name, index in picks]


def _shuffled(indices: range, shuffle_seed: int) -> list[int]:
    """The permutation `Dataset.shuffle(seed=shuffle_seed)` applies to a dataset of this length."""
    import datasets

    return datasets.Dataset.from_dict({"i": list(indices)}).shuffle(seed=shuffle_seed)["i"]


# ----------------------------------------------------------------------------- validation


def normalize_row(row: Any, where: str) -> list[Message]:
    """Validate one dataset row and return its OpenAI-format messages; `where` is "<file> line|row N"."""
    if not isinstance(row, dict):
        raise CaptureError(
            f"{where}: expected a JSON object with a `messages` list, got {type(row).__name__}. "
            "Each row must be an object such as {\"messages\": [{\"role\": \"user\", \"content\": \"...\"}]}."
        )
    if row.get("messages") is not None:
        turns, sharegpt = row["messages"], False
    elif row.get("conversations") is not None:
        turns, sharegpt = row["conversations"], True
    else:
        raise CaptureError(
            f"{where}: row has neither a `messages` list (OpenAI format) nor a `conversations` list "
            "(ShareGPT format). Add one of them, or remove the row."
        )
    key = "conversations" if sharegpt else "messages"
    if not isinstance(turns, list):
        raise CaptureError(f"{where}: `{key}` must be a list of messages, got {type(turns).__name__}.")
    if not turns:
        raise CaptureError(
            f"{where}: `{key}` is empty. Every row needs at least one message; fill it in or remove the row."
        )
    messages = [_normalize_message(turn, sharegpt, f"{where}: message {j}") for j, turn in enumerate(turns, 1)]
    for j, message in enumerate(messages[1:], start=2):
        if message["role"] != "system":
            continue
        if messages[0]["role"] == "system":
            raise CaptureError(
                f"{where}: message {j} is a second system message. A conversation may have one system "
                "message, as its first message; merge the system messages into one."
            )
        raise CaptureError(
            f"{where}: message {j} is a system message after other messages. The system message must be "
            "the first message; move it to the front."
        )
    return messages


def _normalize_message(turn: Any, sharegpt: bool, where: str) -> Message:
    """One message -> {"role", "content": str, ...}; None-valued keys dropped, as transformers does."""
    if not isinstance(turn, dict):
        raise CaptureError(
            f"{where} must be an object with `role` and `content`, got {type(turn).__name__}."
        )
    if sharegpt:
        raw_role = turn.get("from", turn.get("role"))
        role = SHAREGPT_ROLES.get(raw_role) if isinstance(raw_role, str) else None
        content = turn.get("value", turn.get("content"))
        extra = {k: v for k, v in turn.items() if k not in ("from", "role", "value", "content")}
        valid = ", ".join(sorted(SHAREGPT_ROLES))
    else:
        raw_role = turn.get("role")
        role = raw_role if raw_role in ROLES else None
        content = turn.get("content")
        extra = {k: v for k, v in turn.items() if k not in ("role", "content")}
        valid = ", ".join(ROLES)
    if role is None:
        raise CaptureError(f"{where} has unknown role {raw_role!r}. Valid roles: {valid}.")
    message = {"role": role, "content": _content_text(content, f"{where} ({role})")}
    message.update({k: v for k, v in extra.items() if v is not None})
    if role == "assistant" and "reasoning_content" in message:
        if not isinstance(message["reasoning_content"], str):
            raise CaptureError(
                f"{where} (assistant) has reasoning_content of type "
                f"{type(message['reasoning_content']).__name__}; it must be a string. Convert it to text."
            )
    elif role == "assistant" and "reasoning_content" in turn:
        message["reasoning_content"] = ""  # NeMo renders a null reasoning_content as empty
    return message


def _content_text(content: Any, where: str) -> str:
    """A string as is; a list of {"type": "text", "text": ...} parts joined with spaces."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content, start=1):
            if not (isinstance(part, dict) and isinstance(part.get("text"), str)):
                raise CaptureError(
                    f"{where}: content part {k} is not a text part. Content lists may hold only "
                    "{\"type\": \"text\", \"text\": ...} parts; drop the other parts."
                )
            texts.append(part["text"])
        return " ".join(texts)
    raise CaptureError(
        f"{where} has content of type {type(content).__name__}; content must be a string or a list of "
        "{\"type\": \"text\", \"text\": ...} parts. Convert it to text."
    )


# ----------------------------------------------------------------------------- chat template


def resolve_chat_template(tokenizer, override: str | None) -> str:
    """The effective chat template: the tokenizer's own, or the override (a file path or inline Jinja).

    Like NeMo, a string holding Jinja tags is the template itself; otherwise it must name a file,
    whose text is the template (a JSON file's ``chat_template`` field, as in tokenizer_config.json).
    """
    if override is None:
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # tokenizers that ship several named templates
            template = template.get("default", next(iter(template.values()), None))
        if not template:
            raise CaptureError(
                f"the tokenizer of {getattr(tokenizer, 'name_or_path', 'the target')!r} has no chat template. "
                "Set recipe_args.chat_template to a Jinja template or to a file holding one."
            )
        return template
    if "{%" in override or "{{" in override:
        return override
    template_file = Path(override)
    if not template_file.is_file():
        raise CaptureError(
            f"chat_template {override!r} is neither an existing file nor a Jinja template (no '{{%' or '{{{{'). "
            "Fix the path, or give the template text itself."
        )
    text = template_file.read_text(encoding="utf-8")
    try:
        return json.loads(text)["chat_template"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return text


def chat_template_sha256(template: str | None) -> str:
    """sha256 hex of the UTF-8 template ("" when None): the manifest's ``chat_template_sha256``."""
    return hashlib.sha256((template or "").encode("utf-8")).hexdigest()


def pad_token_id(tokenizer) -> int:
    """The id rows are right-padded with: the tokenizer's pad id, else 0."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return 0 if pad is None else int(pad)


# ----------------------------------------------------------------------------- tokenization

# NeMo's test for a marker template: `{%- generation %}` needs whitespace before the keyword.
_GENERATION_RE = re.compile(r"\{%-?\s+generation\s+-?%\}")
# Conversations rendered per `apply_chat_template` call: one Rust batch encode per chunk.
_RENDER_CHUNK = 512


@dataclass(frozen=True)
class TokenizedRows:
    """N rows of length S. Position p of row i is content iff p < num_tokens[i]; the rest is padding."""

    input_ids: torch.Tensor  # int64 [N, S]
    loss_mask: torch.Tensor  # int64 [N, S], 0/1, 0 on padding
    num_tokens: torch.Tensor  # int64 [N], rendered length after truncation

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def tokenize_conversations(
    conversations: list[list[Message]],
    tokenizer,
    *,
    chat_template: str,
    seq_length: int,
    mask_reasoning_content: bool,
    mask_generation_prompt: bool,
) -> TokenizedRows:
    """Render, tokenize, right-truncate and right-pad every conversation, with NeMo's loss masks."""
    renderer = _Renderer(tokenizer, chat_template)
    has_markers = _GENERATION_RE.search(chat_template) is not None
    if "reasoning_content" not in chat_template and any(_reasoning_turns(c) for c in conversations):
        logger.warning("Rows carry reasoning_content but the chat template never renders it.")
    ids_rows: list[list[int]] = []
    mask_rows: list[list[int]] = []
    for first in range(0, len(conversations), _RENDER_CHUNK):
        chunk = conversations[first : first + _RENDER_CHUNK]
        # Untruncated renders: right truncation of a fast tokenizer equals slicing them, and the
        # reasoning / generation-prompt masks are located in the untruncated render (as NeMo does).
        full_ids, marker_masks = renderer.render(chunk, assistant_mask=has_markers)
        # Every extra render the masks need, for the whole chunk, in one batched call per kind.
        renders = _BatchedRenders(renderer)
        for row, messages in enumerate(chunk):
            if not has_markers:
                for k in _prefix_bounds(messages):
                    renders.want(("prefix", row, k), messages[:k])
            if mask_generation_prompt:
                for i in _assistant_turns(messages, skip_leading=True):
                    renders.want(("prefix", row, i), messages[:i])
                    for mode in renderer.prompt_modes:
                        renders.want(("prompt", row, i, *mode.items()), messages[:i], add_generation_prompt=True, **mode)
            if mask_reasoning_content:
                for i in _reasoning_turns(messages):
                    emptied = {**messages[i], "reasoning_content": ""}
                    renders.want(("reasoning", row, i), messages[:i] + [emptied] + messages[i + 1 :])
        renders.run()
        for row, messages in enumerate(chunk):
            ids = full_ids[row]
            kept = min(len(ids), seq_length)
            if has_markers:
                mask = marker_masks[row][:kept]
            else:
                mask = _prefix_span_mask(renders, renderer, row, messages, ids, seq_length, first + row)
            cleared = []
            if mask_generation_prompt:
                cleared += _generation_prompt_spans(renders, renderer, row, messages, ids, seq_length)
            if mask_reasoning_content:
                cleared += _reasoning_spans(renders, row, messages, ids, seq_length)
            for start, stop in cleared:
                stop = min(stop, kept)
                mask[start:stop] = [0] * max(0, stop - start)
            ids_rows.append(ids[:kept])
            mask_rows.append(mask)
    return _pack(ids_rows, mask_rows, seq_length, pad_token_id(tokenizer))


def _pack(ids_rows: list[list[int]], mask_rows: list[list[int]], seq_length: int, pad_id: int) -> TokenizedRows:
    """Right-pad ragged rows to [N, S] tensors in one conversion each."""
    num_tokens = [len(ids) for ids in ids_rows]
    input_ids = torch.tensor([ids + [pad_id] * (seq_length - len(ids)) for ids in ids_rows], dtype=torch.int64)
    loss_mask = torch.tensor([m + [0] * (seq_length - len(m)) for m in mask_rows], dtype=torch.int64)
    return TokenizedRows(
        input_ids=input_ids.reshape(len(ids_rows), seq_length),
        loss_mask=loss_mask.reshape(len(ids_rows), seq_length),
        num_tokens=torch.tensor(num_tokens, dtype=torch.int64),
    )


class _Renderer:
    """`apply_chat_template` with one template and no truncation or padding, batched."""

    def __init__(self, tokenizer, chat_template: str):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        # NeMo renders the generation prompt in both thinking modes only for templates that read the flag.
        self.prompt_modes = (
            [{"enable_thinking": True}, {"enable_thinking": False}] if "enable_thinking" in chat_template else [{}]
        )

    def render(self, conversations: list[list[Message]], *, assistant_mask: bool = False, **template_kwargs):
        """(ids per conversation, assistant masks per conversation or None)."""
        if not conversations:
            return [], None
        out = self.tokenizer.apply_chat_template(
            conversations,
            chat_template=self.chat_template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=assistant_mask,
            padding=False,
            truncation=False,
            **template_kwargs,
        )
        return [list(ids) for ids in out["input_ids"]], (out["assistant_masks"] if assistant_mask else None)

    def is_prefix(self, prefix: list[int], reference: list[int]) -> bool:
        """NeMo's check: `prefix` starts `reference`, allowing a trailing EOS the next turn replaces."""
        if len(prefix) > len(reference):
            return False
        if prefix == reference[: len(prefix)]:
            return True
        return (
            len(prefix) > 1
            and self.eos_token_id is not None
            and prefix[-1] == self.eos_token_id
            and prefix[:-1] == reference[: len(prefix) - 1]
        )


class _BatchedRenders:
    """Collects the renders a chunk needs (keyed, deduplicated), then runs one batch per template kwargs."""

    def __init__(self, renderer: _Renderer):
        self.renderer = renderer
        self.pending: dict[tuple, dict[tuple, list[Message]]] = {}
        self.done: dict[tuple, list[int]] = {}

    def want(self, key: tuple, messages: list[Message], **template_kwargs) -> None:
        self.pending.setdefault(tuple(sorted(template_kwargs.items())), {}).setdefault(key, messages)

    def run(self) -> None:
        for kwargs, requests in self.pending.items():
            ids, _ = self.renderer.render(list(requests.values()), **dict(kwargs))
            self.done.update(zip(requests.keys(), ids))
        self.pending = {}

    def __getitem__(self, key: tuple) -> list[int]:
        return self.done[key]


def _assistant_turns(messages: list[Message], *, skip_leading: bool = False) -> list[int]:
    # A leading assistant turn has an empty prefix, which no template renders (NeMo skips it too).
    return [i for i, m in enumerate(messages) if m["role"] == "assistant" and not (skip_leading and i == 0)]


def _reasoning_turns(messages: list[Message]) -> list[int]:
    return [i for i in _assistant_turns(messages) if messages[i].get("reasoning_content")]


def _prefix_bounds(messages: list[Message]) -> list[int]:
    """Prefix sizes k (0 < k < len) whose render length bounds an assistant message."""
    bounds = {k for i in _assistant_turns(messages) for k in (i, i + 1)}
    return sorted(k for k in bounds if 0 < k < len(messages))


def _clip(ids: list[int], full_len: int, seq_length: int) -> list[int]:
    """NeMo renders untruncated only when the whole conversation reaches S; otherwise truncated to S."""
    return ids if full_len >= seq_length else ids[:seq_length]


def _prefix_span_mask(renders, renderer, row, messages, ids, seq_length, number) -> list[int]:
    """Marker-free loss mask: assistant message i covers len(render(m[:i]))..len(render(m[:i+1])).

    Lengths are of renders truncated to S, each checked to be a prefix of the truncated full render.
    """
    full = ids[:seq_length]
    lengths = {0: 0, len(messages): len(full)}
    for k in _prefix_bounds(messages):
        prefix_ids = renders[("prefix", row, k)][:seq_length]
        if not renderer.is_prefix(prefix_ids, full):
            raise CaptureError(
                f"conversation {number + 1}: rendering its first {k} message(s) alone does not reproduce the "
                "start of the whole rendered conversation (the chat template rewrites earlier turns), so "
                "assistant spans cannot be found from conversation prefixes. Use a chat template that wraps "
                "assistant turns in {% generation %}...{% endgeneration %}."
            )
        lengths[k] = len(prefix_ids)
    mask = [0] * len(full)
    for i in _assistant_turns(messages):
        mask[lengths[i] : lengths[i + 1]] = [1] * max(0, lengths[i + 1] - lengths[i])
    return mask


def _generation_prompt_spans(renders, renderer, row, messages, ids, seq_length) -> list[tuple[int, int]]:
    """Per assistant turn, the block `add_generation_prompt=True` appends to the rendered prefix, when the
    turn in the full render opens with that whole block; turns whose prefix render is not a prefix of the
    full render stay supervised (NeMo's fail-closed rule)."""
    spans = []
    for i in _assistant_turns(messages, skip_leading=True):
        base = _clip(renders[("prefix", row, i)], len(ids), seq_length)
        if not renderer.is_prefix(base, ids):
            continue
        turn = ids[len(base) :]
        matched = 0
        for mode in renderer.prompt_modes:
            prompt = _clip(renders[("prompt", row, i, *mode.items())], len(ids), seq_length)
            block = prompt[len(base) :]
            if renderer.is_prefix(base, prompt) and block and turn[: len(block)] == block:
                matched = max(matched, len(block))
        spans.append((len(base), len(base) + matched))
    return spans


def _reasoning_spans(renders, row, messages, ids, seq_length) -> list[tuple[int, int]]:
    """Per assistant turn with reasoning, the tokens that differ from a render with that reasoning emptied
    (longest common prefix and suffix removed)."""
    spans = []
    for i in _reasoning_turns(messages):
        emptied = _clip(renders[("reasoning", row, i)], len(ids), seq_length)
        shortest = min(len(ids), len(emptied))
        start = 0
        while start < shortest and ids[start] == emptied[start]:
            start += 1
        suffix = 0
        while suffix < shortest - start and ids[-(suffix + 1)] == emptied[-(suffix + 1)]:
            suffix += 1
        if len(ids) - suffix > start:
            spans.append((start, len(ids) - suffix))
    return spans
