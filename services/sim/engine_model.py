"""The engine model: continuous batching over a paged KV cache, as a discrete-event simulation.

Pure: no asyncio, no wall clock, no global randomness. Callers pass the current time to
`EngineModel.submit` / `advance` and a seeded ``random.Random`` at construction; the runtime
(`engine_runtime`) arms a timer for `next_due()`. Times of events are exact simulated times, not
the times the caller happened to call `advance`, so results don't depend on event-loop lateness.

Semantics (vLLM-like):
- at most ``max_num_seqs`` sequences run; others wait in a queue ordered by the scheduling
  policy (vLLM's ``--scheduling-policy``): ``fcfs`` in arrival order, ``priority`` by (priority,
  arrival, submission order), lower priority values first. The head of the queue is admitted
  only when the KV cache can hold its prompt (minus prefix hits) plus its output, so a big
  request blocks those behind it (no overtaking) whatever the policy;
- nothing is ever preempted: vLLM preempts a running request only when it cannot get a block for
  its next token, and here every running sequence holds reservations for its whole output. So
  under ``priority`` a waiting request never displaces a running one, as in vLLM;
- under ``fcfs`` a non-zero priority is refused at submission (`PriorityNotEnabled`), as vLLM's
  API documents and its V0 engine did ("Got priority N but Priority scheduling is not
  enabled."); vLLM's V1 engine accepts it and ignores it (docs/simulator.md);
- a request whose prompt + output can never fit the whole cache, or whose prompt reaches
  ``max_model_len``, is rejected at submission (`PromptTooLong`), so the queue never deadlocks;
- TTFT = queue wait + prefill_base + prefill_per_token * uncached prompt tokens;
- after each token a sequence's next token comes itl_base + itl_per_running_seq * (running
  sequences at that moment) later, so latency grows with the batch;
- full prompt blocks are registered in the prefix cache when prefill completes. A LoRA
  adapter's blocks are its own (vLLM puts the adapter's name in the block hash): they never
  hit for the base model or another adapter;
- with a `KvEventRecorder`, every change of the prefix cache (blocks registered, evicted, the
  cache reset) is recorded as vLLM's KV cache events, at its simulated time.

Ownership: a `Sequence` is created by `submit` and finalised exactly once (finished or aborted);
its KV blocks are released at that moment.
"""

from __future__ import annotations

import heapq
import math
import random
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from enum import Enum

from llmgw.services.sim.kv_events import KvEventRecorder
from llmgw.services.sim.kvcache import KVCache
from llmgw.services.sim.params import EngineParams
from llmgw.services.sim.sampling import output_length
from llmgw.services.sim.tokenizer import hash_token_blocks

__all__ = [
    "EngineModel",
    "EngineStats",
    "FcfsQueue",
    "PriorityNotEnabled",
    "PriorityQueue",
    "PromptTooLong",
    "SeqState",
    "Sequence",
    "WaitingQueue",
]


class PromptTooLong(ValueError):
    """The request can never run on this engine (answered with 400)."""


class PriorityNotEnabled(ValueError):
    """A non-zero priority sent to an engine whose policy is ``fcfs`` (answered with 400)."""


