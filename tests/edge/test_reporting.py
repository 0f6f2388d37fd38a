"""The edge's end reporter (services/edge/reporting.py) on a real nats-server: an end settled by
the colocated instance waits at most `hold` to share a flush; an end whose lease is another
instance's goes at once and takes the held ones with it; stopping sends what is held."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
import pytest
import pytest_asyncio
from inproc import connect

from llmgw.services.edge.reporting import NatsReporter
from llmgw.wire import REQUEST_STATS_SUBJECT, RequestEnded

LONG_HOLD = 30.0  # far beyond the test: a held end leaves only when something sends it


def ended(attempt: str, lease: str | None) -> RequestEnded:
    return RequestEnded(
        id=attempt,
        edge="edge-r",
        lease=lease,
        ok=True,
        outcome="success",
        model="m1",
        provider="p1",
        endpoint="e1",
        ended_at=time.time(),
    )


async def received(
    sub: Any, count: int, timeout: float = 15.0, reporter: NatsReporter | None = None
) -> list[str]:
    """The ids of the next `count` ends on `sub`, each within `timeout` (half of LONG_HOLD: an
    end that arrives was not held); on a timeout, what both connections say they moved."""
    ids = []
    for _ in range(count):
        try:
            ids.append(RequestEnded.model_validate_json((await sub.next_msg(timeout)).data).id)
        except nats.errors.TimeoutError:
            pytest.fail(
                f"received {ids} of {count} ends within {timeout}s; {_state(sub, reporter)}"
            )
    return ids


def _state(sub: Any, reporter: NatsReporter | None) -> str:
    listener = sub._conn
    state = (
        f"listener connected {listener.is_connected}, in_msgs {listener.stats['in_msgs']}, "
        f"pending {sub.pending_msgs}"
    )
    if reporter is not None:
        nc = reporter._nc
        state += (
            f"; reporter sent {reporter.sent}, failed {reporter.failures}, connected "
            f"{nc.is_connected}, out_msgs {nc.stats['out_msgs']}, unflushed bytes "
            f"{nc._pending_data_size}"
        )
    return state


@pytest_asyncio.fixture
async def wired(nats_url: str) -> AsyncIterator[tuple[Any, Any]]:
    """The reporter's connection, and a subscription to the ends on another one."""
    nc = await connect(nats_url, "reporter")
    listener = await connect(nats_url, "listener")
    try:
        sub = await listener.subscribe(REQUEST_STATS_SUBJECT)
        await listener.flush()
        yield nc, sub
    finally:
        await nc.close()
        await listener.close()


async def test_held_ends_leave_with_an_urgent_one_or_at_drain(wired: tuple[Any, Any]):
    nc, sub = wired
    applied: list[str] = []

    def local(message: RequestEnded) -> bool:  # settles leases named "here-*" in process
        applied.append(message.id)
        return message.lease is None or message.lease.startswith("here-")

    reporter = NatsReporter(nc, local=local, hold=LONG_HOLD)
    reporter.report(ended("a1", "here-1"))
    reporter.report(ended("a2", None))
    await nc.flush()
    assert applied == ["a1", "a2"]  # in process at once
    assert sub.pending_msgs == 0 and reporter.sent == 0  # held: nothing waits for them
    reporter.report(ended("a3", "elsewhere-1"))  # the owner is another instance
    # it goes now, with the held ones
    assert await received(sub, 3, reporter=reporter) == ["a1", "a2", "a3"]
    reporter.report(ended("a4", "here-2"))
    await asyncio.sleep(0)
    assert reporter.sent == 3
    await reporter.drain()
    assert await received(sub, 1, reporter=reporter) == ["a4"] and reporter.sent == 4


async def test_without_a_colocated_instance_every_end_goes_at_once(wired: tuple[Any, Any]):
    nc, sub = wired
    reporter = NatsReporter(nc, hold=LONG_HOLD)
    reporter.report(ended("b1", "lease-1"))
    reporter.report(ended("b2", None))
    assert await received(sub, 2, reporter=reporter) == ["b1", "b2"]
