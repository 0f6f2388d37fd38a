"""The edge following the applied config (`llmgw config apply`): a read-only watch of the fleet
bucket, and each new revision's live fields (`llmgw.fleet.applied_config`) swapped in between
two requests (`Edge.follow_config`): the models and aliases that `/v1/models` lists and
requests are checked against (added or removed), the bands of the band header, retries,
timeouts and a new provider's upstream key.

The edge only reads the bucket (its NATS role may read it, not create it): when it does not
exist yet, or cannot be read, the edge runs on its file and says so, as before.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from llmgw.fleet import Fleet, applied_config
from llmgw.state.fleet import FleetMirror, open_fleet

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from llmgw.config.schema import Config
    from llmgw.services.edge.app import Edge

log = logging.getLogger("llmgw.edge.config")


class AppliedConfigFollower:
    """Applies each new applied-config revision to one edge (`Edge.follow_config`)."""

    def __init__(self, edge: Edge, base: Config) -> None:
        self.edge = edge
        self.base = base
        self.revision = 0  # the applied config's revision in force here (0: the file)

    def __call__(self, fleet: Fleet) -> None:
        if fleet.applied is None or fleet.config_revision == self.revision:
            return  # an endpoint's change: not the edge's business (admission places)
        self.edge.follow_config(applied_config(self.base, fleet.applied))
        self.revision = fleet.config_revision
        log.info("applied config revision %d in force", self.revision)


async def follow_applied_config(
    nc: NATS, config: Config, edge: Edge, colocated: FleetMirror | None = None
) -> FleetMirror | None:
    """Start following the applied config for `edge`: on the `colocated` admission instance's
    mirror when there is one (the edge then runs on a revision no later than that instance's
    acknowledgement), else on a watch of its own, returned to be stopped at the end; None
    when the fleet bucket cannot be read (the edge then runs on `config`)."""
    follower = AppliedConfigFollower(edge, config)
    mirror = colocated
    if mirror is None:
        try:
            mirror = FleetMirror(await open_fleet(nc, config))
            await mirror.start()
        except Exception as exc:  # permissions, a bucket not created yet: both say the same
            log.warning("the applied config is not followed (runs on its file): %s", exc)
            return None
    if mirror.ready.is_set():
        follower(mirror.fleet)
    mirror.on_change(follower)
    return None if colocated is not None else mirror
