"""The edge following the applied config (`llmgw config apply`) and the live fleet: a read-only
watch of the fleet bucket, and each new revision's live fields (`llmgw.fleet.applied_config`)
with the fleet's endpoints swapped in between two requests (`Edge.follow_config`): the models
and aliases that `/v1/models` lists and requests are checked against (added or removed), the
bands of the band header, retries, timeouts, the providers' upstream keys, prices and budgets,
which endpoints speak the Messages API, and the endpoints the edge falls back on while NATS is
unreachable (`admission.on_nats_outage: local`).

The edge only reads the bucket (its NATS role may read it, not create it): when it does not
exist yet, or cannot be read, the edge runs on its file and says so, as before. Every edge
answers `llmgw config apply`'s question on EDGE_CONFIG_SUBJECT with the revision it runs on
(`EdgeConfigReply`), so the command waits for separate edges too.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from llmgw.fleet import Fleet, applied_config, with_fleet_endpoints
from llmgw.state.fleet import FleetMirror, open_fleet
from llmgw.wire import EDGE_CONFIG_SUBJECT, EdgeConfigReply

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from llmgw.config.schema import Config
    from llmgw.services.edge.app import Edge

log = logging.getLogger("llmgw.edge.config")


class AppliedConfigFollower:
    """Applies each fleet snapshot to one edge (`Edge.follow_config`): the applied config's
    live fields, parsed once per revision, with the fleet's endpoints. A snapshot that changes
    neither (a registered engine's heartbeat) changes nothing. Until the fleet holds an
    endpoint (not seeded yet) the edge keeps its file's."""

    def __init__(self, edge: Edge, base: Config) -> None:
        self.edge = edge
        self.base = base
        self.revision = 0  # the applied config's revision in force here (0: the file)
        self._running = base  # `base` with the applied config's live fields
        self._shape: object = None

    def __call__(self, fleet: Fleet) -> None:
        if fleet.applied is not None and fleet.config_revision != self.revision:
            self._running = applied_config(self.base, fleet.applied)
        shape = fleet.shape()
        if shape == self._shape:
            return
        self._shape = shape
        config = with_fleet_endpoints(self._running, fleet) if fleet.records else self._running
        self.edge.follow_config(config, fleet.view().draining)
        if fleet.config_revision != self.revision:
            self.revision = fleet.config_revision
            log.info("applied config revision %d in force", self.revision)


class Following:
    """The edge's following of the applied config: its own watch (None: it follows the
    colocated admission instance's mirror, or nothing) and its answers to `llmgw config
    apply`'s question (EDGE_CONFIG_SUBJECT: which revision it runs on)."""

    def __init__(self, follower: AppliedConfigFollower, mirror: FleetMirror | None) -> None:
        self.follower = follower
        self.mirror = mirror
        self.follows = True
        self._sub: Subscription | None = None

    def reply(self) -> EdgeConfigReply:
        return EdgeConfigReply(
            edge=self.follower.edge.edge_id,
            config_revision=self.follower.revision,
            follows=self.follows,
        )

    async def answer(self, nc: NATS) -> None:
        async def respond(msg: Msg) -> None:
            if msg.reply:
                with contextlib.suppress(Exception):  # the asker may be gone
                    await nc.publish(msg.reply, self.reply().model_dump_json().encode())

        self._sub = await nc.subscribe(EDGE_CONFIG_SUBJECT, cb=respond)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        if self.mirror is not None:
            await self.mirror.stop()


async def follow_applied_config(
    nc: NATS, config: Config, edge: Edge, colocated: FleetMirror | None = None
) -> Following:
    """Start following the applied config for `edge`: on the `colocated` admission instance's
    mirror when there is one (the edge then runs on a revision no later than that instance's
    acknowledgement), else on a watch of its own; and answer `llmgw config apply` with the
    revision it runs on. When the fleet bucket cannot be read the edge runs on `config` and
    says so (in the log and in its answers)."""
    following = Following(AppliedConfigFollower(edge, config), None)
    mirror = colocated
    if mirror is None:
        try:
            mirror = following.mirror = FleetMirror(await open_fleet(nc, config))
            await mirror.start()
        except Exception as exc:  # permissions, a bucket not created yet: both say the same
            log.warning("the applied config is not followed (runs on its file): %s", exc)
            following.mirror, following.follows = None, False
            mirror = None
    if mirror is not None:
        if mirror.ready.is_set():
            following.follower(mirror.fleet)
        mirror.on_change(following.follower)
    await following.answer(nc)
    return following
