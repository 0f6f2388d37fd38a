"""The edge's upstream HTTP/1.1 client against real sockets: keep-alive, framing, failures."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio
from timing import SteppedClock, eventually

from llmgw.services.edge.http_client import (
    UpstreamBrokenError,
    UpstreamConnectError,
    UpstreamPool,
    UpstreamTimeout,
)
from llmgw.serving import free_port

Answer = Callable[[bytes], bytes | None]  # request bytes -> raw answer (None: reset)


class RawServer:
    """Answers each request on a connection with `answer(request)`; counts connections."""

    def __init__(self, answer: Answer, *, close_after: bool = False) -> None:
        self.answer = answer
        self.close_after = close_after
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                answer = self.answer(request)
                if answer is None:  # reset
                    writer.transport.abort()
                    return
                writer.write(answer)
                await writer.drain()
                if self.close_after:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/x"


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Callable[..., RawServer]]:
    servers: list[RawServer] = []

    async def start(answer: Answer, **options: bool) -> RawServer:
        raw = RawServer(answer, **options)
        raw.server = await asyncio.start_server(raw._serve, "127.0.0.1", 0)
        servers.append(raw)
        return raw

    yield start
    for raw in servers:
        assert raw.server is not None
        raw.server.close()


def fixed(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body),
        b"".join(line + b"\r\n" for line in extra),
        body,
    )


def chunked(*parts: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body


async def test_one_connection_serves_request_after_request(serve):
    raw = await serve(lambda request: fixed(b'{"ok":1}', b"Retry-After: 3"))
    pool = UpstreamPool(dial=1)
    for _ in range(3):
        response = await pool.post(raw.url, b'{"a":1}', {"content-type": "application/json"})
        assert response.status == 200 and response.headers["retry-after"] == "3"
        assert await response.read() == b'{"ok":1}'
        response.release()
    assert raw.connections == 1
    request = raw.requests[0]
    assert request.startswith(b"POST /v1/x HTTP/1.1\r\nhost: 127.0.0.1:")
    assert b"content-type: application/json\r\n" in request and request.endswith(b'{"a":1}')
    assert b"accept-encoding" not in request.lower()  # bodies pass through as they are
    await pool.close()


async def test_a_connection_idle_for_keepalive_seconds_of_the_pools_clock_is_not_reused(serve):
    """Idleness is read from the pool's injected clock: a connection idle for less than
    `keepalive` serves the next request, one idle for `keepalive` is closed and a new one
    dialled (the server itself keeps both open)."""
    raw = await serve(lambda request: fixed(b"ok"))
    clock = SteppedClock()
    pool = UpstreamPool(dial=1, keepalive=30.0, clock=clock)
    for wait, connections in ((0.0, 1), (29.9, 1), (30.0, 2)):
        clock.advance(wait)
        response = await pool.post(raw.url, b"{}", {})
        assert await response.read() == b"ok"
        response.release()
        assert raw.connections == connections
    await pool.close()


async def test_chunked_bodies_arrive_as_they_come_and_end_with_an_empty_read(serve):
    raw = await serve(lambda request: chunked(b"data: 1\n\n", b"data: [DONE]\n\n"))
    pool = UpstreamPool(dial=1)
    response = await pool.post(raw.url, b"{}", {})
    received = b""
    while chunk := await response.readany():
        received += chunk
    assert received == b"data: 1\n\ndata: [DONE]\n\n"
    assert await response.readany() == b""
    response.release()
    again = await pool.post(raw.url, b"{}", {})
    assert await again.read() == received
    assert raw.connections == 1


@pytest.mark.parametrize(
    "framing",
    [b"content-type: text/plain", b"transfer-encoding: chunked, gzip"],  # chunked not last
    ids=["no-length", "chunked-not-last"],
)
async def test_a_body_without_length_ends_with_the_connection_which_is_not_reused(serve, framing):
    raw = await serve(
        lambda request: b"HTTP/1.1 200 OK\r\n%s\r\n\r\nuntil close" % framing,
        close_after=True,
    )
    pool = UpstreamPool(dial=1)
    for _ in range(2):
        response = await pool.post(raw.url, b"{}", {})
        assert await response.read() == b"until close"
        response.release()
    assert raw.connections == 2


async def test_connection_close_and_unread_bodies_are_not_reused(serve):
    raw = await serve(lambda request: fixed(b"x" * 10, b"connection: close"), close_after=True)
    pool = UpstreamPool(dial=1)
    response = await pool.post(raw.url, b"{}", {})
    assert await response.read() == b"x" * 10
    response.release()
    other = await serve(lambda request: fixed(b"y" * 5_000_000))
    unread = await pool.post(other.url, b"{}", {})
    unread.release()  # released before its body was in: closed, not pooled
    again = await pool.post(other.url, b"{}", {})
    assert len(await again.read()) == 5_000_000
    assert other.connections == 2


async def test_a_server_that_closed_an_idle_connection_costs_a_new_dial_not_an_error(serve):
    raw = await serve(lambda request: fixed(b"ok"), close_after=True)
    pool = UpstreamPool(dial=1)
    first = await pool.post(raw.url, b"{}", {})
    assert await first.read() == b"ok"
    first.release()  # pooled: no connection: close header came
    await eventually(lambda: first._connection.closed)  # the server's close reached the client
    second = await pool.post(raw.url, b"{}", {})
    assert await second.read() == b"ok"
    assert raw.connections == 2


async def test_a_large_body_arrives_whole_through_paused_reads(serve):
    body = bytes(range(256)) * 8192  # 2 MiB, past the read high-water mark
    raw = await serve(lambda request: fixed(body))
    pool = UpstreamPool(dial=1)
    response = await pool.post(raw.url, b"{}", {})
    assert await response.read() == body
    response.release()


async def test_refused_garbage_and_reset_are_told_apart(serve):
    pool = UpstreamPool(dial=1)
    with pytest.raises(UpstreamConnectError):
        await pool.post(f"http://127.0.0.1:{free_port()}/v1/x", b"{}", {})
    garbage = await serve(lambda request: b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
    with pytest.raises(UpstreamBrokenError) as not_http:
        await pool.post(garbage.url, b"{}", {})
    assert not_http.value.not_http
    reset = await serve(lambda request: None)
    with pytest.raises(UpstreamBrokenError) as broke:
        await pool.post(reset.url, b"{}", {})
    assert not broke.value.not_http


async def test_a_body_cut_short_is_an_error_not_an_end(serve):
    raw = await serve(
        lambda request: b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial", close_after=True
    )
    pool = UpstreamPool(dial=1)
    response = await pool.post(raw.url, b"{}", {})
    with pytest.raises(UpstreamBrokenError):
        await response.read()
    response.close()


async def test_a_header_value_with_a_line_break_is_refused_before_anything_is_sent(serve):
    raw = await serve(lambda request: fixed(b"ok"))
    pool = UpstreamPool(dial=1)
    with pytest.raises(ValueError):
        await pool.post(raw.url, b"{}", {"x-request-id": "a\r\nx-evil: 1"})
    assert raw.connections == 0


async def test_closing_a_response_mid_body_fails_its_reader_even_without_length(serve):
    """A body framed by the connection's end, closed by the gateway (a lost lease closes the
    upstream): its waiting reader gets an error, not an end that would look complete."""
    raw = await serve(lambda request: b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
    pool = UpstreamPool(dial=1)
    response = await pool.post(raw.url, b"{}", {})
    reader = asyncio.ensure_future(response.readany())
    await eventually(lambda: response._connection._waiter is not None)  # waiting for more body
    response.close()
    with pytest.raises(UpstreamBrokenError):
        await reader


async def test_https_upstreams_are_verified_and_kept_alive(serve, monkeypatch):
    """TLS with the server's certificate checked (a test certificate for 127.0.0.1, trusted by
    this pool only); a pool that does not trust it refuses to connect; SSL_CERT_FILE (the
    documented way to name an internal CA) makes the default pool trust it."""
    data = Path(__file__).parent / "data"
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(data / "localhost.crt", data / "localhost.key")
    raw = RawServer(lambda request: fixed(b"secret"))
    raw.server = await asyncio.start_server(raw._serve, "127.0.0.1", 0, ssl=server_side)
    url = raw.url.replace("http://", "https://")
    trusting = UpstreamPool(dial=2, tls=ssl.create_default_context(cafile=data / "localhost.crt"))
    for _ in range(2):
        response = await trusting.post(url, b"{}", {})
        assert await response.read() == b"secret"
        response.release()
    assert raw.connections == 1
    with pytest.raises(UpstreamConnectError):
        await UpstreamPool(dial=2).post(url, b"{}", {})  # the system's trust store
    monkeypatch.setenv("SSL_CERT_FILE", str(data / "localhost.crt"))
    response = await UpstreamPool(dial=2).post(url, b"{}", {})
    assert await response.read() == b"secret"
    raw.server.close()


async def test_garbage_on_an_idle_connection_closes_it_and_the_next_request_dials(serve):
    """Bytes that are not HTTP arriving while a connection sits in the pool: it is closed, not
    handed to the next request with its parser broken."""
    raw = await serve(lambda request: fixed(b"ok") + b"\x00garbage after the answer\r\n\r\n")
    pool = UpstreamPool(dial=1)
    first = await pool.post(raw.url, b"{}", {})
    assert await first.read() == b"ok"
    first.release()
    await eventually(lambda: first._connection.closed)  # the garbage arrived and closed it
    second = await pool.post(raw.url, b"{}", {})
    assert await second.read() == b"ok"
    assert raw.connections == 2


async def test_ipv6_upstreams_get_a_bracketed_host_header():
    try:
        server = await asyncio.start_server(_answer_once, "::1", 0)
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    port = server.sockets[0].getsockname()[1]
    pool = UpstreamPool(dial=1)
    response = await pool.post(f"http://[::1]:{port}/v1/x", b"{}", {})
    assert await response.read() == f"host: [::1]:{port}".encode()
    server.close()


async def _answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers with the request's host header line."""
    head = await reader.readuntil(b"\r\n\r\n")
    host = next(line for line in head.split(b"\r\n") if line.lower().startswith(b"host:"))
    writer.write(fixed(host))
    await writer.drain()
    writer.close()


