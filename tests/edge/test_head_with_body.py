"""A response's head goes out with its first body bytes, in one write (`HeadWithBody`)."""

import asyncio

import uvicorn
from uvicorn.server import ServerState

from llmgw.services.edge.hardening import HeadWithBody, OpenAIErrorsHttpTools

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


class Recorder:
    """A transport that records each write (what reaches the socket, call by call)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name, default=None):
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def test_the_head_waits_for_the_body_and_goes_with_it():
    recorder = Recorder()
    transport = HeadWithBody(recorder)
    transport.write(HEAD)
    assert recorder.writes == []
    transport.write(b"{}")
    transport.write(b"more")
    assert recorder.writes == [HEAD + b"{}", b"more"]
    await asyncio.sleep(0)  # the turn's fallback finds nothing held
    assert recorder.writes == [HEAD + b"{}", b"more"]


async def test_a_head_without_a_body_in_its_turn_goes_alone_at_the_next():
    recorder = Recorder()
    transport = HeadWithBody(recorder)
    transport.write(HEAD)
    await asyncio.sleep(0)
    assert recorder.writes == [HEAD]
    transport.write(b"{}")  # a body that came later: after the head, never before it
    assert recorder.writes == [HEAD, b"{}"]


async def test_100_continue_is_not_held_and_close_sends_what_is():
    recorder = Recorder()
    transport = HeadWithBody(recorder)
    transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert recorder.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    transport.write(HEAD)
    transport.close()
    assert recorder.writes[-1] == HEAD and recorder.closed
    assert transport.is_closing()  # everything else is the real transport's


async def test_the_edge_protocol_writes_each_response_once():
    """uvicorn's own request cycle, run by the edge's protocol class on a recording transport:
    a response sent as head then body reaches the transport as one write."""

    async def app(scope, receive, send):
        await receive()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await send({"type": "http.response.body", "body": b"{}"})

    config = uvicorn.Config(app, http=OpenAIErrorsHttpTools, log_config=None, lifespan="off")
    config.load()
    protocol = OpenAIErrorsHttpTools(config=config, server_state=ServerState(), app_state={})
    recorder = Recorder()
    protocol.connection_made(recorder)
    protocol.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    for _ in range(100):  # the ASGI task runs at the next turns
        if recorder.writes:
            break
        await asyncio.sleep(0)
    [written] = recorder.writes
    assert written.startswith(b"HTTP/1.1 200 OK\r\n") and written.endswith(b"\r\n\r\n{}")
