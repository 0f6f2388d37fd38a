"""Time in tests: one stepped clock and one way to wait for a condition.

- `SteppedClock` (`llmgw.clock`): wall and monotonic time that move only when the test moves
  them (`advance(seconds)`, or `now = ...`); give it where a service takes a `Clock`, or its
  `wall` / `monotonic` where a constructor still takes a bare reader.
- `eventually(condition, timeout, what)`: polls an observable condition (a function, plain or
  async) until it holds, for state written by background tasks, other processes or servers. A
  test waits for what it needs this way, never with a fixed sleep.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from llmgw.clock import SteppedClock

__all__ = ["SteppedClock", "eventually"]

T = TypeVar("T")


async def eventually(
    condition: Callable[[], T | Awaitable[T]],
    timeout: float = 5.0,
    what: str = "",
    *,
    interval: float = 0.01,
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """The first truthy result of `condition()`, asked every `interval` seconds until `timeout`
    seconds (real, monotonic) have passed; then AssertionError naming `what` (default: the
    condition's name). Exceptions of the `ignoring` types count as "not yet" (a server between
    leaders), and the last one is named in the failure."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = condition()
            if inspect.isawaitable(result):
                result = await result
        except ignoring as exc:
            last_error = exc
        else:
            if result:
                return result  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            named = what or getattr(condition, "__name__", repr(condition))
            error = f" (last error: {last_error!r})" if last_error is not None else ""
            raise AssertionError(f"not within {timeout:g} s: {named}{error}")
        await asyncio.sleep(interval)
