"""One row's regeneration: which assistant turns are rewritten, what each request holds, the output row.

In:  a parsed dataset row and its normalised :class:`~ds_capture.data.messages.Conversation`; then, turn by
     turn, the server's reply messages.
Out: the message prefix of each request, and the output row: ``messages`` (the normalised messages, each
     rewritten turn replaced by its reply) followed by the row's other fields as they were (a ShareGPT row's
     ``conversations`` becomes ``messages``).

Rewritten: every assistant turn that carries no ``tool_calls`` in the data, in order. The request for turn k
holds the messages before it: the row's system, user and tool messages as they are and the assistant turns
before k as already rewritten (with the row's ``tools`` beside them). An assistant turn with ``tool_calls`` is
kept as it is: the ``tool`` messages after it answer those exact calls by id, which a rewritten turn would
not make; it is counted (``kept_tool_turns``).
"""

from __future__ import annotations

from typing import Any

from ds_capture.data.messages import Conversation

ROW_MESSAGE_KEYS = ("messages", "conversations")


def rewritten_turns(conversation: Conversation) -> list[int]:
    """Indices of the assistant turns to rewrite, in order."""
    return [j for j, message in enumerate(conversation)
            if message["role"] == "assistant" and not message.get("tool_calls")]


def kept_tool_turns(conversation: Conversation) -> int:
    """Assistant turns kept as in the data because they carry tool calls."""
    return sum(1 for message in conversation if message["role"] == "assistant" and message.get("tool_calls"))


def output_row(row: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """``messages`` first, then every other field of the row unchanged."""
    return {"messages": messages, **{key: value for key, value in row.items() if key not in ROW_MESSAGE_KEYS}}
