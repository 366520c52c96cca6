"""One chat completion through an OpenAI-compatible server: bounded retries with backoff, refusals told apart.

In:  the server's OpenAI base URL (``http://HOST:PORT/v1``), the :class:`GenerationSettings`, a conversation
     prefix and the row's tools.
Out: a :class:`Reply` (the assistant message: ``content``, the reasoning field kept as ``reasoning_content``,
     ``tool_calls``; ``finish_reason``; generated tokens as the server counts them), or

- :class:`Refused` when the server turns this one request down (HTTP 400 / 413 / 422 and other 4xx: a prompt
  over its context, a row its template cannot render): the row's problem, not the server's;
- :class:`ServerUnavailable` once the request failed ``1 + max_retries`` times (no connection, a timeout, a
  dropped connection, HTTP 5xx / 408 / 429, a reply that is not a chat completion), waiting ``backoff_s``,
  then twice as long, ... (at most 30 s) between tries;
- ``CaptureError`` at once for 401 / 403 / 404 / 405: a wrong URL, route, model name or key fails every row
  alike, so no row is blamed for it.

Requests go through one ``httpx.AsyncClient`` (connections kept alive and reused, at most ``concurrency``
open). The body is encoded here with ``ensure_ascii`` (a row's text may hold lone surrogates, which UTF-8
cannot encode).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httpx

from ds_capture.errors import CaptureError

RETRY_STATUSES = frozenset({408, 425, 429})  # 4xx that mean "later", not "never"
FATAL_STATUSES = frozenset({401, 403, 404, 405})  # the URL, route, model or credentials are wrong for every row
REASONING_FIELDS = ("reasoning_content", "reasoning")  # vLLM / SGLang / transformers spell it either way
MAX_BACKOFF_S = 30.0


class Refused(Exception):
    """The server refused this request (a 4xx that retrying cannot change); ``reason`` is its own message."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"HTTP {status}: {reason}")
        self.status = status
        self.reason = reason


class ServerUnavailable(CaptureError):
    """The server could not be reached, or kept failing, through every retry: rerun once it is back."""


@dataclass(frozen=True, kw_only=True)
class GenerationSettings:
    """What every request asks the server for; all of it is part of a regenerate run's identity."""

    model: str
    """The model name the server serves (vLLM ``--served-model-name``; ``transformers serve``: its path)."""
    max_tokens: int = 1024
    """Most tokens per reply; a reply cut there is kept (``finish_reason: length``) and counted."""
    temperature: float = 0.0
    """0 is greedy decoding (what the acceptance tests compare against direct requests)."""
    seed: int | None = None
    """Sent with every request when set (vLLM and SGLang seed each request with it); the server's own when not."""

    def __post_init__(self) -> None:
        if not self.model:
            raise CaptureError("--model must name the model the server serves (GET <url>/models lists them).")
        if self.max_tokens < 1:
            raise CaptureError(f"--max-tokens must be at least 1, got {self.max_tokens}.")
        if self.temperature < 0:
            raise CaptureError(f"--temperature must be 0 (greedy) or more, got {self.temperature}.")

    def body(self, messages: list[dict], tools: list | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                                "temperature": self.temperature, "stream": False}
        if self.seed is not None:
            body["seed"] = self.seed
        if tools:
            body["tools"] = tools
        return body


@dataclass(frozen=True)
class Reply:
    """One answered turn."""

    message: dict[str, Any]
    """``{"role": "assistant", "content", ["reasoning_content"], ["tool_calls"]}``, as the server returned it."""
    finish_reason: str | None
    completion_tokens: int


class ChatClient:
    """``POST {url}/chat/completions`` with retries; one instance per run (``async with``)."""

    def __init__(self, url: str, settings: GenerationSettings, *, concurrency: int, timeout_s: float,
                 max_retries: int, backoff_s: float = 0.5, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.endpoint = url.rstrip("/") + "/chat/completions"
        self.settings = settings
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        # The connect timeout is short: a server that does not accept within 10 s is down, not busy.
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            transport=transport)

    async def __aenter__(self) -> "ChatClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self._http.aclose()

    async def complete(self, messages: list[dict], tools: list | None, where: str) -> Reply:
        """The reply to ``messages``; ``where`` ("<file> line N, message k") names the turn in errors."""
        content = json.dumps(self.settings.body(messages, tools), ensure_ascii=True).encode()
        attempts = 1 + self.max_retries
        for attempt in range(attempts):
            try:
                response = await self._http.post(self.endpoint, content=content,
                                                  headers={"content-type": "application/json"})
                failure = self._failure(response, where)
                if failure is None:
                    return _parse_reply(response.json())
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            except (ValueError, KeyError, IndexError, TypeError) as exc:  # a 200 that is no chat completion
                failure = f"the reply is not a chat completion ({type(exc).__name__}: {exc})"
            if attempt + 1 < attempts:
                await asyncio.sleep(min(self.backoff_s * 2 ** attempt, MAX_BACKOFF_S))
        raise ServerUnavailable(f"{self.endpoint} did not answer {where} after {attempts} attempt(s) "
                                f"(last: {failure}).")

    def _failure(self, response: httpx.Response, where: str) -> str | None:
        """None for a 200; a retryable failure's description; raises for a refusal or a wrong URL / model."""
        status = response.status_code
        if status == 200:
            return None
        reason = _reason(response)
        if status in FATAL_STATUSES:
            raise CaptureError(
                f"{self.endpoint} answered HTTP {status} for {where} ({reason}). Check --url (the server's "
                f"OpenAI base URL, e.g. http://HOST:PORT/v1) and --model {self.settings.model!r} (GET "
                f"{self.endpoint.rsplit('/', 2)[0]}/models lists what the server serves).")
        if 400 <= status < 500 and status not in RETRY_STATUSES:
            raise Refused(status, reason)
        return f"HTTP {status}: {reason}"


def _parse_reply(data: dict) -> Reply:
    choice = data["choices"][0]
    answer = choice["message"]
    content = answer.get("content")
    if content is not None and not isinstance(content, str):
        raise TypeError(f"content is a {type(content).__name__}, not a string")
    message: dict[str, Any] = {"role": "assistant", "content": content or ""}
    reasoning = next((answer[key] for key in REASONING_FIELDS if answer.get(key)), None)
    if reasoning:
        message["reasoning_content"] = reasoning
    if answer.get("tool_calls"):
        message["tool_calls"] = answer["tool_calls"]
    usage = data.get("usage") or {}
    return Reply(message, choice.get("finish_reason"), int(usage.get("completion_tokens") or 0))


def _reason(response: httpx.Response) -> str:
    """The server's own words, on one line: OpenAI / vLLM ``error.message``, FastAPI ``detail``, or the text."""
    try:
        body = response.json()
    except ValueError:
        body = None
    reason: Any = None
    if isinstance(body, dict):
        error = body.get("error")
        reason = error.get("message") if isinstance(error, dict) else error or body.get("detail") or body.get("message")
    text = str(reason) if reason else (response.text or response.reason_phrase)
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."
