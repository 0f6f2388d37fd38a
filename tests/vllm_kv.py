"""vLLM's KV cache events as vLLM puts them on the wire, for tests: the payload encoders and a
publisher with vLLM's two sockets.

Encoding (as msgspec encodes vLLM's structs): an event is a positional array tagged by its
first element (every release up to v0.25; older ones have fewer fields) or a map tagged
``"type"`` with default-valued optional fields left out (v0.26 on); the batch is
``[ts, events, dp_rank]`` (``[ts, events]`` before data parallel ranks) or a map. A block hash
is a u64 int (negative int64 from older vLLM) or a digest whose last 8 bytes are the int.

`VllmKvPublisher`: a PUB socket sending (topic, 8-byte big-endian seq, payload), a ROUTER
answering replays from its buffer of past batches then an end marker, in vLLM's current
3-frame form or the older 2-frame one. It can skip sequence numbers (batches that never reach
the subscriber but stay replayable), forget its buffer (a gap no replay fills), send garbage,
and restart (sequence from 0, empty buffer) on the same ports. Its PUB is an XPUB, which vLLM's
subscribers cannot tell apart, so a test waits until the subscriber is there instead of
sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Any, Literal

import msgpack
import zmq
import zmq.asyncio
from timing import eventually

Encoding = Literal["array", "map"]
HashForm = Literal["u64", "i64", "bytes"]

# Fields msgspec leaves out of a map when they hold their default (None).
_OPTIONAL = {"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
END = (-1).to_bytes(8, "big", signed=True)


def stored(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    medium: str | None = "GPU",
    group_idx: int | None = None,
    kind: str | None = None,
) -> dict[str, Any]:
    """A BlockStored event's fields (hashes as u64 ints)."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora_name,
        "extra_keys": None,
        "group_idx": group_idx,
        "kv_cache_spec_kind": kind,
        "kv_cache_spec_sliding_window": None,
    }


# vLLM's field order (its structs'): what a positional event carries after its tag.
STORED_FIELDS = tuple(stored([], None, [], 1))[1:]