async def test_a_response_nobody_asked_for_neither_joins_the_answer_nor_the_next(serve):
    """A server that sends a second, valid response after the answer: the answer's body stays
    its own, and the connection is not reused (the stray would be the next request's answer)."""
    raw = await serve(lambda request: fixed(b"hello") + fixed(b"WORLD"))
    pool = UpstreamPool(dial=1)
    for _ in range(2):
        response = await pool.post(raw.url, b"{}", {})
        await eventually(lambda r=response: r._connection.closed)  # the stray came and closed it
        assert await response.read() == b"hello"
        response.release()
    assert raw.connections == 2


async def test_a_connection_paused_at_the_end_of_a_large_body_reads_again_when_reused(serve):
    """A body whose last read passes the high-water mark as the message completes leaves the
    connection paused; the next request on it must read again. A low mark and a body that
    arrives in one read make that state certain (a large body's read sizes are the kernel's)."""
    body = b"x" * 100
    raw = await serve(lambda request: fixed(body))
    pool = UpstreamPool(dial=1, read_high_water=16)
    first = await pool.post(raw.url, b"{}", {})
    await eventually(lambda: first._connection.complete)  # all of it is in; reading paused
    assert first._connection._paused
    first.release()  # complete: back to the pool, its body unread
    async with asyncio.timeout(2):
        second = await pool.post(raw.url, b"{}", {})
        assert await second.read() == body
    assert raw.connections == 1


