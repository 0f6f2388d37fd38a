"""The OpenAI wire format as the load generator uses it (pure): URLs, bodies, headers, SSE.

- `api_urls` accepts a base (``http://h:8080``), a ``/v1`` base, or a full
  ``.../v1/chat/completions`` or ``.../v1/completions`` URL;
- `request_body` asks for ``max_tokens`` output tokens and, when streaming,
  ``stream_options.include_usage`` so token counts come from the server's ``usage``;
- `SseDecoder` splits a byte stream into ``data:`` payloads at blank-line event boundaries,
  whatever the chunking of the bytes (CRLF, LF or CR line ends; comments and other fields are
  skipped; several ``data:`` lines of one event are joined with a newline, as the SSE spec says).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from llmgw.services.bench.workload import RequestPlan, completion_prompt

__all__ = [
    "ApiUrls",
    "Headers",
    "SseDecoder",
    "api_urls",
    "chunk_text",
    "request_body",
    "request_headers",
]

CHAT_PATH = "/chat/completions"
COMPLETIONS_PATH = "/completions"


@dataclass(frozen=True, slots=True)
class ApiUrls:
    """``root`` is the server without ``/v1`` (where ``/metrics`` lives); ``v1`` the API base."""

    root: str
    v1: str
    api: str | None = None
    """``chat`` or ``completions`` when the URL named the route, else None."""

    def generation(self, api: str) -> str:
        return self.v1 + (CHAT_PATH if api == "chat" else COMPLETIONS_PATH)

    @property
    def models(self) -> str:
        return self.v1 + "/models"

    @property
    def metrics(self) -> str:
        return self.root + "/metrics"


def api_urls(url: str) -> ApiUrls:
    """Normalise what a user points the bench at; ValueError for anything but http(s) URLs."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{url!r} is not an http(s) URL such as http://127.0.0.1:8080")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: a URL with a query or fragment is not an API base")
    path = parts.path.rstrip("/")
    api = None
    for suffix, name in ((CHAT_PATH, "chat"), (COMPLETIONS_PATH, "completions")):
        if path.endswith("/v1" + suffix):
            path, api = path[: -len(suffix)], name
            break
    root_path = path[: -len("/v1")] if path.endswith("/v1") else path
    root = urlunsplit((parts.scheme, parts.netloc, root_path, "", ""))
    return ApiUrls(root=root, v1=root + "/v1", api=api)


Headers = dict[str, str]


def request_headers(
    plan: RequestPlan,
    *,
    band_header: str,
    session_header: str,
    extra: Mapping[str, str] | None = None,
) -> Headers:
    """Content type, ``Authorization: Bearer`` key, band and session headers, then `extra`."""
    headers = {"content-type": "application/json"}
    if plan.api_key:
        headers["authorization"] = f"Bearer {plan.api_key}"
    if plan.band:
        headers[band_header] = plan.band
    if plan.session_id:
        headers[session_header] = plan.session_id
    headers.update(extra or {})
    return headers


def request_body(
    plan: RequestPlan,
    *,
    model: str,
    api: str,
    stream: bool,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON body of `plan` for ``chat`` or ``completions``; `extra` fields are merged last."""
    body: dict[str, Any] = {"model": model, "max_tokens": plan.max_tokens, "stream": stream}
    if api == "chat":
        body["messages"] = [{"role": m.role, "content": m.content} for m in plan.messages]
    else:
        body["prompt"] = completion_prompt(plan.messages)
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra or {})
    return body


def chunk_text(chunk: Mapping[str, Any]) -> str:
    """Generated text in one chat or completions chunk (or whole response): "" for none.

    Chat: ``choices[0].delta`` (stream) or ``.message`` (whole), its ``content`` plus any
    ``reasoning_content`` / ``reasoning``; completions: ``choices[0].text``.
    """
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return ""
    choice = choices[0]
    text = choice.get("text")
    if isinstance(text, str):
        return text
    message = choice.get("delta")
    if not isinstance(message, Mapping):
        message = choice.get("message")
    if not isinstance(message, Mapping):
        return ""
    parts = [message.get(key) for key in ("reasoning_content", "reasoning", "content")]
    return "".join(part for part in parts if isinstance(part, str))


class SseDecoder:
    """Incremental Server-Sent Events decoder: feed bytes, get the completed events' data."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[str]:
        """The data of every event completed by `chunk` (events without data are skipped)."""
        if self._pending_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the LF of a CRLF split across two chunks
        self._pending_cr = chunk.endswith(b"\r")
        text = self._buffer + chunk
        lines = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        self._buffer = lines.pop()
        events = []
        for raw in lines:
            event = self._line(raw.decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[str]:
        """Events still open at the end of the stream (a last event without its blank line)."""
        events = self.feed(b"\n") if self._buffer else []
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _line(self, line: str) -> str | None:
        if line == "":
            if not self._data:
                return None
            event, self._data = "\n".join(self._data), []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None
