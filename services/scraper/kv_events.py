"""Engines' KV cache events (``endpoints[].kv_events``), republished for admission: each
engine's batches, translated into our token chains (`llmgw.core.kv_events`), become
`llmgw.wire.PrefixHeld` updates on `prefix_held_subject(stream, endpoint)`, kept in the prefix stream
(`llmgw.prefix_stream`), so every admission instance builds the same index of what each
endpoint holds and one that starts catches up from the stream.

One task per endpoint (`KvEventsReader`), started, restarted and stopped as the live fleet
changes (`KvEvents.retarget`): a ZMQ SUB socket on the engine's PUB socket with its topic, and
a monitor of that connection. Per batch read:

- in sequence: translated and published;
- a gap: a replay of the missed batches from the engine's ROUTER socket (a fresh DEALER,
  bounded by `replay_timeout`, at most one per `replay_interval`); when none fills it, the
  endpoint is published `cleared` then what follows;
- the sequence going back (the engine restarted), or the connection dropping (the publisher
  went away): `cleared`; at start too, since what was published before cannot be resolved.

Publishing does not wait for the stream's acks (`StreamSink`): they are checked later, in
order per endpoint; a lost one (an error, or none within `ack_timeout`) makes the reader
publish a *snapshot*, `cleared` then every block it holds. A snapshot also goes out every
`snapshot_interval` (half the stream's max age), so the stream always holds one: an instance
that reads it from its start ends with what the engine holds, even once older updates aged out.

Isolation: a reader reads at most `read_limit` batches before yielding to the event loop, a
message over `max_message` bytes drops the publisher's connection (ZMQ's own limit), unreadable
frames are counted and skipped, and a reader that fails is started again after a pause: a
misbehaving engine degrades its own endpoint only, never the scrape loop or another endpoint.
Ownership: a reader's `KvSync` and sockets are its own task's; `KvEvents` owns the ZMQ context.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from llmgw.core.kv_events import (
    END_SEQ,
    BatchResult,
    HeldUpdate,
    KvBatch,
    KvEventsError,
    KvSync,
    Received,
    ReplayResult,
    decode_batch,
    decode_seq,
)
from llmgw.core.prefix import pack
from llmgw.wire import PrefixHeld, prefix_held_subject

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.js.api import PubAck
    from nats.js.client import JetStreamContext

    from llmgw.config.catalog import KvEventsSource
    from llmgw.config.schema import Config
    from llmgw.contracts import Clock
    from llmgw.services.scraper.metrics import ScraperMetrics

__all__ = [
    "HeldSink",
    "KvEvents",
    "KvEventsReader",
    "KvEventsSettings",
    "LiveSink",
    "ReaderDeps",
    "StreamSink",
]

_log = logging.getLogger("llmgw.scraper.kv_events")

# An update's block size before any event said it (vLLM's default): only `cleared` goes then.
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class KvEventsSettings:
    replay_timeout: float = 5.0  # a replay's whole answer, end marker included
    replay_interval: float = 1.0  # the least time between two replays of one endpoint
    max_replay: int = 50_000  # batches a replay may bring (vLLM buffers 10,000 by default)
    ack_timeout: float = 5.0  # an update's ack from the stream
    resync_interval: float = 5.0  # the least time between two snapshots after lost acks
    snapshot_interval: float = 300.0  # every endpoint's snapshot, this often
    read_limit: int = 64  # batches read before yielding to the event loop
    max_hashes: int = 16_384  # hashes per PrefixHeld (about 170 KiB of JSON)
    max_message: int = 64 * 1024 * 1024  # a larger ZMQ message drops the connection
    receive_hwm: int = 10_000  # batches queued in the SUB socket before ZMQ drops them
    tick: float = 1.0  # acks and snapshots are looked at least this often
    restart_delay: float = 1.0  # before a failed reader starts again (doubled each time...)
    max_restart_delay: float = 30.0  # ... up to this, while it keeps failing

    @classmethod
    def of(cls, config: Config) -> KvEventsSettings:
        return cls(snapshot_interval=config.prefix.max_age / 2)


# -- where updates go ------------------------------------------------------------------------


class HeldSink(Protocol):
    """Where an endpoint's updates go, in the order sent."""

    async def send(self, message: PrefixHeld) -> None:
        """Hand `message` over; raises when it cannot be (not when it is lost later)."""
        ...

    def lost(self, endpoint: str) -> int:
        """How many messages sent for `endpoint` turned out not stored since last asked."""
        ...


