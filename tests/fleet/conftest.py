"""Fixtures of the live-fleet tests: the local config on a test's own buckets, its fleet
bucket (seeded, deleted after the test) and what admission instances answer about leases."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from fleet_helpers import Leases, local_config
from nats.aio.client import Client as NatsClient

from llmgw.config import Config
from llmgw.config.fleet import fleet_bucket
from llmgw.state.fleet import FleetBucket, open_fleet


@pytest.fixture
def config(nats_url: str, unique_id: str) -> Config:
    return local_config(nats_url, unique_id)


@pytest_asyncio.fixture
async def fleet(nats_client: NatsClient, config: Config) -> AsyncIterator[FleetBucket]:
    bucket = await open_fleet(nats_client, config)
    await bucket.seed(config)
    try:
        yield bucket
    finally:
        with contextlib.suppress(Exception):
            await nats_client.jetstream().delete_key_value(fleet_bucket(config))


@pytest.fixture
def leases() -> Leases:
    return Leases()