class SeqState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside the engine. Read-only for callers except `listener`."""

    seq_id: int
    prompt_tokens: int
    block_hashes: list[int]
    output_len: int
    finish_reason: str  # "stop" when the model ended it, "length" when max_tokens or room did
    arrived_at: float
    text_seed: int
    priority: int = 0  # lower is scheduled earlier under the ``priority`` policy
    lora: str | None = None  # the LoRA adapter it runs with (None: the base model)
    listener: Callable[[Sequence], None] | None = None
    state: SeqState = SeqState.WAITING
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    cached_tokens: int = 0
    emitted: int = 0
    # KV bookkeeping
    held_hashes: list[int] = field(default_factory=list)
    hit_blocks: int = 0
    private_blocks: int = 0
    reserved_blocks: int = 0
    allocated_blocks: int = 0
    # What KV cache events report of the sequence's blocks
    prompt: SequenceOf[int] = ()

    @property
    def done(self) -> bool:
        return self.state is SeqState.FINISHED or self.state is SeqState.ABORTED

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrived_at


@dataclass(slots=True)
class EngineStats:
    """Monotonic counters (vLLM's counters are derived from these)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # tokens found
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    rejected: int = 0


class FcfsQueue:
    """Waiting sequences in arrival order (vLLM's ``fcfs``): a deque, the head is the oldest."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: deque[Sequence] = deque()

    def push(self, seq: Sequence) -> None:
        self._items.append(seq)

    def peek(self) -> Sequence:
        return self._items[0]

    def pop(self) -> Sequence:
        return self._items.popleft()

    def remove(self, seq: Sequence) -> None:
        self._items.remove(seq)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._items)


class PriorityQueue:
    """Waiting sequences by (priority, arrival time, seq_id), smallest first (vLLM's ``priority``).

    A binary heap; `peek` / `pop` give the minimum, iteration yields the queue in pop order.
    seq_id is unique and increases with submission, so equal priorities and arrival times keep
    submission order and a `Sequence` itself is never compared.
    """

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Sequence]] = []

    def push(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.priority, seq.arrived_at, seq.seq_id, seq))

    def peek(self) -> Sequence:
        return self._heap[0][3]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[3]

    def remove(self, seq: Sequence) -> None:
        self._heap.remove((seq.priority, seq.arrived_at, seq.seq_id, seq))
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (entry[3] for entry in sorted(self._heap, key=lambda entry: entry[:3]))


WaitingQueue = FcfsQueue | PriorityQueue


class EngineModel:
    """Scheduler + KV cache of one simulated engine."""

    def __init__(
        self,
        params: EngineParams,
        rng: random.Random,
        *,
        on_first_token: Callable[[Sequence], None] | None = None,
        on_finish: Callable[[Sequence], None] | None = None,
        kv_events: KvEventRecorder | None = None,
    ) -> None:
        self.params = params
        self.kv_events = kv_events
        self.rng = rng
        self.kv = KVCache(params.num_gpu_blocks, params.block_size)
        self.waiting: WaitingQueue = (
            PriorityQueue() if params.scheduling_policy == "priority" else FcfsQueue()
        )
        self.running: set[Sequence] = set()
        self.stats = EngineStats()
        self.now = -math.inf
        self._on_first_token = on_first_token
        self._on_finish = on_finish
        self._due: list[tuple[float, int, Sequence]] = []  # (time of next token, tie-break, seq)
        self._ids = 0

    # -- requests --------------------------------------------------------------------------
    def submit(
        self,
        now: float,
        prompt: SequenceOf[int],
        max_tokens: int | None,
        listener: Callable[[Sequence], None] | None = None,
        *,
        priority: int = 0,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        lora: str | None = None,
    ) -> Sequence:
        """Queue a request at `now` and run the engine up to `now` (zero timings finish it here).

        `lora`: the LoRA adapter the request runs with (None: the base model). The output
        length is drawn, bounded by `max_tokens` and `min_tokens` (or exactly
        `max_tokens` with `ignore_eos`): `sampling.output_length`.

        Raises PriorityNotEnabled for a non-zero `priority` under ``fcfs`` (before anything else,
        so a refused request leaves no trace) and PromptTooLong when the request could never be
        scheduled.
        """
        params = self.params
        if priority != 0 and params.scheduling_policy != "priority":
            raise PriorityNotEnabled(
                f"Got priority {priority} but Priority scheduling is not enabled."
            )
        self.advance(now)
        prompt_len = len(prompt)
        if prompt_len == 0:
            raise PromptTooLong("prompt is empty")
        if prompt_len >= params.max_model_len:
            self.stats.rejected += 1
            raise PromptTooLong(
                f"prompt too long: this model's maximum context length is {params.max_model_len} "
                f"tokens, the prompt has {prompt_len} (the output needs at least one more)"
            )
        output_len, finish_reason = output_length(
            params,
            self.rng,
            params.max_model_len - prompt_len,
            max_tokens,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
        )
        block_size = params.block_size
        total_blocks = -(-(prompt_len + output_len) // block_size)
        if total_blocks > params.num_gpu_blocks:
            self.stats.rejected += 1
            raise PromptTooLong(
                f"prompt too long: {prompt_len} prompt + {output_len} output tokens need "
                f"{total_blocks} KV blocks, the cache has {params.num_gpu_blocks}"
            )
        self._ids += 1
        seq = Sequence(
            seq_id=self._ids,
            prompt_tokens=prompt_len,
            block_hashes=hash_token_blocks(prompt, block_size),
            output_len=output_len,
            finish_reason=finish_reason,
            arrived_at=self.now,
            text_seed=self.rng.getrandbits(32),
            priority=priority,
            lora=lora,
            listener=listener,
        )
        seq.prompt = prompt
        if lora is not None:
            seq.block_hashes = _adapter_hashes(seq.block_hashes, lora)
        self.stats.prompt_tokens += prompt_len
        self.waiting.push(seq)
        self._admit(self.now)
        self.advance(self.now)
        return seq

    def abort(self, seq: Sequence, now: float) -> None:
        """Drop a request whose client went away; frees its blocks. No-op when already done."""
        if seq.done:
            return
        self.advance(now)
        if seq.done:
            return
        if seq.state is SeqState.WAITING:
            self.waiting.remove(seq)
            self._finalise(seq, self.now, SeqState.ABORTED)
        else:
            self._finalise(seq, self.now, SeqState.ABORTED)
            self._admit(self.now)

    def reset_prefix_cache(self, now: float, *, reset_running_requests: bool = False) -> bool:
        """vLLM's prefix-cache reset at `now`: no cached block hits any more; True when done.

        Refused (False) while sequences run, as vLLM refuses while blocks are in use, unless
        `reset_running_requests`: then the running sequences keep their blocks, uncached, until
        they end, and register none (vLLM preempts them and computes them again instead).
        """
        self.advance(now)
        if self.running and not reset_running_requests:
            return False
        detached = self.kv.clear()
        for seq in self.running:
            seq.held_hashes = [detached.get(key, key) for key in seq.held_hashes]
            seq.hit_blocks = len(seq.block_hashes)  # nothing left to register
        if self.kv_events is not None:
            self.kv_events.cleared(self.now)
        return True

    # -- time ------------------------------------------------------------------------------
    def next_due(self) -> float | None:
        """Simulated time of the next event, or None when idle (nothing running)."""
        due = self._due
        while due and due[0][2].state is not SeqState.RUNNING:
            heapq.heappop(due)  # lazily drop aborted sequences
        return due[0][0] if due else None

    def advance(self, now: float) -> None:
        """Process every event due at or before `now`, in time order."""
        if now > self.now:
            self.now = now
        due = self._due
        while due and due[0][0] <= self.now:
            at, _, seq = heapq.heappop(due)
            if seq.state is SeqState.RUNNING:
                self._emit(seq, at)

    def itl(self) -> float:
        """Inter-token latency at the current batch size."""
        return self.params.itl_base + self.params.itl_per_running_seq * len(self.running)

    # -- internals -------------------------------------------------------------------------
    def _admit(self, at: float) -> None:
        params = self.params
        kv = self.kv
        block_size = params.block_size
        while self.waiting and len(self.running) < params.max_num_seqs:
            seq = self.waiting.peek()
            hashes = seq.block_hashes
            hits = kv.longest_prefix(hashes)
            if hits * block_size >= seq.prompt_tokens:
                hits -= 1  # like vLLM, always recompute the last prompt token
            prompt_blocks = -(-seq.prompt_tokens // block_size)
            total_blocks = -(-(seq.prompt_tokens + seq.output_len) // block_size)
            hit_hashes = hashes[:hits]
            if not kv.can_admit(hit_hashes, total_blocks - hits):
                break  # the head waits for blocks, nobody overtakes it
            self.waiting.pop()
            evicted = kv.admit(hit_hashes, prompt_blocks - hits, total_blocks - prompt_blocks)
            if evicted and self.kv_events is not None:
                self.kv_events.removed(at, evicted)
            seq.held_hashes = list(hit_hashes)
            seq.hit_blocks = hits
            seq.private_blocks = prompt_blocks - hits
            seq.reserved_blocks = total_blocks - prompt_blocks
            seq.allocated_blocks = prompt_blocks
            seq.cached_tokens = hits * block_size
            seq.state = SeqState.RUNNING
            seq.admitted_at = at
            self.stats.prefix_cache_queries += seq.prompt_tokens
            self.stats.prefix_cache_hits += seq.cached_tokens
            self.running.add(seq)
            uncached = seq.prompt_tokens - seq.cached_tokens
            first_at = at + params.prefill_base + params.prefill_per_token * uncached
            heapq.heappush(self._due, (first_at, seq.seq_id, seq))

    def _emit(self, seq: Sequence, at: float) -> None:
        if seq.emitted == 0:
            seq.first_token_at = at
            self._register_prompt_blocks(seq, at)
            if self._on_first_token is not None:
                self._on_first_token(seq)
        seq.emitted += 1
        self.stats.generation_tokens += 1
        # The new token's KV needs a block once it crosses a block boundary.
        needed = -(-(seq.prompt_tokens + seq.emitted) // self.params.block_size)
        if needed > seq.allocated_blocks and seq.reserved_blocks > 0:
            evicted = self.kv.grow()
            if evicted is not None and self.kv_events is not None:
                self.kv_events.removed(at, [evicted])
            seq.reserved_blocks -= 1
            seq.private_blocks += 1
            seq.allocated_blocks += 1
        if seq.emitted >= seq.output_len:
            self._finalise(seq, at, SeqState.FINISHED)
            self._admit(at)
        else:
            heapq.heappush(self._due, (at + self.itl(), seq.seq_id, seq))
            if seq.listener is not None:
                seq.listener(seq)

    def _register_prompt_blocks(self, seq: Sequence, at: float) -> None:
        kv = self.kv
        hashes = seq.block_hashes
        registered = []
        for index in range(seq.hit_blocks, len(hashes)):
            if kv.register(hashes[index]):
                seq.private_blocks -= 1
                seq.held_hashes.append(hashes[index])
                registered.append(index)
        if registered and self.kv_events is not None:
            block_size = self.params.block_size
            self.kv_events.stored(at, hashes, registered, seq.prompt, block_size, seq.lora)

    def _finalise(self, seq: Sequence, at: float, state: SeqState) -> None:
        if seq.state is SeqState.RUNNING:
            self.running.discard(seq)
            self.kv.release(seq.held_hashes, seq.private_blocks, seq.reserved_blocks)
            seq.held_hashes = []
            seq.private_blocks = seq.reserved_blocks = 0
        seq.state = state
        seq.finished_at = at
        reason = "abort" if state is SeqState.ABORTED else seq.finish_reason
        self.stats.finished[reason] += 1
        if self._on_finish is not None:
            self._on_finish(seq)
        if seq.listener is not None:
            seq.listener(seq)


def _adapter_hashes(hashes: list[int], lora: str) -> list[int]:
    """A prompt's chain hashes under a LoRA adapter: still a chain (equal exactly when the
    base hashes are), but distinct for each adapter name and from the base model's."""
    key = zlib.crc32(lora.encode())
    return [hash((key, block_hash)) for block_hash in hashes]
