"""The edge's upstream HTTP/1.1 client: pooled keep-alive connections, one write per request.

The relay needs little of a general HTTP client: POST a body with a few headers, read the
status and headers, then the body whole or as it comes. aiohttp does that at ~0.27 ms of CPU per
request on the reference machine; this client, an asyncio protocol around httptools' parser
(llhttp, the parser uvicorn and Node use), at ~0.1 ms (docs/benchmarks.md). It is not a general
client: no redirects, no cookies, no proxies (the environment's proxy settings do not apply, as
with the aiohttp session before it), no compression (it asks for none: the relay passes bodies
through as they are), and no ``Expect: 100-continue``.

- `UpstreamPool.post(url, body, headers, within=)`: the response once its status line and
  headers are in (within ``within`` seconds of sending the request). A connection comes from the
  pool (the most recently used idle one whose server has not closed it, idle for less than
  ``keepalive``) or is dialled within ``dial`` seconds (TLS for ``https`` URLs, with the
  system's trust store).
- `UpstreamResponse`: ``status``, ``headers`` (lower-case names), `read(deadline)` (the whole
  body), `readany(deadline)` (what has arrived, ``b""`` at the end), `release()` (the connection
  goes back to the pool if the response is complete and both sides keep it alive, else it is
  closed) and `close()`. Deadlines are the event loop's clock (`loop.time()`); how long a
  connection has been idle is the injected clock's monotonic time (`llmgw.clock`).

Errors: `UpstreamConnectError` when no connection could be made (refused, no such host, dial
timeout); `UpstreamBrokenError` when the connection broke or the answer was not HTTP
(``not_http``); `UpstreamTimeout` when a wait passed its deadline (the caller decides what
becomes of the connection: a timed-out head closes it). A deadline costs one loop timer, and
none when what is asked for has arrived already (a small body comes with its headers), which
``asyncio.timeout`` around each await would not (~4 us of CPU each, several per request).

A kept-alive connection that its server closed as it was reused (an idle timeout racing the
reuse: the connection broke before any byte of an answer) is replaced by a new one and the
request sent once more; a server's end of file is noted at once, so a closed connection is not
handed out. Bytes that arrive when no answer is awaited (a second response after the answer,
anything while idle) close the connection.

Invariant: a connection serves one request at a time and goes back to the pool only after its
response was read to the end with keep-alive on both sides; any other end closes it.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Mapping
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

from llmgw.clock import SYSTEM, Clock

__all__ = [
    "UpstreamBrokenError",
    "UpstreamConnectError",
    "UpstreamPool",
    "UpstreamResponse",
    "UpstreamTimeout",
]

_HIGH_WATER = 256 * 1024  # buffered body bytes at which the socket stops being read
_MAX_IDLE_PER_HOST = 256


class UpstreamConnectError(Exception):
    """No connection could be made: nothing serves there."""


class UpstreamTimeout(Exception):
    """What was awaited (the response's head, more of its body) did not come by the deadline."""


class UpstreamBrokenError(Exception):
    """The connection broke, or what came back was not an HTTP response (`not_http`)."""

    def __init__(self, message: str, *, not_http: bool = False) -> None:
        super().__init__(message)
        self.not_http = not_http


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the response it is reading (httptools callbacks)."""

    def __init__(self, high_water: int = _HIGH_WATER) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._high_water = high_water
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._paused = False
        self._reset()

    def _reset(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self.transport.resume_reading()  # paused at the last body's high-water mark
        loop = asyncio.get_running_loop()
        self.head: asyncio.Future[None] = loop.create_future()
        self.got_bytes = False  # anything of this response arrived
        self.status = 0
        self.headers: dict[str, str] = {}
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self.complete = False
        self.error: UpstreamBrokenError | None = None
        self._paused = False
        self._until_close = False  # a body that ends when the server closes the connection
        self._keep_alive = False

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream connection's

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamBrokenError("the upstream switched protocols", not_http=True))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBrokenError(f"not an HTTP response ({exc})", not_http=True))

    def eof_received(self) -> bool:
        self.closed = True  # at once: the pool must not hand it out in the meantime
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete or self.error is not None:
            return
        if self.head.done() and self._until_close and exc is None:
            self._finish()  # the body ends with the connection
            return
        reason = f"{type(exc).__name__}: {exc}" if exc is not None else "closed by the upstream"
        self._fail(UpstreamBrokenError(f"the connection broke ({reason})"))

    # -- httptools callbacks --

    def on_message_begin(self) -> None:
        if self.complete:  # a message nobody asked for (idle, or after the answer): not HTTP
            raise UpstreamBrokenError("the upstream sent a response nobody asked for")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if self.status < 200:  # an interim response (103 Early Hints...): the answer follows
            self.headers = {}
            return
        self._until_close = (
            "content-length" not in self.headers
            # chunked framing only when chunked is the last coding (RFC 9112 6.3), as llhttp reads it
            and self.headers.get("transfer-encoding", "").rsplit(",", 1)[-1].strip().lower()
            != "chunked"
            and self.status >= 200
            and self.status not in (204, 304)
        )
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > self._high_water and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.status >= 200:
            self._keep_alive = self._parser.should_keep_alive()  # this message's (read it now)
            self._finish()

    # -- the response's side --

    def _finish(self) -> None:
        self.complete = True
        if not self.head.done():
            self.head.set_result(None)
        self._wake()

    def _fail(self, error: UpstreamBrokenError) -> None:
        """The connection is done for: a response still being read ends with `error` (its head
        and body waiters get it); an idle one (a stray byte from its server) is just closed."""
        if not self.complete and self.error is None:
            self.error = error
            if not self.head.done():
                self.head.set_exception(error)
                self.head.exception()  # retrieved: nobody may be waiting any more
            self._wake()
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def readany(self, deadline: float | None = None) -> bytes:
        while not self._body:
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await _by(self._waiter, deadline)
            finally:
                self._waiter = None
        data = b"".join(self._body) if len(self._body) > 1 else self._body[0]
        self._body.clear()
        self._buffered = 0
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return data

    def drained(self) -> bool:
        """The whole body is in and was read: a read now answers b"" without waiting."""
        return self.complete and not self._body and self.error is None

    def transport_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def reusable(self) -> bool:
        return (
            self.complete
            and self.error is None
            and not self.closed
            and not self._until_close
            and self._keep_alive
        )

    def close(self) -> None:
        """Close the connection; a response still being read ends with an error (not as if
        its body had ended with the connection)."""
        self._fail(UpstreamBrokenError("the connection was closed by the gateway"))


class UpstreamResponse:
    """An upstream's answer whose head is in (see the module docstring)."""

    __slots__ = ("_connection", "_done", "_key", "_pool", "headers", "status")

    def __init__(self, pool: UpstreamPool, key: Any, connection: _Connection) -> None:
        self._pool = pool
        self._key = key
        self._connection = connection
        self._done = False
        self.status = connection.status
        self.headers: Mapping[str, str] = connection.headers

    async def readany(self, deadline: float | None = None) -> bytes:
        """What has arrived since the last read (waits for something until `deadline`, else
        UpstreamTimeout); b"" once it is all in."""
        return await self._connection.readany(deadline)

    def drained(self) -> bool:
        """The whole body is in and was read: `readany` answers b"" without waiting."""
        return self._connection.drained()

    async def read(self, deadline: float | None = None) -> bytes:
        """The whole body, by `deadline` (else UpstreamTimeout)."""
        parts = []
        while chunk := await self._connection.readany(deadline):
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with it: the connection goes back to the pool if it can serve another request."""
        if self._done:
            return
        self._done = True
        connection = self._connection
        if connection.reusable():
            self._pool._put_back(self._key, connection)
        else:
            connection.close()

    def close(self) -> None:
        """Done with it, whatever state it is in: the connection is closed."""
        if self._done:
            return
        self._done = True
        self._connection.close()


class UpstreamPool:
    """Keep-alive connections per (scheme, host, port); see the module docstring."""

    def __init__(
        self,
        *,
        dial: float,
        keepalive: float = 30.0,
        tls: ssl.SSLContext | None = None,
        read_high_water: int = _HIGH_WATER,
        clock: Clock = SYSTEM,
    ) -> None:
        self._dial = dial
        self._high_water = read_high_water  # buffered body bytes at which reading pauses
        self._keepalive = keepalive
        self._monotonic = clock.monotonic  # how long a connection has been idle
        self._idle: dict[Any, list[_Connection]] = {}
        self._targets: dict[str, tuple[Any, bytes]] = {}  # url -> (pool key, request line head)
        self._tls = tls  # for https: the system's trust store unless given
        self._closed = False
        self.redials = 0  # requests sent again after a kept-alive connection was found closed

    def _target(self, url: str) -> tuple[Any, bytes]:
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise UpstreamConnectError(f"not an http(s) URL: {url!r}")
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # IPv6
            if port != (443 if tls else 80):
                host = f"{host}:{port}"
            head = f"POST {path} HTTP/1.1\r\nhost: {host}\r\n".encode("latin-1")
            target = self._targets[url] = ((tls, parts.hostname, port), head)
        return target

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], within: float | None = None
    ) -> UpstreamResponse:
        """The response once its head is in: within `within` seconds of sending the request
        (else UpstreamTimeout, the connection closed), a redial's second try included."""
        key, head = self._target(url)
        lines = [head]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:
                raise ValueError(f"header {name!r} has a line break in its value")
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"content-length: %d\r\n\r\n" % len(body))
        lines.append(body)
        request = b"".join(lines)
        connection = self._idle_connection(key)
        if connection is None:
            connection = await self._dial_new(key)
            return await self._send(key, connection, request, _deadline(within))
        deadline = _deadline(within)
        try:
            return await self._send(key, connection, request, deadline)
        except UpstreamBrokenError as exc:
            # A kept-alive connection its server closed as the request went out (an idle
            # timeout racing the reuse): nothing of an answer came, the request was not read.
            # Once more on a new connection; any other failure is the endpoint's.
            if exc.not_http or connection.got_bytes:
                raise
            self.redials += 1
            return await self._send(key, await self._dial_new(key), request, deadline)

    async def _send(
        self, key: Any, connection: _Connection, request: bytes, deadline: float | None
    ) -> UpstreamResponse:
        assert connection.transport is not None
        connection.transport.write(request)
        try:
            await _by(connection.head, deadline)
        except BaseException:
            connection.close()
            raise
        return UpstreamResponse(self, key, connection)

    def _idle_connection(self, key: Any) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = self._monotonic()
        while idle:
            connection = idle.pop()
            usable = not connection.closed and not connection.transport_closing()
            if usable and now - connection.idle_since < self._keepalive:
                connection._reset()
                return connection
            connection.close()
        return None

    async def _dial_new(self, key: Any) -> _Connection:
        tls, host, port = key
        loop = asyncio.get_running_loop()
        context = None
        if tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            context = self._tls
        try:
            async with asyncio.timeout(self._dial):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self._high_water),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if tls else None,
                )
        except TimeoutError:
            raise UpstreamConnectError(
                f"no connection to {host}:{port} within {self._dial:g}s"
            ) from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {exc}") from None
        return connection

    def _put_back(self, key: Any, connection: _Connection) -> None:
        idle = self._idle.setdefault(key, [])
        if self._closed or len(idle) >= _MAX_IDLE_PER_HOST:
            connection.close()
            return
        connection.idle_since = self._monotonic()
        idle.append(connection)

    async def close(self) -> None:
        """Close every idle connection; connections in use close when their response ends."""
        self._closed = True
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()


def _deadline(within: float | None) -> float | None:
    return None if within is None else asyncio.get_running_loop().time() + within


async def _by(waiter: asyncio.Future[None], deadline: float | None) -> None:
    """Await `waiter`; at `deadline` (loop time; None: never) it ends with UpstreamTimeout,
    unless what it waits for came first. One loop timer, none for a waiter done already."""
    if deadline is None or waiter.done():
        await waiter
        return
    timer = asyncio.get_running_loop().call_at(deadline, _time_out, waiter)
    try:
        await waiter
    finally:
        timer.cancel()


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamTimeout("the deadline passed"))
