"""A simulated engine's KV-event publisher: vLLM's ZMQ wire, on the event loop (pyzmq asyncio).

The wire is that of vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``):

- a PUB socket bound at the endpoint sends each batch as one message of three frames:
  the topic (UTF-8), the batch's sequence number (8 bytes, big-endian; batches are numbered
  from 0 per engine process) and the msgpack payload (`wire_batch`);
- a ROUTER socket bound at the replay endpoint serves replays: a DEALER sends an empty
  delimiter frame and an 8-byte big-endian start number, and gets every kept batch numbered
  that or later as ``(b"", topic, seq, payload)`` (vLLM 0.26 and later), then the end marker
  ``(b"", b"", END_SEQ, b"")``. A start older than the ring replays from the oldest kept.

vLLM binds only wildcard, ``ipc://`` and ``inproc://`` endpoints and connects to others; the
simulator always binds, so consumers connect to it.

Concurrency and ownership: `publish` runs on the event loop, called by the engine; it never
waits and never fails. It numbers the batch and appends it to a bounded queue. A sender task
owns the PUB socket: it sends each queued batch, then keeps it in the replay ring, so the ring
stays in sequence order and a replay never serves a batch before the PUB socket sent it. A
replay task owns the ROUTER socket. When the queue is full (the sender fell behind) the batch
is dropped and counted, as vLLM drops above its high-water mark: subscribers see a gap.

Faults (`FaultKnobs`, counted down here): ``kv_events_skip`` numbers a batch and keeps it for
replay without sending it; ``kv_events_lose`` numbers it and drops it. `restart` is an engine
restart: numbering from 0 and an empty ring.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from llmgw.services.sim.kv_events import KvEvent, KvEventEncoding, ReplayRing, wire_batch
from llmgw.services.sim.params import EngineParams, FaultKnobs

__all__ = ["END_SEQ", "KvEventPublisher", "encode_batch"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
PUB_HWM = 100_000  # vLLM's default `hwm`
QUEUE_SIZE = 100_000  # vLLM's default `max_queue_size`


def encode_batch(ts: float, events: Sequence[KvEvent], encoding: KvEventEncoding) -> bytes:
    """A batch's msgpack payload (integers above 2**63 as uint64, floats as float64, as
    vLLM's msgspec encoder writes them)."""
    payload: bytes = msgpack.packb(wire_batch(ts, events, encoding))
    return payload


class KvEventPublisher:
    """Publishes one engine's KV cache events; `start` binds, `close` unbinds."""

    def __init__(
        self,
        params: EngineParams,
        *,
        wall_clock: Callable[[], float],
        queue_size: int = QUEUE_SIZE,
    ) -> None:
        assert params.kv_events_endpoint is not None
        self.endpoint = params.kv_events_endpoint
        self.replay_endpoint = params.kv_events_replay_endpoint
        self._topic = params.kv_events_topic.encode()
        self._encoding = params.kv_events_encoding
        self._wall_clock = wall_clock
        self._ring = ReplayRing(params.kv_events_buffer_steps)
        self._queue: deque[tuple[int, int, bytes, bool]] = deque()  # epoch, seq, payload, send
        self._queue_size = queue_size
        self._wake = asyncio.Event()
        self._epoch = 0  # restarts so far: a batch of an older epoch is not kept
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.counts = {"published": 0, "skipped": 0, "lost": 0, "dropped": 0}

    async def start(self) -> None:
        """Bind the sockets (the bound addresses replace `*` ports) and start sending; OSError
        when an address cannot be bound. Once started, a no-op."""
        if self._ctx is not None:
            return
        ctx = self._ctx = zmq.asyncio.Context()
        try:
            pub = _bound(ctx, zmq.PUB, self.endpoint)
            router = None
            if self.replay_endpoint is not None:
                router = _bound(ctx, zmq.ROUTER, self.replay_endpoint)
        except OSError:
            await self.close()
            raise
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks.append(asyncio.create_task(self._send(pub), name="kv-events-pub"))
        if router is not None:
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._tasks.append(asyncio.create_task(self._replay(router), name="kv-events-replay"))

    def publish(self, events: Sequence[KvEvent], faults: FaultKnobs) -> None:
        """Number one step's batch and queue it, unless `faults` skip or lose it."""
        seq = self._ring.number()
        if faults.kv_events_lose > 0:
            faults.kv_events_lose -= 1
            self.counts["lost"] += 1
            return
        if len(self._queue) >= self._queue_size:
            self.counts["dropped"] += 1
            return
        send = faults.kv_events_skip == 0
        if not send:
            faults.kv_events_skip -= 1
            self.counts["skipped"] += 1
        payload = encode_batch(self._wall_clock(), events, self._encoding)
        self._queue.append((self._epoch, seq, payload, send))
        self._wake.set()

    def restart(self) -> None:
        """An engine restart: numbering from 0, an empty ring, and what was queued is lost."""
        self._epoch += 1
        self._queue.clear()
        self._ring.restart()

    def state(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self._topic.decode(),
            "encoding": self._encoding,
            "next_seq": self._ring.next_seq,
            **self.counts,
        }

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _send(self, pub: zmq.asyncio.Socket) -> None:
        queue = self._queue
        while True:
            if not queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            epoch, seq, payload, send = queue.popleft()
            if send:
                # A PUB socket never waits: above its high-water mark it drops the message.
                await pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self.counts["published"] += 1
            if epoch == self._epoch:
                self._ring.keep(seq, payload)

    async def _replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                continue  # not [identity, b"", start]: vLLM ignores it too
            identity, _, start = frames
            for seq, payload in self._ring.since(int.from_bytes(start, "big")):
                await router.send_multipart(
                    (identity, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
            await router.send_multipart((identity, b"", b"", END_SEQ, b""))


def _bound(ctx: zmq.asyncio.Context, kind: int, address: str) -> zmq.asyncio.Socket:
    socket = ctx.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUB:
        socket.setsockopt(zmq.SNDHWM, PUB_HWM)
    try:
        socket.bind(address)
    except zmq.ZMQError as exc:
        socket.close()
        reason = exc.strerror if exc.errno is None else zmq.strerror(exc.errno)
        raise OSError(f"cannot bind the KV events socket to {address}: {reason}") from None
    return socket
