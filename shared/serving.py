"""Run an ASGI app on uvicorn inside the current event loop.

Used by tests and by in-process compositions: the server binds before
`start_server` returns, so `RunningServer.url` is immediately connectable.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
from dataclasses import dataclass

import uvicorn
from starlette.types import ASGIApp


@dataclass
class RunningServer:
    """A started uvicorn server; `stop()` shuts it down gracefully."""

    server: uvicorn.Server
    task: asyncio.Task[None]
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout)
        except TimeoutError:
            self.server.force_exit = True
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0 picks a free one); reused addresses allowed."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: without it a response body waits for
    # the client's delayed ACK of the headers (~40 ms on Linux).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def start_server(
    app: ASGIApp,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    log_level: str = "warning",
    timeout_graceful_shutdown: float | None = 5.0,
    timeout_keep_alive: int = 65,
) -> RunningServer:
    """Start `app` on uvicorn in this loop and return once it accepts connections."""
    sock = bind_socket(host, port)
    bound_port: int = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        # Annotated int upstream, but only ever used as an asyncio timeout (a float is fine).
        timeout_graceful_shutdown=timeout_graceful_shutdown,  # type: ignore[arg-type]
        # Longer than clients keep idle connections (httpx: 5 s), so a client
        # never sends a request on a connection the server is just closing.
        timeout_keep_alive=timeout_keep_alive,
        # An app may name its own HTTP protocol class (the edge: OpenAI-shaped parser errors).
        http=getattr(app, "http_protocol", "httptools"),
        # No X-Forwarded-* rewriting layer on every request: nothing here reads the client's
        # address (a proxy in front keeps its own access log).
        proxy_headers=False,
        # No `server: uvicorn` on every answer: what serves is nobody's business, and one
        # header less to write per response.
        server_header=False,
    )
    server = uvicorn.Server(config)
    server.config.setup_event_loop = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"uvicorn:{bound_port}")
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises the start-up error
            raise RuntimeError("uvicorn exited during start-up")
        await asyncio.sleep(0.005)
    return RunningServer(server=server, task=task, host=host, port=bound_port)


_HANDED_OUT: set[int] = set()  # ports this process gave out: never twice
_LOWEST_PORT = 10_000


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for subprocesses that must bind it themselves).

    Chosen below the kernel's ephemeral range when there is room: a port the kernel handed
    out for port 0 is the kind it also gives to outgoing connections, which can take it before
    the subprocess binds it ("address already in use"). Never the same port twice per process.
    """
    lowest, low = _drawn_from()
    rng = random.Random()
    for _ in range(64 if low - lowest > 1_000 else 0):
        port = rng.randrange(lowest, low)
        if port not in _HANDED_OUT and _port_is_free(host, port):
            _HANDED_OUT.add(port)
            return port
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def _drawn_from() -> tuple[int, int]:
    """The ports `free_port` draws from, [lowest, highest): below the kernel's ephemeral range,
    or the narrower range `LLMGW_FREE_PORTS` (``lo-hi``) names, for processes that must not draw
    each other's ports (parallel test workers each take a range of their own; their children
    inherit it)."""
    named = os.environ.get("LLMGW_FREE_PORTS", "")
    lo, _, hi = named.partition("-")
    if lo.isdigit() and hi.isdigit() and 1024 <= int(lo) < int(hi) <= 65536:
        return int(lo), int(hi)
    return _LOWEST_PORT, _ephemeral_low()


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """A port p such that p .. p+count-1 were all free a moment ago.

    For `llmgw up`, whose admission, reaper and scraper take the three ports after the edge's
    admin port: a config written on free ports must leave those free too.
    """
    while True:
        port = free_port(host)
        if port + count - 1 > 65535:
            continue
        block = range(port + 1, port + count)
        if all(p not in _HANDED_OUT and _port_is_free(host, p) for p in block):
            _HANDED_OUT.update(block)
            return port


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
