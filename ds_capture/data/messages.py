"""Row validation: one dataset row -> a :class:`Conversation` of messages exactly as NeMo 0.7.0 normalises them.

In:  a parsed row (a mapping with OpenAI ``messages`` or ShareGPT ``conversations``, optional ``tools``) and
     the place it came from ("<file> line|row N", used in every error).
Out: ``Conversation`` (a ``list`` of message dicts that also carries the row's ``tools``), or a one-paragraph
     ``CaptureError`` naming file, row, message and field for anything NeMo's ``ChatDataset`` refuses.

The rules are NeMo AutoModel 0.7.0's ``chat_dataset._normalize_messages`` / ``_conversations_to_messages``
and ``NeMoAutoTokenizer.apply_chat_template`` (DESIGN §4):

- ShareGPT ``{"from", "value"}`` turns -> ``{"role", "content"}`` (plain-chat roles only; other keys dropped);
- role in system/user/assistant/tool; at most one system message;
- ``content``: a list -> the ``text`` of its mapping parts that have one, joined with one space (other parts
  dropped and counted); ``null`` -> ``""``; any other value -> ``str(value)``;
- assistant ``reasoning_content`` (when present): ``null`` -> ``""``, otherwise a string;
- assistant ``tool_calls`` (when present): a list of mappings with a ``function`` mapping holding a non-empty
  string ``name`` and an ``arguments`` value; ``id`` defaults to ``call_<index>``, ``type`` to ``function``;
  non-string ``arguments`` become ``json.dumps(arguments)``;
- ``tool`` messages need a non-empty string ``tool_call_id``;
- ``tools``: a list, or a JSON string holding one; an empty list is no tools.

Keys whose value is ``None`` are dropped after these checks (transformers' ``apply_chat_template`` drops them
before rendering, so the render is the same).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from ds_capture.errors import CaptureError, parse_json

logger = logging.getLogger(__name__)

Message = dict[str, Any]

ROLES = ("system", "user", "assistant", "tool")
# NeMo's ShareGPT `from` -> OpenAI role map (plain-chat roles only: NeMo sends tool traces elsewhere).
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
}


class Conversation(list):
    """One row's normalised messages (a ``list``, equal to a plain list of the same messages), its ``tools``
    and ``where`` it came from ("<file> line N"; used in errors raised while tokenizing it)."""

    __slots__ = ("tools", "where")

    def __init__(self, messages=(), tools: list | None = None, where: str = "a conversation"):
        super().__init__(messages)
        self.tools = tools
        self.where = where

    def with_messages(self, messages) -> "Conversation":
        """Other messages (a prefix, an edited turn) rendered with this row's tools."""
        return Conversation(messages, self.tools, self.where)


@dataclass
class DroppedParts:
    """Non-text content parts dropped over one read: a count and the first place, for one warning per run."""

    count: int = 0
    first: str | None = None

    def add(self, where: str) -> None:
        self.count += 1
        if self.first is None:
            self.first = where

    def warn(self) -> None:
        # Every rank validates every row; rank 0 alone says so (RANK is unset in a single process).
        if self.count and os.environ.get("RANK", "0") == "0":
            logger.warning(
                "dropped %d non-text content part(s) (first: %s); NeMo AutoModel keeps only the text of content "
                "parts, so images and other media never reach the chat template.", self.count, self.first)


def normalize_row(row: Any, where: str, dropped: DroppedParts | None = None) -> Conversation:
    """Validate one dataset row and return its normalised conversation; `where` is "<file> line|row N"."""
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
    if dropped is None:
        dropped = DroppedParts()
    messages = [
        _normalize_message(turn, sharegpt, f"{where}: message {j}", dropped) for j, turn in enumerate(turns, 1)
    ]
    systems = [j for j, message in enumerate(messages, start=1) if message["role"] == "system"]
    if len(systems) > 1:
        raise CaptureError(
            f"{where}: message {systems[1]} is a second system message. NeMo AutoModel supports one system "
            "message per conversation; merge the system messages into one."
        )
    return Conversation(messages, _tools(row.get("tools"), where), where)


def _tools(tools: Any, where: str) -> list | None:
    """NeMo's `tools` rule: a JSON string is parsed; a list is kept; an empty list is no tools."""
    if isinstance(tools, str):
        tools = parse_json(tools, where, "Store the tool definitions as a list, or as the JSON text of one.",
                           what="`tools` is a string but ")
    if tools is not None and not isinstance(tools, list):
        raise CaptureError(
            f"{where}: `tools` must be a list of tool definitions (or the JSON text of one), got "
            f"{type(tools).__name__}."
        )
    return tools or None


