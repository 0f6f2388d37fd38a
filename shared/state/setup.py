"""Building a service's RoutingState from the config (one place, used by every service)."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from llmgw.state.nats_kv import open_routing_bucket
from llmgw.state.routing_state import RoutingState

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from llmgw.config.schema import Config
    from llmgw.core.leases import PairLimits


def limits_from_config(config: Config) -> dict[tuple[str, str], PairLimits | None]:
    """(provider, model) -> its limits, or None for a pair without configured limits."""
    return {(p.id, m.name): m.limits for p in config.providers for m in p.models}


async def open_routing_state(
    nc: NATS, config: Config, *, instance_id: str, follow_slots: bool = True
) -> RoutingState:
    """The shared routing state over the configured bucket (created on first use).

    `follow_slots` starts the watch-fed slot mirror that admission needs to
    pick free slots; an edge only renews and releases leases it was given and
    leaves it off.
    """
    pinning = config.pinning
    kv = await open_routing_bucket(
        nc.jetstream(),
        pinning.bucket,
        storage=pinning.storage,
        replicas=config.replicas_of(pinning.bucket),
        history=pinning.history,
    )
    state = RoutingState(
        kv,
        limits_from_config(config),
        clock=time.time,
        rng=random.Random(),
        lease_timeout=pinning.lease_timeout,
        pin_inactivity_timeout=pinning.pin_inactivity_timeout,
        instance_id=instance_id,
    )
    if follow_slots:
        await state.start()
    return state
