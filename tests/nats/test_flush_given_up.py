"""A flush that gives up (its timeout passed, or its caller was cancelled) must not break the
connection: the server's PONG for it arrives later, and nats-py sets a result on the flush's
cancelled future, which ends the client's read loop. The connection then looks connected and
reads nothing (requests time out, subscriptions go silent). `llmgw.natsconn`'s connections
consume such a PONG quietly."""

from __future__ import annotations

import asyncio

import nats

from llmgw import natsconn
from llmgw.config.sections import NatsConfig


async def _cancelled_flush(nc: nats.aio.client.Client) -> None:
    """A flush whose PING has left, cancelled before its PONG comes back."""
    flush = asyncio.ensure_future(nc.flush(timeout=5))
    await asyncio.sleep(0)  # one turn: its PING is out and its future waits for the PONG
    assert nc._pongs and not flush.done()
    flush.cancel()
    await asyncio.gather(flush, return_exceptions=True)


async def _still_reads(nc: nats.aio.client.Client) -> bool:
    async def echo(msg: nats.aio.msg.Msg) -> None:
        await msg.respond(msg.data)

    sub = await nc.subscribe("llmgw.test.echo", cb=echo)
    try:
        for _ in range(3):
            reply = await nc.request("llmgw.test.echo", b"ping", timeout=2)
            assert reply.data == b"ping"
        await nc.flush(timeout=2)
    except (nats.errors.TimeoutError, nats.errors.FlushTimeoutError):
        return False
    finally:
        await sub.unsubscribe()
    return True


async def test_a_connection_survives_a_flush_cancelled_before_its_pong(nats_url: str) -> None:
    nc = await natsconn.connect(NatsConfig(url=nats_url), "flush-given-up")
    try:
        for _ in range(3):
            await _cancelled_flush(nc)
            assert await _still_reads(nc)
    finally:
        await nc.close()


async def test_the_plain_client_breaks_so_the_fix_is_needed(nats_url: str) -> None:
    """What the test above guards against, with nats-py's own client: when this starts to
    pass (a nats-py release fixed it), the workaround in `llmgw.natsconn` can go."""
    nc = await nats.connect(nats_url)
    try:
        await _cancelled_flush(nc)
        assert not await _still_reads(nc)
    finally:
        await nc.close()
