"""A real HTTP server that misbehaves the way broken engines do, for tests of the edge's retries.

Raw asyncio sockets, not a framework, so it can do what no well-behaved server does: answer a
streamed request with a 200 and its headers and then close, reset the connection, send bytes
that are not server-sent events, send the engine's error event instead of the first token, or
stall. `mode` may change between requests; `requests` counts the POST requests it read and
`bodies` keeps their JSON bodies. A GET (a scraper's /health or /metrics) is answered as an idle,
healthy vLLM engine would, so the gateway keeps sending it work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from typing import Any

MODES = ("close", "reset", "garbage", "error_event", "stall", "echo")
_SSE_HEADERS = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
)
_ERROR_EVENT = (
    b'data: {"object": "error", "message": "CUDA error: an illegal memory access", '
    b'"type": "InternalServerError", "param": null, "code": 500}\n\n'
)


# What a scraper reads from an idle vLLM engine (GET /metrics); any other GET is /health's 200.
_IDLE_METRICS = (
    b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"
)


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class MisbehavingServer:
    """Listens on 127.0.0.1; `url` once started. Modes:

    - close: 200 and SSE headers, then the connection closes (no body);
    - reset: reads the request, then resets the connection (RST) without answering;
    - garbage: 200 and SSE headers, then bytes that are not an event stream, then nothing;
    - error_event: 200 and SSE headers, then vLLM's error event (code 500), then the end;
    - stall: 200 and SSE headers, then nothing until the client leaves;
    - echo: a well-formed non-streamed chat completion (to see what the edge sent).
    """

    def __init__(self, mode: str = "close") -> None:
        assert mode in MODES
        self.mode = mode
        self.requests = 0
        self.bodies: list[dict[str, Any]] = []
        self._server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> MisbehavingServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = await reader.readexactly(length)
            if head.startswith(b"GET "):  # a scraper: healthy and idle, so it gets traffic
                await self._healthy(head, writer)
                return
            self.requests += 1
            with contextlib.suppress(ValueError):
                self.bodies.append(json.loads(body))
            await self._misbehave(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _healthy(self, head: bytes, writer: asyncio.StreamWriter) -> None:
        path = head.split(b" ", 2)[1]
        answer = _IDLE_METRICS if path.startswith(b"/metrics") else b"ok"
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n"
            + f"content-length: {len(answer)}\r\n\r\n".encode()
            + answer
        )
        await writer.drain()

    async def _misbehave(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        mode = self.mode
        if mode == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return
        if mode == "echo":
            answer = chat_completion_body("echo")
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(answer)}\r\n\r\n".encode()
                + answer
            )
            await writer.drain()
            return
        writer.write(_SSE_HEADERS)
        if mode == "garbage":
            writer.write(_chunk(b"<html><body>502 Bad Gateway</body></html>\n"))
        elif mode == "error_event":
            writer.write(_chunk(_ERROR_EVENT) + b"0\r\n\r\n")
        await writer.drain()
        if mode in ("garbage", "stall"):
            await reader.read()  # until the client closes its side


def chat_completion_body(completion_id: str = "x", model: str | None = None) -> bytes:
    """A minimal, complete OpenAI chat completion ("ok", one token each way)."""
    body: dict[str, object] = {
        "id": completion_id,
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    if model is not None:
        body["created"], body["model"] = 0, model
    return json.dumps(body).encode()
