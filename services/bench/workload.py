"""What to send and when (pure): prompt text, conversations with growing history, arrivals.

Prompt text is plain lower-case English: words of two to four letters from a fixed list and a
period every few words. Each such word (with its leading space) and each period is one token for
typical BPE tokenizers (GPT, Llama, Qwen) and for the simulator's tokenizer, so
``prompt_text(rng, n)`` is about n tokens (about 4.3 characters per token); a chat template adds
a few tokens per message on top.

A `Conversations` pool hands out the next request to send. Without sessions every request is a
fresh one-turn conversation. With ``sessions=N`` there are N conversations; each has a number of
turns drawn from ``turns``, sends one turn at a time (the next only after the previous reply
came back, like a chat client), and resends the whole history (every earlier user message and
assistant reply) with each new user message, so an engine's prefix cache can hit. A finished
conversation is replaced by a fresh one with a new session id. A failed turn is dropped from the
history (the user gives up on that message) and the conversation goes on with its next turn.

Invariants: the same seed and the same sequence of `next_request` / `complete` calls give the
same requests; a conversation never has two requests in flight; request indexes are 0, 1, 2, ...
in the order requests are handed out.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from llmgw.services.bench.distributions import Distribution

__all__ = [
    "WORDS",
    "Conversations",
    "Message",
    "RequestPlan",
    "WeightedChoice",
    "WorkloadSpec",
    "arrival_times",
    "completion_prompt",
    "prompt_text",
]

# Common words of 2-4 letters: each is a single token (with its leading space) in the usual BPE
# vocabularies, and a single piece for the simulator's tokenizer (runs of at most 4 letters).
WORDS = tuple(
    """
    the and for are but not you all any can had her was one our out day get has him his how man
    new now old see two way who boy did its let put say she too use time year work life good make
    know take come give look find tell feel call hand part home game city book word side kind
    head long high best last next open real play move live show keep hold turn help food rain
    tree road ship farm fish bird door wall hill lake moon star wind fire snow gold blue red dark
    warm cold soft hard fast slow near late rock sand salt milk tea cup box bag car bus map key
    hat sun sky sea air oil ice art war law job act age area data fact form idea line list name
    note page plan rule step team test type unit view week land song love hope
    """.split()
)
SENTENCE_WORDS = 11
"""A period follows every this many words (so the text reads as sentences)."""


def prompt_text(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of text: words and periods, each one token (see the module doc)."""
    pieces: list[str] = []
    for index in range(tokens):
        if index % (SENTENCE_WORDS + 1) == SENTENCE_WORDS:
            pieces.append(".")
        else:
            pieces.append(" " + rng.choice(WORDS))
    return "".join(pieces).lstrip()


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class WeightedChoice:
    """Names drawn with probability proportional to their weights; one name always wins."""

    names: tuple[str, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.names or len(self.names) != len(self.weights):
            raise ValueError("a weighted choice needs as many weights as names, at least one")
        if any(not w > 0 for w in self.weights):
            raise ValueError("weights must be > 0")

    def pick(self, rng: random.Random) -> str:
        if len(self.names) == 1:
            return self.names[0]  # consumes no randomness
        return rng.choices(self.names, self.weights)[0]


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """The shape of the requests. ``sessions`` None: every request is its own conversation."""

    prompt_tokens: Distribution
    output_tokens: Distribution
    sessions: int | None = None
    turns: Distribution | None = None
    bands: WeightedChoice | None = None
    api_keys: tuple[str, ...] = ()
    run_id: str = "bench"

    def __post_init__(self) -> None:
        if self.sessions is not None and self.sessions < 1:
            raise ValueError(f"sessions must be >= 1, got {self.sessions}")


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """One request to send: ``messages`` is the whole history, ending with the new user message."""

    index: int
    conversation: int
    session_id: str | None
    turn: int
    messages: tuple[Message, ...]
    max_tokens: int
    new_prompt_tokens: int
    band: str | None
    api_key: str | None


@dataclass(slots=True)
class _Conversation:
    number: int
    session_id: str | None
    turns: int
    band: str | None
    api_key: str | None
    history: list[Message] = field(default_factory=list)
    sent: int = 0


class Conversations:
    """Hands out requests (see the module docstring); `complete` reports how each one ended."""

    def __init__(self, spec: WorkloadSpec, rng: random.Random) -> None:
        self.spec = spec
        self._rng = rng
        self._next_index = 0
        self._next_conversation = 0
        self._ready: deque[_Conversation] = deque()
        self._busy: dict[int, _Conversation] = {}
        for _ in range(spec.sessions or 0):
            self._ready.append(self._new_conversation())

    @property
    def in_flight(self) -> int:
        return len(self._busy)

    def next_request(self) -> RequestPlan | None:
        """The next request, or None when every conversation is waiting for a reply."""
        if self.spec.sessions is None:
            conversation = self._new_conversation()
        elif self._ready:
            conversation = self._ready.popleft()
        else:
            return None
        tokens = self.spec.prompt_tokens.sample(self._rng)
        conversation.history.append(Message("user", prompt_text(self._rng, tokens)))
        plan = RequestPlan(
            index=self._next_index,
            conversation=conversation.number,
            session_id=conversation.session_id,
            turn=conversation.sent,
            messages=tuple(conversation.history),
            max_tokens=self.spec.output_tokens.sample(self._rng),
            new_prompt_tokens=tokens,
            band=conversation.band,
            api_key=conversation.api_key,
        )
        self._next_index += 1
        conversation.sent += 1
        self._busy[plan.index] = conversation
        return plan

    def complete(self, plan: RequestPlan, reply: str | None) -> None:
        """`plan` ended: with the assistant's `reply` text, or failed (None)."""
        conversation = self._busy.pop(plan.index)
        if reply is None:
            conversation.history.pop()  # the failed user message leaves the history
        else:
            conversation.history.append(Message("assistant", reply))
        if self.spec.sessions is None:
            return
        if conversation.sent >= conversation.turns:
            conversation = self._new_conversation()
        self._ready.append(conversation)

    def _new_conversation(self) -> _Conversation:
        spec = self.spec
        number = self._next_conversation
        self._next_conversation += 1
        turns = 1
        session_id = None
        if spec.sessions is not None:
            turns = spec.turns.sample(self._rng) if spec.turns is not None else 1
            session_id = f"{spec.run_id}-s{number}"
        band = spec.bands.pick(self._rng) if spec.bands is not None else None
        key = spec.api_keys[number % len(spec.api_keys)] if spec.api_keys else None
        return _Conversation(number, session_id, turns, band, key)


def completion_prompt(messages: Sequence[Message]) -> str:
    """A conversation as one completions prompt; each turn extends the previous turn's prompt."""
    lines = [f"{m.role.capitalize()}: {m.content}\n" for m in messages]
    return "".join(lines) + "Assistant:"


def arrival_times(rate: float, process: str, rng: random.Random) -> Iterator[float]:
    """Send times in seconds from the start: ``poisson`` (exponential gaps) or ``fixed`` (1/rate).

    The first request goes at 0 for ``fixed`` and after one exponential gap for ``poisson``.
    """
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if process not in ("poisson", "fixed"):
        raise ValueError(f"arrival process must be poisson or fixed, got {process!r}")
    at = 0.0
    count = 0
    while True:
        if process == "poisson":
            at += rng.expovariate(rate)
            yield at
        else:
            yield count / rate
            count += 1
