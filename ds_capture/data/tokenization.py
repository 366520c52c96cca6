"""Data stage: validated conversations -> tokenized rows with NeMo AutoModel 0.7.0's loss masks.

In:  :class:`~ds_capture.data.messages.Conversation` rows (``ds_capture.data.reading.open_dataset`` reads and validates
     them; ``read_conversations`` is re-exported here), a tokenizer, the effective chat template,
     ``seq_length`` and the two mask flags.
Out: ``tokenize_conversations`` -> ``TokenizedRows`` (input_ids / loss_mask [N, S], num_tokens [N]), or a
     ``CaptureError`` naming the row for what NeMo refuses (no assistant turn without markers, a template
     that rewrites earlier turns, a template that raises on the row).

The tokenization reproduces NeMo AutoModel 0.7.0's ``ChatDataset(unshifted=True, padding="max_length",
truncation=True)`` exactly (DESIGN §4), checked against NeMo's own caches and recordings in tests/fixtures:

- render with ``apply_chat_template`` (the row's ``tools`` passed along), right-truncate to S, right-pad to S;
- loss_mask from ``{% generation %}`` markers when the template has them (tokens overlapping a marked
  character span), otherwise each assistant message spans ``len(render(m[:i]))..len(render(m[:i+1]))``;
- ``mask_generation_prompt`` clears, per assistant turn, the block that ``add_generation_prompt=True``
  appends to the rendered prefix (when the turn opens with that whole block);
- ``mask_reasoning_content`` clears the tokens that change when that turn's reasoning is emptied.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_capture.data.messages import Conversation, Message
from ds_capture.data.reading import ChatRows, open_dataset, read_conversations
from ds_capture.errors import CaptureError

__all__ = ["ChatRows", "Conversation", "Message", "TokenizedRows", "chat_template_sha256", "open_dataset",
           "pad_token_id", "read_conversations", "resolve_chat_template", "tokenize_conversations"]

logger = logging.getLogger(__name__)

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


def pad_token_id(tokenizer, *, where: str = "the target's tokenizer") -> int:
    """The id rows are right-padded with, as NeMo 0.7.0 pads them: the tokenizer's pad id, else its eos id.

    NeMo's ChatDataset sets a missing pad token to eos (``_add_pad_token``) and lets ``apply_chat_template(...,
    padding="max_length")`` pad, so Llama 3.1 (no pad token) is padded with eos, and a pad id of 0 stays 0
    (measured with NeMo 0.7.0 on the fixture tokenizer: pad None -> eos, 0 -> 0, 363 -> 363)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None:
        return int(pad)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise CaptureError(
            f"{where} has neither a pad token nor an eos token, so there is no id to pad rows with (NeMo AutoModel "
            "pads with the pad token, else eos, and refuses such a tokenizer too). Set `pad_token` or `eos_token` "
            "in the target's tokenizer_config.json."
        )
    return int(eos)


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
    conversations: list[Conversation] | list[list[Message]],
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
    conversations = [
        c if isinstance(c, Conversation) else Conversation(c, None, f"conversation {n + 1}")
        for n, c in enumerate(conversations)
    ]
    if not has_markers:
        for messages in conversations:
            if not _assistant_turns(messages):
                raise CaptureError(
                    f"{messages.where}: the conversation has no assistant message, and the chat template has no "
                    "{% generation %} markers, so NeMo AutoModel refuses to build its answer-only loss mask. "
                    "Remove the row, or use a template with {% generation %}...{% endgeneration %} markers."
                )
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
                    renders.want(("prefix", row, k), messages.with_messages(messages[:k]))
            if mask_generation_prompt:
                for i in _assistant_turns(messages, skip_leading=True):
                    prefix = messages.with_messages(messages[:i])
                    renders.want(("prefix", row, i), prefix)
                    for mode in renderer.prompt_modes:
                        renders.want(("prompt", row, i, *mode.items()), prefix, add_generation_prompt=True, **mode)
            if mask_reasoning_content:
                for i in _reasoning_turns(messages):
                    emptied = {**messages[i], "reasoning_content": ""}
                    edited = messages.with_messages(messages[:i] + [emptied] + messages[i + 1 :])
                    renders.want(("reasoning", row, i), edited)
        renders.run()
        for row, messages in enumerate(chunk):
            ids = full_ids[row]
            kept = min(len(ids), seq_length)
            if has_markers:
                mask = marker_masks[row][:kept]
            else:
                mask = _prefix_span_mask(renders, renderer, row, messages, ids, seq_length)
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

    def render(self, conversations: list[Conversation], *, assistant_mask: bool = False, **template_kwargs):
        """(ids per conversation, assistant masks per conversation or None); one batched call per `tools`."""
        if not conversations:
            return [], None
        groups: dict[str, list[int]] = {}
        for n, conversation in enumerate(conversations):
            groups.setdefault(_tools_key(conversation.tools), []).append(n)
        ids: list = [None] * len(conversations)
        masks: list | None = [None] * len(conversations) if assistant_mask else None
        for members in groups.values():
            batch = [conversations[n] for n in members]
            try:
                got_ids, got_masks = self._apply(batch, batch[0].tools, assistant_mask, template_kwargs)
            except Exception:  # noqa: BLE001 - find the row at fault (and NeMo's system-role retry) one by one
                got_ids, got_masks = [], []
                for conversation in batch:
                    one_ids, one_masks = self._render_one(conversation, assistant_mask, template_kwargs)
                    got_ids += one_ids
                    got_masks += one_masks or []
            for k, n in enumerate(members):
                ids[n] = got_ids[k]
                if masks is not None:
                    masks[n] = got_masks[k]
        return ids, masks

    def _apply(self, batch: list[Conversation], tools, assistant_mask: bool, template_kwargs: dict):
        out = self.tokenizer.apply_chat_template(
            [list(conversation) for conversation in batch],
            tools=tools,
            chat_template=self.chat_template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=assistant_mask,
            padding=False,
            truncation=False,
            **template_kwargs,
        )
        return [list(ids) for ids in out["input_ids"]], (list(out["assistant_masks"]) if assistant_mask else None)

    def _render_one(self, conversation: Conversation, assistant_mask: bool, template_kwargs: dict):
        """One conversation; a template that raises "System role not supported" gets NeMo's remapped
        conversation (the system text merged into the first user message); any other failure is the row's."""
        from jinja2 import TemplateError

        try:
            return self._apply([conversation], conversation.tools, assistant_mask, template_kwargs)
        except TemplateError as error:
            if "System role not supported" in str(error) and any(m["role"] == "system" for m in conversation):
                remapped = conversation.with_messages(_merge_system_into_user(conversation))
                try:
                    return self._apply([remapped], conversation.tools, assistant_mask, template_kwargs)
                except Exception as again:  # noqa: BLE001
                    error = again
            raise _template_error(conversation, error) from None
        except Exception as error:  # noqa: BLE001 - Jinja TypeErrors / UndefinedErrors come from the row's data
            raise _template_error(conversation, error) from None

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


