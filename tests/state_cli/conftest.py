"""`llmgw state` fixtures: a bucket name unique to the test (deleted after), no LLMGW_ env."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from nats.aio.client import Client as NatsClient
from nats.js.errors import NotFoundError


@pytest_asyncio.fixture
async def bucket(nats_client: NatsClient, unique_id: str) -> AsyncIterator[str]:
    name = f"routing_{unique_id}"
    yield name
    with contextlib.suppress(NotFoundError):
        await nats_client.jetstream().delete_key_value(name)


@pytest.fixture(autouse=True)
def _no_llmgw_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command reads its config from the environment too; tests give it only the file."""
    for name in os.environ:
        if name.upper().startswith("LLMGW_"):
            monkeypatch.delenv(name)
