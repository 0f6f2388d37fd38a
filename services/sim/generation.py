"""The contract between the OpenAI HTTP layer and a simulated backend (engine or provider).

A backend turns a tokenized request into a `Generation`: an object whose `emitted` count grows
over time until `done`. The HTTP layer only reads it, waits on it and closes it; it never knows
how tokens are paced. `close()` must be called exactly once when the response ends (normally or
because the client went away) and is idempotent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Backend", "Generation", "OutputLimits", "SimError"]


class SimError(Exception):
    """A request the simulator answers with an OpenAI-shaped error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | int | None = None,  # vLLM's own errors carry the status here
        param: str | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = list(headers)


@dataclass(frozen=True, slots=True)
class OutputLimits:
    """What a request says about its output length (vLLM's sampling parameters): at most
    `max_tokens` (None: the context's room), at least `min_tokens`, and with `ignore_eos` exactly
    the cap (the model never ends on its own)."""

    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False


class Generation(Protocol):
    """Tokens of one response, produced over time."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache."""
        ...

    @property
    def output_len(self) -> int:
        """Tokens this generation will produce in total (unless closed early)."""
        ...

    @property
    def finish_reason(self) -> str: ...

    @property
    def text_seed(self) -> int:
        """Seed of the generated filler text."""
        ...

    @property
    def emitted(self) -> int:
        """Tokens generated so far (never decreases, at most `output_len`)."""
        ...

    @property
    def done(self) -> bool: ...

    async def wait(self, seen: int) -> None:
        """Return once ``emitted > seen`` or the generation is done (or closed)."""
        ...

    def close(self) -> None: ...


class Backend(Protocol):
    """What a simulated server does with requests; the HTTP layer does the rest."""

    def start(
        self,
        prompt: Sequence[int],
        limits: OutputLimits,
        priority: int = 0,
        lora: str | None = None,
    ) -> Generation:
        """Begin generating; raises SimError (400 prompt too long, 429 rate limited...).

        `lora` names the LoRA adapter the request asked for (None: the base model); a backend
        without adapters ignores it.

        The output ends where the model would end it, within `limits` (`sampling.output_length`).

        `priority` is the request's vLLM ``priority`` field (0 when absent); a backend that has
        no scheduling policy ignores it. `lora` is the LoRA adapter the request names (None:
        a served model).
        """
        ...

    def embedding_delay(self, prompt_tokens: int) -> float:
        """Seconds an embeddings request over that many tokens takes (may record metrics)."""
        ...

    def state(self) -> Mapping[str, Any]:
        """JSON-able snapshot for GET /sim/state."""
        ...

    def metrics(self) -> tuple[bytes, str] | None:
        """Prometheus exposition and its content type, or None when not exposed."""
        ...

    def shutdown(self) -> None:
        """Cancel timers; called once when the server stops."""
        ...