def _tools_key(tools) -> str:
    return "" if not tools else json.dumps(tools, default=repr)


def _merge_system_into_user(conversation: Conversation) -> list[Message]:
    """NeMo's `_remap_system_role`: the system text joins the first user message ("<system>\\n<user>")."""
    system = next(m for m in conversation if m["role"] == "system")
    out, merged = [], False
    for message in conversation:
        if message["role"] == "system":
            continue
        if not merged and message["role"] == "user":
            out.append({**message, "content": f"{system.get('content', '')}\n{message['content']}"})
            merged = True
        else:
            out.append(message)
    if not merged:
        out.insert(0, {"role": "user", "content": system.get("content", "")})
    return out


def _template_error(conversation: Conversation, error: Exception) -> CaptureError:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return CaptureError(
        f"{conversation.where}: the chat template failed to render this conversation "
        f"({type(error).__name__}: {reason[:300]}). The template refuses this row's shape, or meets a field it "
        "cannot handle; fix or remove the row, or set recipe_args.chat_template to a template that accepts it."
    )


class _BatchedRenders:
    """Collects the renders a chunk needs (keyed, deduplicated), then runs one batch per template kwargs."""

    def __init__(self, renderer: _Renderer):
        self.renderer = renderer
        self.pending: dict[tuple, dict[tuple, Conversation]] = {}
        self.done: dict[tuple, list[int]] = {}

    def want(self, key: tuple, messages: Conversation, **template_kwargs) -> None:
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


def _prefix_span_mask(renders, renderer, row, messages, ids, seq_length) -> list[int]:
    """Marker-free loss mask: assistant message i covers len(render(m[:i]))..len(render(m[:i+1])).

    Lengths are of renders truncated to S, each checked to be a prefix of the truncated full render.
    """
    full = ids[:seq_length]
    lengths = {0: 0, len(messages): len(full)}
    for k in _prefix_bounds(messages):
        prefix_ids = renders[("prefix", row, k)][:seq_length]
        if not renderer.is_prefix(prefix_ids, full):
            raise CaptureError(
                f"{messages.where}: rendering its first {k} message(s) alone does not reproduce the start of the "
                "whole rendered conversation: the chat template rewrites earlier turns from later ones (Qwen3's "
                "stock template drops the <think> blocks of earlier turns), so NeMo AutoModel refuses to find "
                "assistant spans from conversation prefixes. Set recipe_args.chat_template to a template that wraps "
                "assistant turns in {% generation %}...{% endgeneration %}, or to one that renders every turn the "
                "same whatever follows it."
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