async def test_a_kept_alive_connection_closed_as_it_is_reused_is_replaced_once(serve):
    """The server closes the connection instead of answering its second request (an idle
    timeout racing the reuse): the request goes once more on a new connection. A new
    connection that breaks the same way is the endpoint's failure."""
    answered = []

    def answer(request: bytes) -> bytes | None:
        answered.append(request)
        return None if len(answered) == 2 else fixed(b"ok")

    raw = await serve(answer)
    pool = UpstreamPool(dial=1)
    first = await pool.post(raw.url, b"{}", {})
    assert await first.read() == b"ok"
    first.release()
    second = await pool.post(raw.url, b"{}", {})
    assert await second.read() == b"ok"
    assert (pool.redials, raw.connections, len(answered)) == (1, 2, 3)
    never = await serve(lambda request: None)
    with pytest.raises(UpstreamBrokenError):
        await pool.post(never.url, b"{}", {})  # a fresh connection: no second try
    assert pool.redials == 1


async def test_a_head_that_does_not_come_within_its_time_ends_the_wait_and_the_connection(serve):
    raw = await serve(lambda request: b"" if b"hang" in request else fixed(b"ok"))  # b"": silence
    pool = UpstreamPool(dial=1)
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(UpstreamTimeout):
        await pool.post(raw.url, b"hang", {}, within=0.2)
    assert 0.2 <= loop.time() - began < 1.5
    response = await pool.post(raw.url, b"{}", {}, within=1)
    assert await response.read() == b"ok"
    assert raw.connections == 2  # the timed-out connection was closed, not reused
    response.release()
    await pool.close()


async def test_a_body_that_stalls_ends_at_its_deadline_and_what_came_is_read_at_once(serve):
    stalled = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc"  # 7 bytes never come
    raw = await serve(lambda request: stalled if b"stall" in request else fixed(b"whole"))
    pool = UpstreamPool(dial=1)
    loop = asyncio.get_running_loop()
    response = await pool.post(raw.url, b"stall", {}, within=1)
    began = loop.time()
    assert await response.readany(began - 1) == b"abc"  # arrived: no wait, so no deadline
    with pytest.raises(UpstreamTimeout):
        await response.readany(began + 0.2)
    assert 0.2 <= loop.time() - began < 1.5
    response.close()
    whole = await pool.post(raw.url, b"{}", {}, within=1)
    await eventually(lambda: whole._connection.complete)
    assert await whole.read(loop.time() - 1) == b"whole"  # all in: a passed deadline is moot
    whole.release()
    again = await pool.post(raw.url, b"stall", {}, within=1)
    with pytest.raises(UpstreamTimeout):
        await again.read(loop.time() + 0.2)
    again.close()
    await pool.close()


async def test_a_response_is_drained_once_all_of_it_came_and_was_read():
    """`drained`: nothing more will come and nothing is left to read (a stream's last read
    needs no wait), not before."""
    more = asyncio.Event()

    async def serve_in_two(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await more.wait()
        writer.write(b"4\r\nlast\r\n0\r\n\r\n")
        await writer.drain()

    server = await asyncio.start_server(serve_in_two, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = UpstreamPool(dial=1)
    try:
        response = await pool.post(f"http://127.0.0.1:{port}/v1/x", b"{}", {})
        assert await response.readany() == b"first"
        assert not response.drained()  # the rest is still to come
        more.set()
        await eventually(lambda: response._connection.complete, what="the rest came")
        assert not response.drained()  # in, but not read yet
        assert await response.readany() == b"last"
        assert response.drained()
        assert await response.readany() == b""
        response.release()
    finally:
        await pool.close()
        server.close()
