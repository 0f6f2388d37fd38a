"""`llmgw state`: pins, leases and capacity use, from the live routing bucket and the admission
instances (leases live in the instances that hold them; each answers a state request).

Read-only: it binds the configured buckets (never creates them) and lists them: the routing
bucket, and the load bucket for each managed endpoint's latest scraper report (health, metrics
dialect, load). With the local config (`nats.url: embedded`) it reaches the server `llmgw up`
started with that config on this machine (`nats.embedded_port`, moved by `--port-offset N` for a
cluster started with `llmgw up --port-offset N`); elsewhere it uses `nats.url` (or
LLMGW_NATS__URL).

Exit codes: 0 printed; 1 NATS unreachable or no bucket; 2 config problem.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from llmgw import natsconn
from llmgw.broadcast import ask_instances
from llmgw.config import Config, limits_from_config
from llmgw.core.sessions import sessions_of_key
from llmgw.load import REPORT_KEY_PREFIX, EndpointReport
from llmgw.runtime import load_tool_config
from llmgw.services.state.report import (
    StateReport,
    build_report,
    descendants,
    format_report,
    report_json,
)
from llmgw.state.nats_kv import NatsKV
from llmgw.state.store import RoutingStore

LOAD_READ_TIMEOUT = 2.0  # seconds for the (optional) read of the load bucket

__all__ = ["BucketMissing", "read_report", "run"]


class BucketMissing(LookupError):
    """The configured routing bucket does not exist on the server."""


def run(args: argparse.Namespace) -> int:
    config = load_tool_config(args)
    refusals = natsconn.Refusals()
    try:
        report = asyncio.run(_read(config, refusals))
    except ValueError as exc:  # an embedded config without a fixed port
        print(f"llmgw state: {exc}", file=sys.stderr)
        return 2
    except BucketMissing as exc:
        print(f"llmgw state: {exc}", file=sys.stderr)
        return 1
    except natsconn.UNREACHABLE as exc:
        return refusals.report("state", exc, f"cannot read from NATS at {config.nats.url}")
    with_pins = bool(getattr(args, "pins", False))
    key = getattr(args, "session", None)
    if key is not None:  # the pins of one client's session key, hashed as the edge hashes it
        wanted = descendants(
            report.pins, set(sessions_of_key(key, [m.name for m in config.models]))
        )
        report = dataclasses.replace(
            report, pins=tuple(p for p in report.pins if p.session in wanted)
        )
        with_pins = True
    if getattr(args, "json", False):
        print(json.dumps(report_json(report, with_pins=with_pins), indent=2))
    else:
        print(format_report(report, with_pins=with_pins))
    return 0


async def _read(config: Config, refusals: natsconn.Refusals | None = None) -> StateReport:
    nc = await natsconn.connect_tool(config.nats, "llmgw-state", refusals)
    try:
        return await read_report(nc, config)
    finally:
        await nc.close()


async def read_report(nc: NATS, config: Config, *, now: float | None = None) -> StateReport:
    """List the configured bucket and summarize it at `now` (default: the current time)."""
    pinning = config.pinning
    js = nc.jetstream()
    try:
        info = await js.stream_info(f"KV_{pinning.bucket}")
    except NotFoundError:
        raise BucketMissing(
            f"no routing bucket {pinning.bucket!r} on {config.nats.url} (is the gateway running "
            "with this config? admission creates the bucket when it starts)"
        ) from None
    store = RoutingStore(NatsKV(js, pinning.bucket, direct=bool(info.config.allow_direct)))
    replies = await ask_instances(nc)
    load_bucket, endpoints = await _endpoint_reports(js, config)
    pins = await store.all_pins()
    books = await store.quota_books()
    members = await store.members()
    owners = await store.shard_owners()
    return build_report(
        bucket=pinning.bucket,
        now=time.time() if now is None else now,
        limits=limits_from_config(config),
        pins=[(key, stored.value) for key, stored in pins],
        books=[b.value for b in books],
        members=[m.value for m in members],
        owners={k: v.value for k, v in owners.items()},
        replies=replies,
        shards=config.admission.shards,
        member_ttl=config.admission.member_ttl,
        lease_timeout=pinning.lease_timeout,
        pin_inactivity_timeout=pinning.pin_inactivity_timeout,
        endpoints=endpoints,
        load_bucket=load_bucket,
    )


async def _endpoint_reports(js: Any, config: Config) -> tuple[str | None, list[EndpointReport]]:
    """The scraper's latest report of each endpoint in the load bucket, best effort: (None, [])
    when there is no such bucket (no scraper has run) or it cannot be read within
    `LOAD_READ_TIMEOUT` (e.g. a NATS user without read access to it); reports that do not parse
    are skipped. The routing bucket's state is printed either way."""
    name = config.router.load_bucket
    try:
        async with asyncio.timeout(LOAD_READ_TIMEOUT):
            info = await js.stream_info(f"KV_{name}")
            kv = NatsKV(js, name, direct=bool(info.config.allow_direct))
            entries = await kv.list(REPORT_KEY_PREFIX)
    except (NotFoundError, TimeoutError, nats.errors.Error):
        return None, []
    reports = []
    for entry in entries:
        try:
            reports.append(EndpointReport.model_validate_json(entry.value))
        except ValueError:
            continue
    return name, reports