def _subject_and_data(stream: str, message: PrefixHeld) -> tuple[str, bytes]:
    return prefix_held_subject(stream, message.endpoint), message.model_dump_json().encode()


class StreamSink:
    """Publishes to the prefix stream without waiting for each ack: the acks of an endpoint's
    messages are looked at in order by `lost`, the next time its reader asks."""

    def __init__(
        self, js: JetStreamContext, stream: str, *, ack_timeout: float, clock: Clock
    ) -> None:
        self._js = js
        self._stream = stream
        self._ack_timeout = ack_timeout
        self._timer = clock.monotonic
        self._pending: dict[str, deque[tuple[float, asyncio.Future[PubAck]]]] = {}

    async def send(self, message: PrefixHeld) -> None:
        subject, data = _subject_and_data(self._stream, message)
        future = await self._js.publish_async(subject, data, wait_stall=self._ack_timeout)
        deadline = self._timer() + self._ack_timeout
        self._pending.setdefault(message.endpoint, deque()).append((deadline, future))

    def lost(self, endpoint: str) -> int:
        pending = self._pending.get(endpoint)
        lost = 0
        now = self._timer()
        while pending:
            deadline, future = pending[0]
            if future.done():
                lost += future.cancelled() or future.exception() is not None
            elif now >= deadline:
                future.cancel()  # frees its place among the client's pending publishes
                lost += 1
            else:
                break
            pending.popleft()
        if pending is not None and not pending:
            del self._pending[endpoint]
        return lost


class LiveSink:
    """Plain publishes, for when the prefix stream could not be had: live subscribers get
    them (and a stream created later keeps them); nothing is known lost."""

    def __init__(self, nc: NATS, stream: str) -> None:
        self._nc = nc
        self._stream = stream

    async def send(self, message: PrefixHeld) -> None:
        await self._nc.publish(*_subject_and_data(self._stream, message))

    def lost(self, endpoint: str) -> int:
        return 0


# -- one endpoint ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReaderDeps:
    """What every reader shares: the ZMQ context, where updates go, the scraper's metrics, the
    settings, and the clock (wall: unix seconds, for timestamps; monotonic: intervals)."""

    context: zmq.asyncio.Context
    sink: HeldSink
    metrics: ScraperMetrics
    settings: KvEventsSettings
    clock: Clock


