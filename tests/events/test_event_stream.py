"""The events stream on a real nats-server: a subscriber that starts late replays, from the start
or from a time, then follows; `llmgw events` prints them; every payload parses."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml
from nats.aio.client import Client as NatsClient
from timing import eventually

from llmgw.config import load_config
from llmgw.event_stream import ensure_events_stream, read_events
from llmgw.events import EventPublisher, PinEvent, PinMoved, parse_event
from llmgw.nats_embedded import EmbeddedNats
from llmgw.services.events.main import run

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "config" / "local.yaml"


def _config(tmp_path: Path, nats_url: str) -> Path:
    data = yaml.safe_load(LOCAL.read_text())
    data["nats"] = {"url": nats_url, "connect_timeout": "1s"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _pin_created(provider: str, n: int) -> dict[str, Any]:
    """The fields of a pin.created event of session s<n>."""
    return {
        "event": "pin.created",
        "provider": provider,
        "model": "m",
        "session": f"s{n}",
        "pin_id": f"p{n}",
        "shard": n,
    }


async def _publish_pins(publisher: EventPublisher, provider: str, sessions: range) -> None:
    for n in sessions:
        assert await publisher.publish(publisher.build(PinEvent, **_pin_created(provider, n)))


async def test_a_late_subscriber_replays_then_follows(
    tmp_path: Path, nats_url: str, nats_client: NatsClient, unique_id: str
) -> None:
    config = load_config(_config(tmp_path, nats_url), env={})
    js = nats_client.jetstream()
    assert await ensure_events_stream(js, config)
    assert await ensure_events_stream(js, config)  # idempotent: every service calls it
    info = await js.stream_info(config.events.stream)
    assert info.config.subjects == ["llmgw.v1.events.>"]
    assert info.config.max_age == config.events.max_age

    publisher = EventPublisher(nats_client, "admission-test")
    await _publish_pins(publisher, unique_id, range(3))  # nobody is subscribed yet
    await nats_client.flush()

    mine = f"llmgw.v1.events.*.*.{unique_id}"
    replayed = [e async for e in read_events(js, config.events.stream, mine)]
    events = [parse_event(e.data) for e in replayed]
    assert [e.session for e in events] == ["s0", "s1", "s2"]  # type: ignore[union-attr]
    assert [e.pending for e in replayed] == [2, 1, 0]

    assert replayed[1].at is not None
    # The stored time, to the microsecond (nats-py rounds the server's nanoseconds).
    since = replayed[1].at - timedelta(microseconds=1)
    later = [e async for e in read_events(js, config.events.stream, mine, since=since)]
    assert [parse_event(e.data).session for e in later] == ["s1", "s2"]  # type: ignore[union-attr]

    async def follow() -> list[str]:
        seen = []
        async for e in read_events(js, config.events.stream, mine, follow=True, idle=0.2):
            seen.append(parse_event(e.data).event)
            if len(seen) == 4:
                return seen
        return seen

    follower = asyncio.create_task(follow())
    moved = publisher.build(
        PinMoved,
        provider=unique_id,
        model="m",
        session="s0",
        pin_id="q0",
        shard=0,
        from_provider="other",
        from_pin_id="p0",
        reason="degraded",
    )
    assert await publisher.publish(moved)
    async with asyncio.timeout(10):
        assert await follower == ["pin.created"] * 3 + ["pin.moved"]


async def test_llmgw_events_prints_what_was_kept(
    tmp_path: Path,
    nats_url: str,
    nats_client: NatsClient,
    unique_id: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _config(tmp_path, nats_url)
    config = load_config(path, env={})
    assert await ensure_events_stream(nats_client.jetstream(), config)
    await _publish_pins(EventPublisher(nats_client, "admission-test"), unique_id, range(2))
    await nats_client.flush()

    def events(*, json_lines: bool, subject: str) -> tuple[int, list[str]]:
        args = argparse.Namespace(
            config=str(path), since="10m", follow=False, subject=subject, json=json_lines
        )
        code = run(args)
        return code, capsys.readouterr().out.splitlines()

    code, lines = await asyncio.to_thread(
        events, json_lines=True, subject=f"pin.created.{unique_id}"
    )
    assert code == 0
    assert [json.loads(line)["session"] for line in lines] == ["s0", "s1"]
    code, lines = await asyncio.to_thread(
        events, json_lines=False, subject=f"llmgw.v1.events.pin.*.{unique_id}"
    )
    assert code == 0 and len(lines) == 2
    assert lines[0].split(" ")[1] == f"llmgw.v1.events.pin.created.{unique_id}"
    code, lines = await asyncio.to_thread(events, json_lines=True, subject="nothing.here.x")
    assert (code, lines) == (0, [])


async def test_emitted_events_arrive_in_order_within_and_across_loop_turns(
    nats_client: NatsClient, unique_id: str
) -> None:
    """`emit` (the hot path) sends nothing in the caller's turn; what one turn emits goes out in
    order from one task at the next, and what a later turn emits after it."""
    seen: list[str] = []

    async def received(msg: Any) -> None:
        seen.append(parse_event(msg.data).session)  # type: ignore[union-attr]

    sub = await nats_client.subscribe(f"llmgw.v1.events.*.*.{unique_id}", cb=received)
    publisher = EventPublisher(nats_client, "admission-test")

    for n in range(3):
        publisher.emit(PinEvent, **_pin_created(unique_id, n))
    assert publisher.published == 0  # not in the emitting turn
    await asyncio.sleep(0)  # the next turn: the batch is handed to the client
    publisher.emit(PinEvent, **_pin_created(unique_id, 3))
    await asyncio.sleep(0)
    await nats_client.flush()
    await eventually(lambda: len(seen) == 4, 5, "the four events")
    assert seen == ["s0", "s1", "s2", "s3"] and publisher.published == 4
    await sub.unsubscribe()


async def test_a_server_that_cannot_reserve_the_stream_says_what_to_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NATS reserves a file stream's max_bytes whole when it creates it: on a server that may
    store less (a small disk), the stream is refused and the warning says which limit to
    change; the same stream with a max_bytes that fits is created."""
    conf = tmp_path / "nats.conf"
    conf.write_text("jetstream { max_file_store: 64MB }\n")
    async with EmbeddedNats(extra_args=("-c", str(conf))) as server:
        client = await nats.connect(server.url)
        try:
            js = client.jetstream()
            config = load_config(_config(tmp_path, server.url), env={})
            assert config.events.max_bytes == 256 * 2**20  # the default, more than 64 MB
            with caplog.at_level(logging.WARNING, logger="llmgw.state.streams"):
                assert not await ensure_events_stream(js, config)
            (warning,) = [r.getMessage() for r in caplog.records if "not available" in r.message]
            assert "insufficient storage" in warning and "(256 MiB)" in warning
            assert "set a smaller max_bytes" in warning and "max_file_store" in warning
            assert "events are published live only" in warning

            smaller = load_config(
                _config(tmp_path, server.url), env={"LLMGW_EVENTS__MAX_BYTES": str(32 * 2**20)}
            )
            assert await ensure_events_stream(js, smaller)
            info = await js.stream_info(smaller.events.stream)
            assert info.config.max_bytes == 32 * 2**20
        finally:
            await client.close()
