"""Asking everyone: one request on a subject every instance of a service answers, and the answers
collected for a fixed window (a broadcast has no count of answers to wait for).

`ask_instances` asks every admission instance for its state (`StateReply`: leases, pins, quota,
the config revision it runs on): `llmgw state`, `llmgw endpoints` (leases per endpoint) and
`llmgw config apply` (who runs on the new revision) read it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from llmgw.wire import ADMISSION_STATE_SUBJECT, StateReply

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

__all__ = ["STATE_WINDOW", "ask_everyone", "ask_instances"]

M = TypeVar("M", bound=BaseModel)

STATE_WINDOW = 0.5  # seconds the admission instances have to answer a state request


async def ask_instances(nc: NATS, window: float = STATE_WINDOW) -> list[StateReply]:
    """Every admission instance's answer to a state request within `window` seconds."""
    return await ask_everyone(nc, ADMISSION_STATE_SUBJECT, StateReply, window)


async def ask_everyone(nc: NATS, subject: str, answer: type[M], window: float) -> list[M]:
    """Every answer (of type `answer`) to an empty request on `subject` within `window`
    seconds; answers that do not decode are left out."""
    replies: list[M] = []

    async def collect(msg: Any) -> None:
        try:
            replies.append(answer.model_validate_json(msg.data))
        except ValueError:
            pass

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=collect)
    await nc.publish(subject, b"", reply=inbox)
    await asyncio.sleep(window)  # a broadcast has no count of answers to wait for
    await sub.unsubscribe()
    return replies
