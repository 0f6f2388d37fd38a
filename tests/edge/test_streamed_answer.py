"""The client's side of a stream (`StreamedAnswer`): each chunk as it comes; what comes once the
upstream is drained goes with the end, in one send."""

from __future__ import annotations

import asyncio
from typing import Any

from llmgw.services.edge.streamed import StreamedAnswer


class Upstream:
    def __init__(self) -> None:
        self.closed = 0
        self.drained = False

    def close(self) -> None:
        self.closed += 1


async def answer(chunks: list[bytes], drained_after: int | None) -> tuple[list[dict], Any, int]:
    """The ASGI messages sent for a body of `chunks` whose upstream is drained once
    `drained_after` of them were yielded (None: never), the upstream, and on_end's calls."""
    upstream = Upstream()
    ended = []

    async def body():  # type: ignore[no-untyped-def]
        for n, chunk in enumerate(chunks):
            upstream.drained = drained_after is not None and n + 1 >= drained_after
            yield chunk

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client stays
        return {}

    streamed = StreamedAnswer(
        body(),
        lambda: ended.append(1),
        upstream,
        headers={"content-type": "text/event-stream"},
        drained=lambda: upstream.drained,
    )
    await streamed({"type": "http"}, receive, send)
    return sent, upstream, len(ended)


async def test_each_chunk_goes_as_it_comes_while_the_upstream_sends():
    sent, upstream, ended = await answer([b"a", b"b", b"c"], drained_after=None)
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 4
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (b"a", True),
        (b"b", True),
        (b"c", True),
        (b"", False),
    ]
    assert ended == 1 and upstream.closed == 1


async def test_what_comes_once_the_upstream_is_drained_goes_with_the_end():
    sent, _, ended = await answer([b"a", b"b", b"c"], drained_after=2)
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [(b"a", True), (b"bc", False)]
    whole, _, _ = await answer([b"a", b"b"], drained_after=1)  # an engine that sent it at once
    assert [(m["body"], m["more_body"]) for m in whole[1:]] == [(b"ab", False)]
    assert ended == 1
