"""The scraper republishing engines' KV cache events into the prefix stream, end to end: the
whole scraper (`serve`) against vLLM-format publishers (real ZMQ sockets, both encodings) and
a real NATS server; what the stream holds is read back with a JetStream consumer and applied
to a `HeldIndex` as admission does."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError
from scraper_helpers import WAIT, config_data, running_scraper
from timing import SteppedClock
from vllm_kv import VllmKvPublisher, encode_batch, removed, stored

from llmgw.config import Config, config_from_dict
from llmgw.config.catalog import EndpointConfig
from llmgw.core.prefix import HeldIndex, token_chain, token_root, unpack
from llmgw.fleet import FleetRecord
from llmgw.prefix_stream import ensure_prefix_stream
from llmgw.services.scraper.kv_events import KvEvents, KvEventsSettings, StreamSink
from llmgw.services.scraper.metrics import ScraperMetrics
from llmgw.services.scraper.reports import kv_event_sources
from llmgw.state.fleet import open_fleet
from llmgw.wire import PrefixHeld, prefix_held_subject

BS = 16
NOWHERE = "http://127.0.0.1:9"  # the endpoints' HTTP side answers nothing: not what is tested


class HeldLog:
    """Every PrefixHeld the prefix stream holds, in stream order (an ordered consumer from the
    stream's start), and what they add up to per endpoint, applied as admission applies them."""

    def __init__(self) -> None:
        self.messages: list[PrefixHeld] = []
        self.index = HeldIndex()
        self._changed = asyncio.Condition()
        self._subscription: JetStreamContext.PushSubscription | None = None

    async def start(self, nc: NatsClient, stream: str) -> HeldLog:
        self._subscription = await nc.jetstream().subscribe(
            prefix_held_subject(stream, "*"), stream=stream, ordered_consumer=True, cb=self._on
        )
        return self

    async def stop(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()

    async def _on(self, msg: Msg) -> None:
        held = PrefixHeld.model_validate_json(msg.data)
        if held.cleared:
            self.index.clear(held.endpoint)
        self.index.store(held.endpoint, unpack(held.stored))
        self.index.remove(held.endpoint, unpack(held.removed))
        async with self._changed:
            self.messages.append(held)
            self._changed.notify_all()

    def of(self, endpoint: str) -> list[PrefixHeld]:
        return [m for m in self.messages if m.endpoint == endpoint]

    def holds(self, endpoint: str, chain: list[int]) -> bool:
        return self.index.match(endpoint, chain) == len(chain)

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = WAIT) -> None:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(predicate)

    async def wait_for_count(self, endpoint: str, count: int) -> None:
        await self.wait_until(lambda: len(self.of(endpoint)) >= count)


def chain(tokens: list[int], adapter: str | None = None) -> list[int]:
    return token_chain(tokens, BS, parent=token_root(adapter))


def prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BS)]


def engine_hashes(seed: int, blocks: int) -> list[int]:
    """Engine block hashes: unrelated to ours, large enough to need all 64 bits."""
    return [(0xF00D << 48) + seed * 100 + i for i in range(blocks)]


@dataclass
class KvEnv:
    """One test's pieces: NATS, the test's load bucket and provider, a prefix stream name
    (the stream is the scraper's to create), and vLLM-format publishers."""

    nats_url: str
    nats: NatsClient
    bucket: str
    provider: str
    stream: str
    publishers: list[VllmKvPublisher] = field(default_factory=list)

    async def engine(self, **options: Any) -> VllmKvPublisher:
        publisher = await VllmKvPublisher(**options).start()
        self.publishers.append(publisher)
        return publisher

    def config(self, engines: dict[str, VllmKvPublisher], *, replay: bool = True) -> Config:
        """A scraper's config reading `engines` (endpoint -> publisher), with or without their
        replay sockets."""
        data = config_data(
            self.nats_url, self.bucket, self.provider, dict.fromkeys(engines, NOWHERE)
        )
        data["prefix"] = {"stream": self.stream}
        for endpoint in data["endpoints"]:
            publisher = engines.get(endpoint["id"])
            if publisher is not None:
                endpoint["kv_events"] = {
                    "endpoint": publisher.endpoint,
                    "replay_endpoint": publisher.replay_endpoint if replay else None,
                    "topic": publisher.topic.decode(),
                }
        return config_from_dict(data, env={})

    @contextlib.asynccontextmanager
    async def scraping(
        self, engines: dict[str, VllmKvPublisher], *, replay: bool = True
    ) -> AsyncIterator[tuple[HeldLog, ScraperMetrics]]:
        """The whole scraper reading `engines`, once each is subscribed; the stream's log."""
        config = self.config(engines, replay=replay)
        metrics = ScraperMetrics()
        async with running_scraper(config, instance="kv-test", metrics=metrics):
            for engine in engines.values():
                await engine.wait_subscribed()
            yield await HeldLog().start(self.nats, self.stream), metrics


