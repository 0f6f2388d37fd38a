"""What each endpoint's prefix cache holds, as one admission instance knows it, for placement.

`PrefixBoard` keeps the two indexes of `llmgw.core.prefix` and answers one question for the
catalog: what share of a request's prompt does this endpoint hold (`share`, 0..1)?

- **sent** (any engine): every prompt an instance places on a managed endpoint is recorded
  there (`placed`): in this instance's `SentIndex` at once, and for the others as a
  `PrefixSent` on the gateway's prefix stream (`llmgw.prefix_stream`), published after the decision,
  never waited for. Each endpoint's LRU is bounded by its engine's KV cache
  (`vllm:cache_config_info`: num_gpu_blocks x block_size tokens, about 4 bytes of prompt per
  token) or `prefix.default_kv_tokens`;
- **held** (engines with KV cache events, `endpoints[].kv_events`): the scraper republishes
  what the engine says it stored and removed (`PrefixHeld`), which every instance applies to
  its `HeldIndex`.

Every instance reads the stream from `prefix.max_age` ago when it starts (an ordered
consumer), then follows it: N instances hold the same index, up to the stream's delivery
delay, so they send a tenant's prefix to the same engines. Its own `PrefixSent` messages come
back to it and are skipped (recorded already). A message that does not parse is counted and
skipped. Soft state: a lost message costs a cache miss, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from nats.js.api import DeliverPolicy
from pydantic import ValidationError

from llmgw.clock import SYSTEM, Clock, TimeSource, wall_of
from llmgw.core.prefix import HeldIndex, PlacementTally, PromptPrefix, SentIndex, pack, unpack
from llmgw.prefix_stream import ensure_prefix_stream
from llmgw.wire import (
    EndpointPrefixes,
    PrefixHeld,
    PrefixSent,
    PrefixTop,
    prefix_held_subject,
    prefix_sent_subject,
    prefix_subjects,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg

    from llmgw.config.schema import Config
    from llmgw.services.admission.loadboard import LoadBoard
    from llmgw.wire import AdmitRequest

__all__ = ["BYTES_PER_TOKEN", "HELD_BYTES_PER_BLOCK", "SENT_BYTES_PER_BLOCK", "PrefixBoard"]

log = logging.getLogger("llmgw.admission.prefixes")

BYTES_PER_TOKEN = 4  # of prompt text per engine token, to size an LRU by the engine's KV cache
TOP_KEPT = 256  # first blocks counted per endpoint for `llmgw state`
# The header of a placement's message naming its instance: its own come back unparsed.
INSTANCE_HEADER = "Llmgw-Instance"
# Prompts placed on an endpoint, then found not held by its engine's events, in a row, before
# the gateway's tokens are taken to disagree with the engine's (`PrefixBoard._tokens_disagree`).
DISAGREEMENT = 20
# Memory of one block in each index (CPython 3.11, measured by tests/core/test_prefix.py): an
# OrderedDict entry with its int key and float time; a dict entry with its int key and count.
SENT_BYTES_PER_BLOCK = 130
HELD_BYTES_PER_BLOCK = 80


class PrefixBoard:
    """The sent and held indexes of one admission instance, and their stream."""

    def __init__(
        self,
        config: Config,
        load: LoadBoard,
        instance: str,
        *,
        clock: Clock | TimeSource = SYSTEM,
    ) -> None:
        self.instance = instance
        self._load = load
        self._clock = wall_of(clock)
        self.reconfigure(config)
        self.sent = SentIndex(self._blocks_of(config.prefix.default_kv_tokens))
        self.held = HeldIndex()
        self._held_block_size: dict[str, int] = {}
        self._misses: dict[str, int] = {}  # `_tokens_disagree`'s evidence per endpoint
        self._held_seq: dict[str, int] = {}
        self._outbox: list[tuple[str, bytes]] = []
        self._flushing: asyncio.Task[None] | None = None
        self._nc: NATS | None = None
        self._headers = {INSTANCE_HEADER: instance}
        self._sub: Any = None
        self.received = {"sent": 0, "held": 0, "own": 0, "malformed": 0}
        # Per endpoint: placements by their chain's first block (`llmgw state`'s top prefixes).
        self._top: dict[str, PlacementTally] = {}
        self.published = 0

    def reconfigure(self, config: Config) -> None:
        prefix = config.prefix
        self.enabled = prefix.enabled
        self.block_bytes = prefix.block_bytes
        self.predicted_ttl = prefix.predicted_ttl
        self.stream = config.prefix_stream
        self._sent_subjects = prefix_sent_subject(self.stream, "")
        self._held_subjects = prefix_held_subject(self.stream, "")
        self._config = config

    def _blocks_of(self, tokens: int) -> int:
        return max(1, tokens * BYTES_PER_TOKEN // self.block_bytes)

    # ---- the stream ---------------------------------------------------------------------------

    async def start(self, nc: NATS) -> None:
        """Make sure the stream exists, then read what it keeps (`prefix.max_age`) and follow it."""
        self._nc = nc
        if not self.enabled:
            return
        js = nc.jetstream()
        if not await ensure_prefix_stream(js, self._config):
            return
        try:  # the stream keeps `prefix.max_age`: all of it is the recent past
            self._sub = await js.subscribe(
                prefix_subjects(self.stream),
                stream=self.stream,
                cb=self._on_message,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.ALL,
                idle_heartbeat=5.0,
                inactive_threshold=60.0,
            )
        except Exception:
            log.warning("the prefix stream cannot be followed: placements only", exc_info=True)

    async def stop(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self._flushing is not None:
            with contextlib.suppress(Exception):
                await self._flushing

    async def _on_message(self, msg: Msg) -> None:
        try:
            if msg.subject.startswith(self._sent_subjects):
                headers = msg.headers
                if headers is not None and headers.get(INSTANCE_HEADER) == self.instance:
                    self.received["own"] += 1  # recorded already: not even parsed
                    return
                sent = PrefixSent.model_validate_json(msg.data)
                chain = unpack(sent.chain)
                self.sent.record(sent.endpoint, chain, sent.at)
                self._count(sent.endpoint, chain, sent.at)
                self.received["sent"] += 1
            elif msg.subject.startswith(self._held_subjects):
                self._apply_held(PrefixHeld.model_validate_json(msg.data))
                self.received["held"] += 1
        except (ValidationError, ValueError):
            self.received["malformed"] += 1
            log.debug("a prefix message that does not parse: %s", msg.subject, exc_info=True)

    def _apply_held(self, held: PrefixHeld) -> None:
        endpoint = held.endpoint
        if held.cleared:
            self.held.clear(endpoint)
            self._misses.pop(endpoint, None)  # what it holds is learned again
        if held.emptied:  # the engine lost its cache: what was sent there is gone too
            self.sent.drop(endpoint)
        self._held_block_size[endpoint] = held.block_size
        self._held_seq[endpoint] = held.seq
        if held.stored:
            self.held.store(endpoint, unpack(held.stored))
        if held.removed:
            self.held.remove(endpoint, unpack(held.removed))

    # ---- placement's questions ----------------------------------------------------------------

    def prompt_of(self, request: AdmitRequest) -> PromptPrefix | None:
        """The request's prompt as placement matches it (None: prefix placement is off)."""
        if not self.enabled:
            return None
        return PromptPrefix(
            unpack(request.prefix),
            request.prompt_bytes,
            self.block_bytes,
            unpack(request.tokens) if request.tokens else (),
            request.prompt_tokens,
            request.token_block,
        )

    def share(self, endpoint: str, prompt: PromptPrefix, now: float) -> float:
        """The share of `prompt` that `endpoint` is believed to hold, 0..1.

        An endpoint whose engine reports its KV cache events, asked with the prompt's tokens in
        its block size: what the engine says it holds, or what was placed there within
        `prefix.predicted_ttl` (the engine's events about it may not have arrived yet), the
        larger. Any other: what was sent there (the LRU)."""
        return self._matched(endpoint, prompt, now)[0]

    def _matched(self, endpoint: str, prompt: PromptPrefix, now: float) -> tuple[float, str]:
        """`share`, and the index that said it (held, sent)."""
        if not self.enabled or not prompt.chain:
            return 0.0, "sent"
        block_size = self._held_block_size.get(endpoint)
        sent_blocks = self.sent.match(endpoint, prompt.chain)
        if prompt.tokens and block_size == prompt.token_block:
            held_blocks = self.held.match(endpoint, prompt.tokens)
            recent = self.sent.match(endpoint, prompt.chain, now - self.predicted_ttl)
            if not self._tokens_disagree(endpoint, sent_blocks > recent, held_blocks > 0):
                held, sent = prompt.token_share(held_blocks), prompt.share(recent)
                return (held, "held") if held >= sent else (sent, "sent")
        return prompt.share(sent_blocks), "sent"

    def _tokens_disagree(self, endpoint: str, placed_before: bool, held: bool) -> bool:
        """Whether the gateway's tokens of prompts never match what `endpoint`'s engine says
        it holds (a tokenizer or chat template other than the engine's): then its events are
        no use and the endpoint is matched by what was sent there. The evidence: prompts placed
        there long enough ago for their events to have come (`placed_before`), of which not
        one was found held, `DISAGREEMENT` times in a row; one found held clears it."""
        if not placed_before:
            return self._misses.get(endpoint, 0) >= DISAGREEMENT
        if held:
            self._misses[endpoint] = 0
            return False
        misses = self._misses[endpoint] = self._misses.get(endpoint, 0) + 1
        return misses >= DISAGREEMENT

    def placed(
        self, endpoint: str, model: str, prompt: PromptPrefix, now: float
    ) -> tuple[float, str]:
        """`prompt` was placed on `endpoint` (for `model`): recorded here at once, and for
        every other instance on the stream after this decision. Returns the share of it the
        endpoint held before, and the index that said so."""
        if not self.enabled or not prompt.chain:
            return 0.0, "sent"
        share = self._matched(endpoint, prompt, now)
        capacity = self._capacity(endpoint)
        if capacity != self.sent.capacity(endpoint):
            self.sent.set_capacity(endpoint, capacity)
        self.sent.record(endpoint, prompt.chain, now)
        self._count(endpoint, prompt.chain, now)
        if self._nc is None:
            return share
        message = PrefixSent(
            instance=self.instance, endpoint=endpoint, model=model, at=now, chain=pack(prompt.chain)
        )
        subject = prefix_sent_subject(self.stream, endpoint)
        self._outbox.append((subject, message.model_dump_json().encode()))
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())
        return share

    def _count(self, endpoint: str, chain: tuple[int, ...], at: float) -> None:
        """One more placement of a chain starting with `chain[0]` on `endpoint` (at most
        `TOP_KEPT` first blocks per endpoint: the least placed goes)."""
        tally = self._top.get(endpoint)
        if tally is None:
            tally = self._top[endpoint] = PlacementTally(TOP_KEPT)
        tally.add(chain[0], len(chain), at)

    def _capacity(self, endpoint: str) -> int:
        """The most blocks `endpoint`'s LRU keeps: its engine's KV cache, as its metrics say."""
        sample = self._load.load(endpoint).sample if self._load.knows(endpoint) else None
        if sample is not None and sample.block_size and sample.num_gpu_blocks:
            return self._blocks_of(sample.block_size * sample.num_gpu_blocks)
        return self.sent.default_capacity

    async def _flush(self) -> None:
        """Publish what the decisions of this event-loop turn placed (one task at a time)."""
        await asyncio.sleep(0)  # the rest of this turn's decisions join the batch
        nc = self._nc
        while self._outbox and nc is not None:
            batch, self._outbox = self._outbox, []
            for subject, data in batch:
                try:
                    await nc.publish(subject, data, headers=self._headers)
                    self.published += 1
                except Exception:
                    log.debug("a placement not published to the prefix stream", exc_info=True)

    # ---- operability --------------------------------------------------------------------------

    def memory_bytes(self) -> int:
        """An estimate: 1M blocks cost about 130 MB in the sent index, 80 MB in the held one.
        The sent index is bounded by its endpoints' capacities (an engine of 30,000 16-token
        KV blocks: 7,500 blocks here, about 1 MB); the held one by what the engines hold."""
        return SENT_BYTES_PER_BLOCK * self.sent.size() + HELD_BYTES_PER_BLOCK * self.held.size()

    def endpoints(self) -> list[str]:
        return sorted({str(k) for k in self.sent.keys()} | {str(k) for k in self.held.keys()})

    def summary(self, top: int = 5) -> tuple[EndpointPrefixes, ...]:
        """What `llmgw state` shows: each endpoint's index sizes and its `top` prefixes by
        placements."""
        rows = []
        for endpoint in self.endpoints():
            tally = self._top.get(endpoint)
            counted = tally.items() if tally is not None else []
            kept = sorted(counted, key=lambda item: -item[1])[:top]
            rows.append(
                EndpointPrefixes(
                    endpoint=endpoint,
                    sent_blocks=self.sent.size(endpoint),
                    capacity_blocks=self.sent.capacity(endpoint),
                    held_blocks=self.held.size(endpoint),
                    top=tuple(
                        PrefixTop(
                            prefix=f"{root:016x}",
                            placements=int(count),
                            blocks=int(blocks),
                            last_at=at,
                        )
                        for root, count, blocks, at in kept
                    ),
                )
            )
        return tuple(rows)
