"""Shared pieces of the reaper tests: the test config, session ids, and a collector of the
routing events published on NATS."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import yaml
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from llmgw.events import ALL_EVENTS_SUBJECT, EVENTS_SUBJECT_PREFIX, Event, EventName, parse_event

REPO = Path(__file__).resolve().parents[2]
LOCAL_CONFIG = REPO / "config" / "local.yaml"
MODEL = "llama-3.3-70b"  # dots: never raw in a key
IRIS = "iris"  # limits in config/local.yaml: P=200, G=64, R=16, S=4
TENSORX = "tensorx"  # no limits
WAIT = 10.0  # bound on one awaited condition, never a sleep

Connect = Callable[[], Awaitable[NatsClient]]


def session_id(n: int) -> str:
    """A session id as the edge makes them: a hex hash (a safe key token)."""
    return f"{n:032x}"


def config_data(nats_url: str, bucket: str, **pinning: Any) -> dict[str, Any]:
    """config/local.yaml on `nats_url` and `bucket`: lease timeout 1s, pin inactivity 2s,
    a reaper pass every 100ms (overridable)."""
    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    data["nats"] = {"url": nats_url}
    data["pinning"] = {
        "bucket": bucket,
        "lease_timeout": "1s",
        "pin_inactivity_timeout": "2s",
        "reaper_interval": "100ms",
        **pinning,
    }
    return data


class EventLog:
    """Every routing event received on `llmgw.v1.events.>`, in arrival order.

    `sync(*publishers)` returns once every event those connections published before the call
    has been received: it flushes each publisher (the server has routed what they sent), then
    sends a marker through the same subscription, which arrives after all of it.
    """

    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc
        self.events: list[Event] = []
        self._changed = asyncio.Condition()
        self._markers = 0
        self._markers_seen = 0

    async def start(self) -> EventLog:
        await self._nc.subscribe(ALL_EVENTS_SUBJECT, cb=self._on_message)
        await self._nc.flush()
        return self

    async def _on_message(self, msg: Msg) -> None:
        async with self._changed:
            if msg.subject.startswith(f"{EVENTS_SUBJECT_PREFIX}._marker."):
                self._markers_seen += 1
            else:
                self.events.append(parse_event(msg.data))
            self._changed.notify_all()

    def named(self, name: EventName) -> list[Event]:
        return [e for e in self.events if e.event == name]

    async def wait_until(
        self, predicate: Callable[[EventLog], bool], timeout: float = WAIT
    ) -> None:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: predicate(self))

    async def sync(self, *publishers: NatsClient) -> list[Event]:
        for publisher in publishers:
            await publisher.flush()
        self._markers += 1
        wanted = self._markers
        await self._nc.publish(f"{EVENTS_SUBJECT_PREFIX}._marker.{wanted}", b"")
        async with asyncio.timeout(WAIT), self._changed:
            await self._changed.wait_for(lambda: self._markers_seen >= wanted)
        return list(self.events)
