"""Stopping background tasks reliably.

`cancel_and_wait` cancels tasks and waits for them, but never forever: on Python 3.11 a
cancellation that races a NATS reply inside nats-py's `asyncio.wait_for` can be swallowed, so a
loop may survive its cancel. Loops therefore also check a flag (`Stopping`) after every await,
and this waits at most `timeout` before giving up on a task (logged, not raised).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

__all__ = ["cancel_and_wait"]

log = logging.getLogger("llmgw.tasks")


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object]], timeout: float = 2.0) -> None:
    """Cancel `tasks` and wait up to `timeout` seconds for all of them to end."""
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    done, still = await asyncio.wait(pending, timeout=timeout)
    for task in done:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            task.result()
    for task in still:
        task.cancel()  # once more: it swallowed the first
        log.warning("task %s did not stop within %.1fs", task.get_name(), timeout)