@pytest_asyncio.fixture
async def kv(
    nats_url: str, nats_client: NatsClient, load_bucket: str, unique_id: str
) -> AsyncIterator[KvEnv]:
    """The test's `KvEnv`, with a prefix stream of its own (its subjects are the stream's),
    deleted after."""
    js = nats_client.jetstream()
    env = KvEnv(nats_url, nats_client, load_bucket, unique_id, f"prefix_{unique_id}")
    yield env
    for publisher in env.publishers:
        await publisher.close()
    with contextlib.suppress(NotFoundError):
        await js.delete_stream(env.stream)


def sample(metrics: ScraperMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def batches(metrics: ScraperMetrics, endpoint: str, result: str) -> float:
    return sample(metrics, "llmgw_scraper_kv_batches_total", endpoint=endpoint, result=result)


async def test_engines_events_reach_the_stream_as_our_token_chains_in_either_encoding(
    kv: KvEnv,
) -> None:
    positional = await kv.engine(encoding="array")
    tagged = await kv.engine(encoding="map")
    engines = {"engine-a": positional, "engine-b": tagged}
    async with kv.scraping(engines) as (log, metrics):
        for endpoint in engines:  # what was published before cannot be resolved: cleared
            await log.wait_for_count(endpoint, 1)
            assert log.of(endpoint)[0].cleared and not log.of(endpoint)[0].stored

        first, second = prompt(1, 3), prompt(2, 2)
        h1, h2 = engine_hashes(1, 3), engine_hashes(2, 2)
        for engine, hashes in ((positional, "i64"), (tagged, "bytes")):
            # A prompt stored over two events (the second continues the first), another one
            # for an adapter, the first one's last block stored twice then removed once.
            await engine.publish([stored(h1[:2], None, first[: 2 * BS], BS)], hashes=hashes)
            await engine.publish(
                [
                    stored(h1[2:], h1[1], first[2 * BS :], BS),
                    stored(h2, None, second + [5] * 3, BS, lora_name="sql-lora"),
                    stored(h1[2:], h1[1], first[2 * BS :], BS),
                    removed(h1[2:]),
                ],
                hashes=hashes,
            )
        for endpoint in engines:
            await log.wait_until(
                lambda e=endpoint: (
                    log.holds(e, chain(first)) and log.holds(e, chain(second, "sql-lora"))
                )
            )
            assert log.index.size(endpoint) == 5
            last = log.of(endpoint)[-1]
            assert last.seq == 1 and last.block_size == BS
            assert batches(metrics, endpoint, "joined") == 1
            assert batches(metrics, endpoint, "applied") == 1
            assert sample(metrics, "llmgw_scraper_kv_blocks", endpoint=endpoint) == 5

        # The second copy goes: our hash of it goes with it.
        await tagged.publish([removed(h1[2:])])
        await log.wait_until(lambda: not log.holds("engine-b", chain(first)))
        assert log.holds("engine-b", chain(first[: 2 * BS])) and log.index.size("engine-b") == 4
        assert log.holds("engine-a", chain(first))
        assert sample(metrics, "llmgw_scraper_kv_lag_seconds_count", endpoint="engine-b") == 3


@pytest.mark.parametrize("frames", [3, 2], ids=["replay-as-vllm-0.26", "replay-as-before"])
async def test_a_gap_is_filled_by_a_replay_without_clearing(frames: int, kv: KvEnv) -> None:
    engine = await kv.engine(replay_frames=frames)
    async with kv.scraping({"engine-a": engine}) as (log, metrics):
        parts = [prompt(i, 1) for i in range(4)]
        hashes = [engine_hashes(i, 1) for i in range(4)]
        await engine.publish([stored(hashes[0], None, parts[0], BS)])
        await log.wait_until(lambda: log.holds("engine-a", chain(parts[0])))
        await engine.skip([stored(hashes[1], None, parts[1], BS)])  # seq 1, 2: missed
        await engine.skip([stored(hashes[2], None, parts[2], BS)])
        await engine.publish([stored(hashes[3], None, parts[3], BS)])
        await log.wait_until(lambda: log.holds("engine-a", chain(parts[3])))
        assert all(log.holds("engine-a", chain(p)) for p in parts)
        assert [m.cleared for m in log.of("engine-a")] == [True, False, False]
        assert engine.replays == [1]
        assert batches(metrics, "engine-a", "gap_filled") == 1
        assert (
            sample(metrics, "llmgw_scraper_kv_replays_total", endpoint="engine-a", result="filled")
            == 1
        )


@pytest.mark.parametrize("replay", [True, False], ids=["beyond-the-buffer", "no-replay-endpoint"])
async def test_a_gap_no_replay_can_fill_clears_then_applies_what_follows(
    replay: bool, kv: KvEnv
) -> None:
    engine = await kv.engine(buffer_steps=1)  # replays only the last batch
    async with kv.scraping({"engine-a": engine}, replay=replay) as (log, metrics):
        old, missed, new = prompt(1, 2), prompt(2, 1), prompt(3, 1)
        await engine.publish([stored(engine_hashes(1, 2), None, old, BS)])
        await log.wait_until(lambda: log.holds("engine-a", chain(old)))
        await engine.skip([stored(engine_hashes(2, 1), None, missed, BS)])
        await engine.skip([removed(engine_hashes(1, 2)[1:])])  # unknown: must not be held
        await engine.publish([stored(engine_hashes(3, 1), None, new, BS)])
        await log.wait_until(lambda: log.holds("engine-a", chain(new)))
        cleared = log.of("engine-a")[-1]
        assert cleared.cleared and unpack(cleared.stored) == tuple(chain(new))
        assert log.index.size("engine-a") == 1
        assert batches(metrics, "engine-a", "gap_lost") == 1
        lost = sample(metrics, "llmgw_scraper_kv_replays_total", endpoint="engine-a", result="lost")
        assert (engine.replays, lost) == (([1], 1) if replay else ([], 0))


async def test_a_restart_clears_whether_seen_as_the_connection_or_the_sequence(kv: KvEnv) -> None:
    engine = await kv.engine()
    async with kv.scraping({"engine-a": engine}) as (log, metrics):
        before, after, again = prompt(1, 2), prompt(2, 1), prompt(3, 1)
        for i in range(3):
            await engine.publish([stored(engine_hashes(10 + i, 1), None, prompt(10 + i, 1), BS)])
        await engine.publish([stored(engine_hashes(1, 2), None, before, BS)])
        await log.wait_until(lambda: log.holds("engine-a", chain(before)))
        held = len(log.of("engine-a"))

        # The publisher goes away and comes back (the engine restarted): cleared, then applied.
        await engine.restart()
        await log.wait_for_count("engine-a", held + 1)
        assert log.of("engine-a")[held].cleared and log.index.size("engine-a") == 0
        await engine.wait_subscribed()
        await engine.publish([stored(engine_hashes(2, 1), None, after, BS)])
        await log.wait_until(lambda: log.holds("engine-a", chain(after)))
        assert log.index.size("engine-a") == 1
        assert batches(metrics, "engine-a", "joined") == 2

        # The sequence goes back on the same connection: a restart all the same.
        engine.restart_sequence()
        await engine.publish([stored(engine_hashes(3, 1), None, again, BS)])
        await log.wait_until(lambda: log.holds("engine-a", chain(again)))
        assert log.of("engine-a")[-1].cleared and log.index.size("engine-a") == 1
        assert batches(metrics, "engine-a", "restarted") == 1


async def test_malformed_messages_are_counted_and_degrade_only_their_endpoint(kv: KvEnv) -> None:
    broken, fine = await kv.engine(), await kv.engine()
    engines = {"engine-a": broken, "engine-b": fine}
    async with kv.scraping(engines) as (log, metrics):
        first, second, third = prompt(1, 1), prompt(2, 1), prompt(3, 1)
        await broken.publish([stored(engine_hashes(1, 1), None, first, BS)])
        await log.wait_until(lambda: log.holds("engine-a", chain(first)))
        # Garbage that takes no sequence number, a storm of it, then a good batch: applied.
        topic, seq = broken.topic, broken.seq.to_bytes(8, "big")
        garbage = [[topic], [topic, b"\x01", b""], [topic, seq, b"\xc1"], [topic, seq, b"\x93\x01"]]
        for _ in range(500):
            for frames in garbage:
                await broken.send_frames(frames)
        await broken.send_frames([topic + b"-2", seq, encode_batch([])])  # another engine's
        await fine.publish([stored(engine_hashes(9, 1), None, third, BS)])
        await broken.publish([stored(engine_hashes(2, 1), None, second, BS)])
        await log.wait_until(lambda: log.holds("engine-a", chain(second)))
        assert log.holds("engine-a", chain(first)) and not log.of("engine-a")[-1].cleared
        assert batches(metrics, "engine-a", "malformed") == 2000
        assert batches(metrics, "engine-a", "other_topic") == 1
        assert batches(metrics, "engine-a", "applied") == 1
        await log.wait_until(lambda: log.holds("engine-b", chain(third)))
        assert batches(metrics, "engine-b", "malformed") == 0

        # A batch the engine sent unreadable took its sequence number: what follows finds a
        # gap its replay cannot fill (the replayed batch is as unreadable): cleared, applied.
        await broken.publish_payload(b"\xc1")
        await broken.publish([stored(engine_hashes(3, 1), None, third, BS)])
        await log.wait_until(lambda: log.holds("engine-a", chain(third)))
        assert log.of("engine-a")[-1].cleared and log.index.size("engine-a") == 1
        assert batches(metrics, "engine-a", "gap_lost") == 1


async def test_endpoints_added_and_removed_in_the_live_fleet_start_and_stop_their_readers(
    kv: KvEnv,
) -> None:
    first, added = await kv.engine(), await kv.engine()
    async with kv.scraping({"engine-a": first}) as (log, metrics):
        fleet = await open_fleet(kv.nats, kv.config({"engine-a": first}))
        endpoint = EndpointConfig.model_validate(
            {
                "id": "engine-new",
                "url": NOWHERE,
                "provider": kv.provider,
                "models": ["m1"],
                "pool": "gpu/a",
                "kv_events": {"endpoint": added.endpoint, "topic": added.topic.decode()},
            }
        )
        await fleet.add(FleetRecord(endpoint=endpoint))
        await added.wait_subscribed()
        tokens = prompt(4, 2)
        await added.publish([stored(engine_hashes(4, 2), None, tokens, BS)])
        await log.wait_until(lambda: log.holds("engine-new", chain(tokens)))
        assert batches(metrics, "engine-new", "joined") == 1

        await fleet.remove("engine-new")  # its reader stops; its blocks are no one's now
        count = len(log.of("engine-new"))
        await log.wait_for_count("engine-new", count + 1)
        assert log.of("engine-new")[-1].cleared and log.index.size("engine-new") == 0
        await added.wait_unsubscribed()  # its reader's socket is closed
        assert first.unsubscriptions == 0


class CountingSink(StreamSink):
    """The stream's sink, telling the test how many updates it found not stored."""

    def __init__(
        self, js: JetStreamContext, stream: str, *, ack_timeout: float, clock: SteppedClock
    ) -> None:
        super().__init__(js, stream, ack_timeout=ack_timeout, clock=clock)
        self.lost_total = 0
        self._changed = asyncio.Event()

    def lost(self, endpoint: str) -> int:
        count = super().lost(endpoint)
        if count:
            self.lost_total += count
            self._changed.set()
        return count

    async def wait_lost(self, count: int) -> None:
        async with asyncio.timeout(WAIT):
            while self.lost_total < count:
                self._changed.clear()
                await self._changed.wait()


async def test_lost_acks_and_the_snapshot_interval_republish_all_an_endpoint_holds(
    kv: KvEnv,
) -> None:
    """The readers alone (`KvEvents`), their intervals on a stepped timer: a snapshot every
    `snapshot_interval`, and one (repeated every `resync_interval` while it fails) once an
    update's ack is lost: here, the stream was deleted under it and created again."""
    engine = await kv.engine()
    config = kv.config({"engine-a": engine})
    js = kv.nats.jetstream()
    assert await ensure_prefix_stream(js, config)
    timer = SteppedClock(1000.0)
    settings = KvEventsSettings(
        tick=0.02, snapshot_interval=100.0, resync_interval=10.0, ack_timeout=5.0
    )
    metrics = ScraperMetrics()
    sink = CountingSink(js, kv.stream, ack_timeout=settings.ack_timeout, clock=timer)
    readers = KvEvents(
        sink=sink,
        metrics=metrics,
        settings=settings,
        clock=timer,
    )
    readers.retarget(kv_event_sources(config))
    try:
        await engine.wait_subscribed()
        log = await HeldLog().start(kv.nats, kv.stream)
        a, b = prompt(1, 2), prompt(2, 1)
        await engine.publish([stored(engine_hashes(1, 2), None, a, BS)])
        await log.wait_until(lambda: log.holds("engine-a", chain(a)))
        assert len(log.of("engine-a")) == 2  # cleared at start, then the batch

        timer.now += 100.0
        await log.wait_for_count("engine-a", 3)
        snapshot = log.of("engine-a")[2]
        assert snapshot.cleared and sorted(unpack(snapshot.stored)) == sorted(chain(a))

        await log.stop()
        await js.delete_stream(kv.stream)
        await engine.publish([stored(engine_hashes(2, 1), None, b, BS)])
        await sink.wait_lost(2)  # the update's ack is lost, then the snapshot's
        failures = "llmgw_scraper_publish_failures_total"
        assert sample(metrics, failures, kind="prefix") == 2
        assert await ensure_prefix_stream(js, config)
        fresh = await HeldLog().start(kv.nats, kv.stream)
        timer.now += 10.0
        await fresh.wait_until(lambda: fresh.holds("engine-a", chain(b)))
        resync = fresh.of("engine-a")[0]
        assert resync.cleared and sorted(unpack(resync.stored)) == sorted(chain(a) + chain(b))
    finally:
        await readers.stop()