def _normalize_message(turn: Any, sharegpt: bool, where: str, dropped: DroppedParts) -> Message:
    if not isinstance(turn, dict):
        raise CaptureError(f"{where} must be an object with `role` and `content`, got {type(turn).__name__}.")
    if sharegpt:
        raw_role = turn.get("from", turn.get("role"))
        role = SHAREGPT_ROLES.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise CaptureError(
                f"{where} has unknown role {raw_role!r}. Valid ShareGPT roles: {', '.join(sorted(SHAREGPT_ROLES))} "
                "(NeMo AutoModel converts plain-chat turns only; write tool-calling rows as OpenAI `messages`)."
            )
        # NeMo keeps only role and content of a ShareGPT turn.
        turn = {"role": role, "content": turn.get("value", turn.get("content", ""))}
    role = turn.get("role")
    if role not in ROLES:
        raise CaptureError(f"{where} has unknown role {role!r}. Valid roles: {', '.join(ROLES)}.")
    where = f"{where} ({role})"
    message = dict(turn)
    message["content"] = _content_text(turn.get("content"), where, dropped)
    if role == "assistant" and "reasoning_content" in turn:
        reasoning = turn["reasoning_content"]
        if reasoning is None:
            message["reasoning_content"] = ""  # NeMo renders a null reasoning_content as empty
        elif not isinstance(reasoning, str):
            raise CaptureError(
                f"{where} has reasoning_content of type {type(reasoning).__name__}; it must be a string. "
                "Convert it to text."
            )
    if role == "assistant" and "tool_calls" in turn:
        message["tool_calls"] = _tool_calls(turn["tool_calls"], where)
    if role == "tool":
        call_id = turn.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise CaptureError(
                f"{where}: `tool_call_id` must be a non-empty string, got {_shown(call_id)}. Set it to the `id` of "
                "the assistant tool call this message answers."
            )
    return {k: v for k, v in message.items() if v is not None}


def _content_text(content: Any, where: str, dropped: DroppedParts) -> str:
    """NeMo's content rule: list -> text parts joined by a space; None -> ""; anything else -> str(value)."""
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content, start=1):
            if not (isinstance(part, dict) and "text" in part):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                dropped.add(f"{where} content part {k}, {kind!r}")
                continue
            if not isinstance(part["text"], str):
                raise CaptureError(
                    f"{where}: content part {k} has `text` of type {type(part['text']).__name__}; a part's text "
                    "must be a string (drop the `text` key from non-text parts, e.g. Arrow-unified image parts)."
                )
            texts.append(part["text"])
        return " ".join(texts)
    if content is None:
        return ""
    return content if isinstance(content, str) else str(content)


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """NeMo's `_normalize_tool_calls`: defaults for id/type, required function name and arguments."""
    if not isinstance(calls, list):
        raise CaptureError(
            f"{where}: `tool_calls` must be a list of tool calls, got {_shown(calls)}. Remove the key from "
            "messages without tool calls (NeMo AutoModel refuses a null `tool_calls`)."
        )
    normalized = []
    for index, call in enumerate(calls):
        field = f"tool_calls[{index}]"
        if not isinstance(call, dict):
            raise CaptureError(f"{where}: `{field}` must be an object, got {type(call).__name__}.")
        call_id = call.get("id")
        if call_id is None or call_id == "":
            call_id = f"call_{index}"
        elif not isinstance(call_id, str):
            raise CaptureError(f"{where}: `{field}.id` must be a string when given, got {type(call_id).__name__}.")
        kind = call.get("type")
        if kind is None or kind == "":
            kind = "function"
        elif not isinstance(kind, str):
            raise CaptureError(f"{where}: `{field}.type` must be a string when given, got {type(kind).__name__}.")
        function = call.get("function")
        if not isinstance(function, dict):
            raise CaptureError(
                f"{where}: `{field}.function` must be an object with `name` and `arguments`, got {_shown(function)}."
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise CaptureError(f"{where}: `{field}.function.name` must be a non-empty string, got {_shown(name)}.")
        arguments = function.get("arguments")
        if arguments is None:
            raise CaptureError(
                f"{where}: `{field}.function.arguments` is required (use \"{{}}\" for a call without arguments)."
            )
        function = dict(function)
        if not isinstance(arguments, str):
            try:
                function["arguments"] = json.dumps(arguments)
            except (TypeError, ValueError) as exc:
                raise CaptureError(f"{where}: `{field}.function.arguments` cannot be written as JSON ({exc}).") from None
        normalized.append({**call, "id": call_id, "type": kind, "function": function})
    return normalized


def _shown(value: Any) -> str:
    return "null" if value is None else repr(value) if isinstance(value, str) else type(value).__name__
