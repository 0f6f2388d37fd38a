"""`llmgw events`: print the events the stream kept, then (with --follow) the new ones.

    llmgw events [--since 10m] [--follow] [--subject 'llmgw.v1.events.pin.>'] [--json]

One line per event: its stream time, subject and payload (`--json`: the payload alone, one JSON
object per line, for `jq`). Read-only: an ephemeral consumer on the events stream
(``events.stream``), nothing acknowledged or created. With `nats.url: embedded` it reaches the
server `llmgw up` started with the same config.

Exit codes: 0 printed (also when nothing matched); 1 NATS unreachable or no events stream;
2 config or argument problem.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from nats.js.errors import NotFoundError

from llmgw import natsconn
from llmgw.config.durations import parse_duration
from llmgw.event_stream import StoredEvent, read_events
from llmgw.events import EVENTS_SUBJECT_PREFIX
from llmgw.runtime import load_tool_config

if TYPE_CHECKING:
    from llmgw.config.schema import Config

__all__ = ["format_event", "run"]


def _subject(given: str) -> str:
    return given if given.startswith(EVENTS_SUBJECT_PREFIX) else f"{EVENTS_SUBJECT_PREFIX}.{given}"


def format_event(event: StoredEvent, as_json: bool) -> str:
    payload = event.data.decode(errors="replace")
    if as_json:
        return payload
    at = event.at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z" if event.at else "?"
    return f"{at} {event.subject} {payload}"


def run(args: argparse.Namespace) -> int:
    config = load_tool_config(args)
    since = None
    if args.since is not None:
        try:
            since = datetime.fromtimestamp(time.time() - parse_duration(args.since), UTC)
        except ValueError as exc:
            print(f"llmgw events: --since: {exc}", file=sys.stderr)
            return 2
    refusals = natsconn.Refusals()
    try:
        return asyncio.run(
            _print(config, _subject(args.subject), since, args.follow, args.json, refusals)
        )
    except ValueError as exc:  # an embedded config without a fixed port
        print(f"llmgw events: {exc}", file=sys.stderr)
        return 2
    except NotFoundError:
        print(
            f"llmgw events: no events stream {config.events.stream!r} (admission, the reaper and "
            "the scraper create it when they start; is `events.enabled` false?)",
            file=sys.stderr,
        )
        return 1
    except natsconn.UNREACHABLE as exc:
        return refusals.report("events", exc, "cannot read from NATS")


async def _print(
    config: Config,
    subject: str,
    since: datetime | None,
    follow: bool,
    as_json: bool,
    refusals: natsconn.Refusals | None = None,
) -> int:
    nc = await natsconn.connect_tool(config.nats, "llmgw-events", refusals)
    try:
        js = nc.jetstream()
        await js.stream_info(config.events.stream)  # NotFoundError: a clear message above
        async for event in read_events(
            js, config.events.stream, subject, since=since, follow=follow
        ):
            print(format_event(event, as_json), flush=follow)
    finally:
        await nc.close()
    return 0