def removed(hashes: list[int], *, medium: str | None = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": None}


REMOVED_FIELDS = tuple(removed([]))[1:]


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def wire_hash(value: int, form: HashForm) -> int | bytes:
    if form == "i64":
        return value - 2**64 if value >= 2**63 else value
    if form == "bytes":  # a sha256 digest whose last 8 bytes are the hash
        return bytes(range(24)) + value.to_bytes(8, "big")
    return value


def _wire_event(event: dict[str, Any], encoding: Encoding, form: HashForm, fields: int) -> Any:
    values = dict(event)
    for name in ("block_hashes",):
        if name in values:
            values[name] = [wire_hash(h, form) for h in values[name]]
    if values.get("parent_block_hash") is not None:
        values["parent_block_hash"] = wire_hash(values["parent_block_hash"], form)
    tag = values.pop("type")
    if encoding == "map":
        return {
            "type": tag,
            **{k: v for k, v in values.items() if not (k in _OPTIONAL and v is None)},
        }
    names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(tag, ())
    return [tag, *(values[name] for name in names[:fields])]


def encode_batch(
    events: list[dict[str, Any]],
    *,
    ts: float = 1_800_000_000.0,
    dp_rank: int | None = 0,
    encoding: Encoding = "map",
    batch: Literal["array", "array2", "map"] = "array",
    hashes: HashForm = "u64",
    fields: int = len(STORED_FIELDS),
) -> bytes:
    """A batch payload as vLLM sends it (`fields`: how many positional fields an older
    version's BlockStored had)."""
    wire = [_wire_event(e, encoding, hashes, fields) for e in events]
    if batch == "map":
        outer: Any = {"ts": ts, "events": wire, "data_parallel_rank": dp_rank}
    elif batch == "array2":
        outer = [ts, wire]
    else:
        outer = [ts, wire, dp_rank]
    return msgpack.packb(outer, use_bin_type=True)


class VllmKvPublisher:
    """vLLM's KV events publisher on 127.0.0.1 (see the module docstring); `endpoint` and
    `replay_endpoint` once started."""

    def __init__(
        self,
        topic: str = "kv-events",
        *,
        encoding: Encoding = "map",
        buffer_steps: int = 10_000,
        replay_frames: Literal[2, 3] = 3,
    ) -> None:
        self.topic = topic.encode()
        self.encoding: Encoding = encoding
        self.buffer_steps = buffer_steps
        self.replay_frames = replay_frames
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.replays: list[int] = []  # the start seq of each replay asked
        self._context = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replayer: asyncio.Task[None] | None = None
        self._ports: tuple[int, int] | None = None
        self._subscribed = asyncio.Condition()
        self.subscriptions = 0  # subscriptions seen since the last (re)start
        self.unsubscriptions = 0  # ... and subscribers gone

    @property
    def endpoint(self) -> str:
        assert self._ports is not None
        return f"tcp://127.0.0.1:{self._ports[0]}"

    @property
    def replay_endpoint(self) -> str:
        assert self._ports is not None
        return f"tcp://127.0.0.1:{self._ports[1]}"

    async def _bind(self, socket: zmq.asyncio.Socket, port: int | None) -> int:
        if port is None:
            return socket.bind_to_random_port("tcp://127.0.0.1")

        # The old socket's port is free once ZMQ's I/O thread has closed it: retry until then.
        def bound() -> bool:
            socket.bind(f"tcp://127.0.0.1:{port}")
            return True

        await eventually(bound, 10, f"port {port} bound again", ignoring=(zmq.ZMQError,))
        return port

    async def start(self) -> VllmKvPublisher:
        pub = self._context.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, even a repeated one
        pub.setsockopt(zmq.SNDHWM, 100_000)  # vLLM's default high-water mark
        router = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        ports = self._ports or (None, None)
        self._ports = (await self._bind(pub, ports[0]), await self._bind(router, ports[1]))
        self._pub, self._router = pub, router
        self.subscriptions = self.unsubscriptions = 0
        self._replayer = asyncio.create_task(self._serve())
        return self

    async def _serve(self) -> None:
        """Subscriptions (XPUB) and replay requests (ROUTER), as they come."""
        assert self._pub is not None and self._router is not None
        poller = zmq.asyncio.Poller()
        poller.register(self._pub, zmq.POLLIN)
        poller.register(self._router, zmq.POLLIN)
        while True:
            for socket, _ in await poller.poll():
                if socket is self._pub:
                    message = await self._pub.recv()
                    async with self._subscribed:
                        if message[:1] == b"\x01":
                            self.subscriptions += 1
                        else:
                            self.unsubscriptions += 1
                        self._subscribed.notify_all()
                else:
                    await self._answer(await self._router.recv_multipart())

    async def _answer(self, frames: list[bytes]) -> None:
        assert self._router is not None
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        self.replays.append(first)
        head = [identity, b""]
        for seq, payload in list(self.buffer):
            if seq >= first:
                body = [seq.to_bytes(8, "big"), payload]
                if self.replay_frames == 3:
                    body.insert(0, self.topic)
                await self._router.send_multipart(head + body)
        end = [END, b""] if self.replay_frames == 2 else [b"", END, b""]
        await self._router.send_multipart(head + end)

    async def wait_subscribed(self, count: int = 1, timeout: float = 10.0) -> None:
        """Until `count` subscriptions reached this publisher since its last (re)start."""
        async with asyncio.timeout(timeout), self._subscribed:
            await self._subscribed.wait_for(lambda: self.subscriptions >= count)

    async def wait_unsubscribed(self, count: int = 1, timeout: float = 10.0) -> None:
        """Until `count` subscribers left since its last (re)start."""
        async with asyncio.timeout(timeout), self._subscribed:
            await self._subscribed.wait_for(lambda: self.unsubscriptions >= count)

    async def publish(self, events: list[dict[str, Any]], **encoding: Any) -> int:
        """Send one batch (encoded by `encode_batch`, this publisher's encoding unless given);
        its seq."""
        encoding.setdefault("encoding", self.encoding)
        return await self.publish_payload(encode_batch(events, **encoding))

    async def publish_payload(self, payload: bytes, *, send: bool = True) -> int:
        """Send `payload` as the next batch (`send` False: only into the replay buffer, as a
        batch the subscriber missed)."""
        assert self._pub is not None
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if send:
            await self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def skip(self, events: list[dict[str, Any]], **encoding: Any) -> int:
        """A batch the subscriber misses (not sent; replayable while buffered)."""
        encoding.setdefault("encoding", self.encoding)
        return await self.publish_payload(encode_batch(events, **encoding), send=False)

    async def send_frames(self, frames: list[bytes]) -> None:
        """Anything, as one message (garbage)."""
        assert self._pub is not None
        await self._pub.send_multipart(frames)

    def restart_sequence(self) -> None:
        """Start the sequence again from 0 with an empty buffer, on the same connection: an
        engine that restarted while its subscriber did not see the connection drop."""
        self.seq = 0
        self.buffer = deque(maxlen=self.buffer_steps)

    def forget(self) -> None:
        """Lose the replay buffer (what was published is beyond any replay)."""
        self.buffer.clear()

    async def stop(self) -> None:
        if self._replayer is not None:
            self._replayer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replayer
            self._replayer = None
        for socket in (self._pub, self._router):
            if socket is not None:
                socket.close(linger=0)
        self._pub = self._router = None

    async def restart(self) -> None:
        """Stop, then start again on the same ports as a new engine (seq from 0)."""
        await self.stop()
        self.restart_sequence()
        await self.start()

    async def close(self) -> None:
        await self.stop()
        self._context.destroy(linger=0)
