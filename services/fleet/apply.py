"""`llmgw config apply FILE`: a config changed without a restart (also `llmgw up` on SIGHUP).

The file is validated as a service would load it (errors name the field, exit 2, nothing is
stored); its endpoints seed the fleet as a start with the file would (`fleet.seed`: those
the fleet lacks join it, a provider's added with the provider); then its values are stored in
the fleet bucket (`llmgw.fleet.APPLIED_KEY`), every
admission instance and scraper picks them up through its watch, and the command waits until
every admission instance that answers runs on the new revision, and every edge that answers
and follows the applied config too: that is the acknowledgement (`StateReply.config_revision`;
each edge's `EdgeConfigReply`, on EDGE_CONFIG_SUBJECT). What changes live and what needs a restart: docs/config.md,
"What changes without a restart".

Exit codes: 0 applied and acknowledged; 1 NATS unreachable, or not acknowledged in time (the
document is stored: the instances that did not answer apply it when they do); 2 an invalid file.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import yaml

from llmgw import natsconn
from llmgw.broadcast import ask_everyone, ask_instances
from llmgw.config import ConfigError, load_config
from llmgw.fleet import AppliedConfig
from llmgw.state.fleet import open_fleet
from llmgw.wire import EDGE_CONFIG_SUBJECT, EdgeConfigReply

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from llmgw.config import Config

__all__ = ["Applied", "apply_file", "ask_edges", "file_values", "run"]

_ACK_WINDOW = 0.3  # seconds each round of state answers is collected


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        for line in exc.lines:
            print(line, file=sys.stderr)
        print("llmgw config apply: nothing was stored", file=sys.stderr)
        return 2
    offset = int(getattr(args, "port_offset", None) or 0)
    if offset and config.nats.is_embedded and config.nats.embedded_port != 0:
        # The cluster `llmgw up --port-offset N` started (as `llmgw state --port-offset N`).
        moved = config.nats.model_copy(update={"embedded_port": config.nats.embedded_port + offset})
        config = config.model_copy(update={"nats": moved})
    refusals = natsconn.Refusals()
    values = file_values(args.file)

    async def main() -> Applied:
        nc = await natsconn.connect_tool(config.nats, "llmgw-config", refusals)
        try:
            return await apply_file(nc, config, values, str(args.file), wait=args.wait)
        finally:
            await nc.close()

    try:
        applied = asyncio.run(main())
    except natsconn.UNREACHABLE as exc:
        return refusals.report("config apply", exc)
    revision, acknowledged, instances = applied.revision, applied.on_it, applied.answering
    edges = len(applied.edges) - len(applied.unfollowing_edges)
    for edge in applied.unfollowing_edges:
        print(f"llmgw config apply: edge {edge} runs on its file (restart it)", file=sys.stderr)
    if acknowledged < instances or instances == 0 or applied.lagging_edges:
        lagging = applied.lagging_edges
        print(
            f"llmgw config apply: stored (revision {revision}), but only {acknowledged} of "
            f"{instances} admission instances and {edges - len(lagging)} of {edges} edges run "
            f"on it after {args.wait:g}s" + (f" (not: {', '.join(lagging)})" if lagging else ""),
            file=sys.stderr,
        )
        return 1
    print(
        f"applied {args.file} (revision {revision}): {instances} admission instances run on "
        f"it, and {edges} edges"
    )
    return 0


def file_values(path: str | Path) -> dict[str, Any]:
    """A config file's own values (no environment): what is stored and applied. An admin
    token written in the file is left out: every service reads it at its start only, and the
    fleet bucket is readable by roles that must not learn it."""
    values: dict[str, Any] = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    auth = values.get("auth") if isinstance(values, dict) else None
    if isinstance(auth, dict):
        auth.pop("admin_token", None)
    return values


class Applied(NamedTuple):
    """What `apply_file` stored and who runs on it: the revision, the admission instances
    that run on it of those that answered, and the edges that answered (each edge's own
    answer: the revision it runs on, and whether it follows the applied config at all)."""

    revision: int
    on_it: int
    answering: int
    edges: tuple[EdgeConfigReply, ...] = ()

    @property
    def lagging_edges(self) -> list[str]:
        """Edges that follow the applied config and do not run on this revision yet."""
        return sorted(e.edge for e in self.edges if e.follows and e.config_revision < self.revision)

    @property
    def unfollowing_edges(self) -> list[str]:
        """Edges that run on their file (they could not read the fleet bucket)."""
        return sorted(e.edge for e in self.edges if not e.follows)


async def ask_edges(nc: NATS, window: float) -> list[EdgeConfigReply]:
    """Every edge's answer (EDGE_CONFIG_SUBJECT) within `window` seconds."""
    return await ask_everyone(nc, EDGE_CONFIG_SUBJECT, EdgeConfigReply, window)


async def apply_file(
    nc: NATS, config: Config, values: dict[str, Any], source: str, *, wait: float
) -> Applied:
    """Store a validated file's `values`; what runs on it once every answering admission
    instance and every answering edge that follows the applied config runs on it, or after
    `wait` seconds."""
    bucket = await open_fleet(nc, config)
    if config.fleet.seed:  # its endpoints join as they would at a start with this file
        await bucket.seed(config)
    revision = await bucket.apply_config(
        AppliedConfig(config=values, source=source, applied_at=time.time())
    )
    deadline = time.monotonic() + wait
    while True:
        replies, edges = await asyncio.gather(
            ask_instances(nc, _ACK_WINDOW), ask_edges(nc, _ACK_WINDOW)
        )
        on_it = sum(reply.config_revision >= revision for reply in replies)
        applied = Applied(revision, on_it, len(replies), tuple(edges))
        done = replies and on_it == len(replies) and not applied.lagging_edges
        if done or time.monotonic() >= deadline:
            return applied