class KvEventsReader:
    """One endpoint's engine: read, translated, published (see the module docstring).
    `run` returns only by cancellation (or a bug, which `KvEvents` logs and restarts)."""

    def __init__(self, endpoint: str, source: KvEventsSource, deps: ReaderDeps) -> None:
        self.endpoint = endpoint
        self.source = source
        self.sync = KvSync()
        self._topic = source.topic.encode()
        self._context = deps.context
        self._sink = deps.sink
        self._metrics = deps.metrics
        self._settings = settings = deps.settings
        self._clock = deps.clock.wall
        self._timer = timer = deps.clock.monotonic
        self._last_replay: float | None = None
        self._resync = False
        self._next_resync = timer()
        self._next_snapshot = timer() + settings.snapshot_interval
        self._failing = False  # publishing failed, logged once until it works again
        self._malformed_logged = False

    async def run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self._settings.receive_hwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self._settings.max_message)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            sub.connect(self.source.endpoint)
            # Whatever was published for the endpoint before (another scraper, an earlier
            # run) cannot be continued: its engine's blocks are unknown to this reader.
            await self._publish(HeldUpdate(cleared=True), self.sync.last_seq)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while True:
                ready = dict(await poller.poll(self._settings.tick * 1000))
                # The data first: batches read before a disconnection came from the engine
                # that went away; the new connection's come after its monitor event.
                if sub in ready:
                    await self._read(sub)
                if monitor in ready:
                    await self._watch(monitor)
                await self._housekeeping()
                await asyncio.sleep(0)  # a busy engine yields to the rest of the scraper
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    # ---- batches ----------------------------------------------------------------------------

    async def _read(self, sub: zmq.asyncio.Socket) -> None:
        """The batches waiting (up to `read_limit`), published as few updates."""
        pending: HeldUpdate | None = None
        pending_seq = -1
        stamps: list[float] = []
        for _ in range(self._settings.read_limit):
            try:
                frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            received = await self._receive(frames)
            if received is None:
                continue
            got, ts = received
            stamps.append(ts)
            update = got.update
            if update is None:
                continue
            if pending is not None and not _same_block_size(pending, update):
                await self._publish(pending, pending_seq)
                pending = None
            if pending is None:
                pending = HeldUpdate()
            pending.then(update)
            pending_seq = self.sync.last_seq
        now = self._clock()  # handed over now (acks are not awaited)
        for ts in stamps:
            self._metrics.kv_lag.labels(self.endpoint).observe(max(0.0, now - ts))
        self._metrics.kv_blocks.labels(self.endpoint).set(len(self.sync.translator))
        if pending is not None:
            await self._publish(pending, pending_seq)

    async def _receive(self, frames: list[bytes]) -> tuple[Received, float] | None:
        """One message from the engine: its outcome and the batch's timestamp (None: not a
        batch of ours)."""
        if len(frames) != 3:
            self._malformed(f"{len(frames)} frames, not 3 (topic, seq, payload)")
            return None
        topic, seq_frame, payload = frames
        if topic != self._topic:  # a topic our subscription's prefix also matches
            self._count(BatchResult.OTHER_TOPIC)
            return None
        try:
            seq = decode_seq(seq_frame)
            if seq < 0:
                raise KvEventsError(f"a negative sequence number ({seq})")
            batch = decode_batch(payload)
        except KvEventsError as exc:
            self._malformed(str(exc))
            return None
        self._metrics.kv_last_batch.labels(self.endpoint).set(self._clock())
        start = self.sync.gap(seq)
        replayed: list[tuple[int, KvBatch | None]] | None = None
        asked = False
        if start is not None:
            replayed, asked = await self._replay(start, seq)
        if replayed is not None and len(replayed) > self._settings.read_limit:
            # A long replay's hashing would hold the event loop: off it (this task waits).
            got = await asyncio.to_thread(self.sync.receive, seq, batch, replayed)
        else:
            got = self.sync.receive(seq, batch, replayed)
        self._count(got.result)
        for reason, count in got.dropped.items():
            self._metrics.kv_events_dropped.labels(self.endpoint, reason.value).inc(count)
        if asked:
            result = ReplayResult.FAILED if replayed is None else ReplayResult.of(got.filled)
            self._metrics.kv_replays.labels(self.endpoint, result.value).inc()
        if got.result in (BatchResult.GAP_LOST, BatchResult.RESTARTED):
            _log.info(
                "KV events of %s: %s at batch %d; what it held is cleared",
                self.endpoint,
                "batches lost" if got.result is BatchResult.GAP_LOST else "the engine restarted",
                seq,
            )
        return got, batch.ts

    def _count(self, result: BatchResult) -> None:
        self._metrics.kv_batches.labels(self.endpoint, result.value).inc()

    def _malformed(self, why: str) -> None:
        self._count(BatchResult.MALFORMED)
        if not self._malformed_logged:  # once per reader: a broken engine repeats itself
            self._malformed_logged = True
            _log.warning(
                "KV events of %s: a malformed message (%s); further ones are only counted",
                self.endpoint,
                why,
            )

    async def _replay(
        self, start: int, before: int
    ) -> tuple[list[tuple[int, KvBatch | None]] | None, bool]:
        """The batches from `start` to `before` (excluded) the engine still buffers (a batch
        None: unreadable), and whether a replay was asked (None with True: it failed)."""
        address = self.source.replay_endpoint
        now = self._timer()
        if address is None or (
            self._last_replay is not None
            and now - self._last_replay < self._settings.replay_interval
        ):
            return None, False
        self._last_replay = now
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self._settings.max_message)
        replayed: list[tuple[int, KvBatch | None]] = []
        try:
            dealer.connect(address)
            async with asyncio.timeout(self._settings.replay_timeout):
                await dealer.send_multipart([b"", start.to_bytes(8, "big")])
                while len(replayed) < self._settings.max_replay:
                    frames = await dealer.recv_multipart()
                    if frames and frames[0] == b"":  # the ROUTER's empty delimiter
                        frames = frames[1:]
                    if len(frames) == 3:  # (topic, seq, payload) since vLLM 0.26
                        frames = frames[1:]
                    if len(frames) != 2:
                        raise KvEventsError(f"a replayed message of {len(frames)} frames")
                    seq, payload = decode_seq(frames[0]), frames[1]
                    if seq == END_SEQ or not payload or seq >= before:
                        break  # the end, or what comes live anyway
                    try:
                        replayed.append((seq, decode_batch(payload)))
                    except KvEventsError:
                        replayed.append((seq, None))
                    if len(replayed) % self._settings.read_limit == 0:
                        await asyncio.sleep(0)
        except (TimeoutError, zmq.ZMQError, KvEventsError) as exc:
            _log.info("KV events of %s: the replay from %d failed: %r", self.endpoint, start, exc)
            return None, True
        finally:
            dealer.close(linger=0)
        return replayed, True

    # ---- the connection, acks, snapshots ----------------------------------------------------

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_CONNECTED:
                _log.info("KV events of %s: connected to %s", self.endpoint, self.source.endpoint)
            elif event == zmq.EVENT_DISCONNECTED:
                _log.info(
                    "KV events of %s: the publisher went away; what it held is cleared",
                    self.endpoint,
                )
                update = self.sync.reset()
                self._metrics.kv_blocks.labels(self.endpoint).set(0)
                if update is not None:
                    await self._publish(update, self.sync.last_seq)

    async def _housekeeping(self) -> None:
        lost = self._sink.lost(self.endpoint)
        if lost:
            self._metrics.publish_failures.labels("prefix").inc(lost)
            self._resync = True
            self._log_failure(f"{lost} update(s) not stored (no ack)")
        now = self._timer()
        if self._resync and now >= self._next_resync:
            self._resync = False
            self._next_resync = now + self._settings.resync_interval
            self._next_snapshot = now + self._settings.snapshot_interval
            await self._publish(self.sync.snapshot(), self.sync.last_seq)
        elif now >= self._next_snapshot:
            self._next_snapshot = now + self._settings.snapshot_interval
            if self.sync.translator:
                await self._publish(self.sync.snapshot(), self.sync.last_seq)

    async def _publish(self, update: HeldUpdate, seq: int) -> None:
        """Send `update` (split to `max_hashes`); a failure is counted and makes the next
        housekeeping publish a snapshot. Never raises (but cancellation)."""
        block_size = update.block_size or self.sync.translator.block_size or DEFAULT_BLOCK_SIZE
        for part in update.split(self._settings.max_hashes):
            message = PrefixHeld(
                endpoint=self.endpoint,
                seq=seq,
                block_size=block_size,
                cleared=part.cleared,
                emptied=part.emptied,
                stored=pack(part.stored),
                removed=pack(part.removed),
            )
            try:
                await self._sink.send(message)
            except Exception as exc:
                self._metrics.publish_failures.labels("prefix").inc()
                self._resync = True
                self._log_failure(repr(exc))
                return
        if self._failing:
            self._failing = False
            _log.info("KV events of %s: publishing again", self.endpoint)

    def _log_failure(self, why: str) -> None:
        if not self._failing:
            self._failing = True
            _log.warning(
                "KV events of %s: cannot publish to the prefix stream: %s (further failures "
                "are only counted until one succeeds; then all the endpoint holds is "
                "published again)",
                self.endpoint,
                why,
            )


