"""The edge's end reporter (services/edge/reporting.py) on a real nats-server: an end settled by
the colocated instance waits at most `hold` to share a flush; an end whose lease is another
instance's goes at once and takes the held ones with it; stopping sends what is held. An attempt
that ended `model_unloaded` asks the reapers to read that engine's model list again, once per
endpoint and model per `STALE_EVERY` seconds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
import pytest
import pytest_asyncio
from inproc import connect

from llmgw.services.edge.reporting import STALE_EVERY, NatsReporter, NoticeGate
from llmgw.wire import MODELS_STALE_SUBJECT, REQUEST_STATS_SUBJECT, ModelsStale, RequestEnded

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
    """The reporter's connection, and a subscription to the ends on it: the server has its
    SUB before any of the reporter's PUBs (on another connection, a flush could return before
    the server applied the subscription, and an early end was lost)."""
    nc = await connect(nats_url, "reporter")
    try:
        sub = await nc.subscribe(REQUEST_STATS_SUBJECT)
        await nc.flush()
        yield nc, sub
    finally:
        await nc.close()


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


def test_a_notice_goes_first_then_once_per_window_per_endpoint_and_model():
    gate = NoticeGate(every=1.0)
    assert gate.due(("e1", "m"), 100.0)
    assert not gate.due(("e1", "m"), 100.5)  # the same burst
    assert gate.due(("e2", "m"), 100.5) and gate.due(("e1", "other"), 100.5)
    assert gate.due(("e1", "m"), 101.0)  # a window later
    assert not gate.due(("e1", "m"), 101.9)


def unloaded(attempt: str, endpoint: str = "e1") -> RequestEnded:
    return ended(attempt, None).model_copy(
        update={"ok": False, "outcome": "model_unloaded", "status": 404, "endpoint": endpoint,
                "served_model": "m1-lora"}
    )  # fmt: skip


async def test_a_burst_of_model_unloaded_ends_is_one_notice_per_window(wired: tuple[Any, Any]):
    nc, sub = wired
    # On the reporter's own connection: the server has the interest before its first publish
    # (another connection's flush may return before its SUB reached the server).
    notices = await nc.subscribe(MODELS_STALE_SUBJECT)
    await nc.flush()
    now = [50.0]
    # Held ends (settled in process): a notice does not wait for the hold.
    reporter = NatsReporter(
        nc, local=lambda _: True, hold=LONG_HOLD, scope="fleet_x", clock=lambda: now[0]
    )
    for n in range(4):  # a burst: four engines' 404s within the window
        reporter.report(unloaded(f"u{n}"))
    reporter.report(unloaded("v1", endpoint="e2"))
    assert await received(sub, 5, reporter=reporter) == ["u0", "u1", "u2", "u3", "v1"]
    got = [ModelsStale.model_validate_json((await notices.next_msg(5)).data) for _ in range(2)]
    assert [(g.endpoint, g.model, g.scope, g.edge) for g in got] == [
        ("e1", "m1-lora", "fleet_x", "edge-r"),
        ("e2", "m1-lora", "fleet_x", "edge-r"),
    ]
    now[0] += STALE_EVERY  # the next window: the next 404 of e1 is news again
    reporter.report(unloaded("u9"))
    assert await received(sub, 1, reporter=reporter) == ["u9"]
    again = ModelsStale.model_validate_json((await notices.next_msg(5)).data)
    assert again.endpoint == "e1"
    reporter.report(ended("s1", "here-1"))  # a success: no notice, held as before
    await nc.flush()
    assert sub.pending_msgs == 0
    await reporter.drain()  # sends the held end, and waits for every publication
    assert await received(sub, 1, reporter=reporter) == ["s1"]
    await nc.flush()
    assert notices.pending_msgs == 0 and reporter.notices == 3