def _same_block_size(a: HeldUpdate, b: HeldUpdate) -> bool:
    return a.block_size is None or b.block_size is None or a.block_size == b.block_size


# -- every endpoint --------------------------------------------------------------------------


class KvEvents:
    """A reader per endpoint with KV cache events, following the live fleet (`retarget`)."""

    def __init__(
        self,
        *,
        sink: HeldSink,
        metrics: ScraperMetrics,
        settings: KvEventsSettings,
        clock: Clock,
    ) -> None:
        self._context = zmq.asyncio.Context()
        self._deps = ReaderDeps(self._context, sink, metrics, settings, clock)
        self._settings = settings
        self._readers: dict[str, tuple[KvEventsSource, asyncio.Task[None]]] = {}
        self._retiring: set[asyncio.Task[None]] = set()

    def endpoints(self) -> list[str]:
        return sorted(self._readers)

    def retarget(self, sources: Mapping[str, KvEventsSource]) -> None:
        """Read `sources` (endpoint -> where its engine publishes) from now on: a new endpoint
        gets a reader, a changed one a new reader once the old one ended, a removed one its
        reader stopped and `cleared` published (its blocks are no one's now)."""
        for endpoint, (source, task) in list(self._readers.items()):
            if sources.get(endpoint) == source:
                continue
            del self._readers[endpoint]
            task.cancel()
            if endpoint not in sources:
                self._keep(asyncio.create_task(self._retire(endpoint, task)))
            else:
                self._start(endpoint, sources[endpoint], after=task)
        for endpoint, source in sources.items():
            if endpoint not in self._readers:
                self._start(endpoint, source)

    def _start(
        self, endpoint: str, source: KvEventsSource, after: asyncio.Task[None] | None = None
    ) -> None:
        self._deps.metrics.declare_kv(endpoint)
        task = asyncio.create_task(self._supervise(endpoint, source, after), name="kv-events")
        self._readers[endpoint] = (source, task)

    def _keep(self, task: asyncio.Task[None]) -> None:
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _supervise(
        self, endpoint: str, source: KvEventsSource, after: asyncio.Task[None] | None
    ) -> None:
        if after is not None:  # its last updates go out before this reader's `cleared`
            await asyncio.wait({after})
        delay = self._settings.restart_delay
        while True:
            started = self._deps.clock.monotonic()
            try:
                await KvEventsReader(endpoint, source, self._deps).run()
            except Exception:  # a bug must not end the endpoint's events for good
                _log.exception(
                    "KV events of %s: the reader failed; starting again in %gs", endpoint, delay
                )
            # Doubled while it keeps failing soon after its start (up to `max_restart_delay`).
            if self._deps.clock.monotonic() - started > self._settings.max_restart_delay:
                delay = self._settings.restart_delay
            await asyncio.sleep(delay)
            delay = min(2 * delay, self._settings.max_restart_delay)

    async def _retire(self, endpoint: str, task: asyncio.Task[None]) -> None:
        await asyncio.wait({task})
        message = PrefixHeld(endpoint=endpoint, seq=-1, block_size=DEFAULT_BLOCK_SIZE, cleared=True)
        try:
            await self._deps.sink.send(message)
        except Exception as exc:
            _log.info("KV events of %s: its last `cleared` was not published: %r", endpoint, exc)

    async def stop(self) -> None:
        """Stop every reader (nothing more is published) and close the sockets."""
        tasks = [task for _, task in self._readers.values()]
        self._readers.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *self._retiring, return_exceptions=True)
        self._context.destroy(linger=0)
