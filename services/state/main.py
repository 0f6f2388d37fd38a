"""`llmgw state`: pins, leases and capacity use, read from the live routing bucket.

Read-only: it binds the configured bucket (never creates it) and lists it. It needs a NATS URL:
with the local config (`nats.url: embedded`) run it as `LLMGW_NATS__URL=<url> llmgw state`, with
the URL `llmgw up` prints ("llmgw up: edge ..., NATS nats://127.0.0.1:4222").

Exit codes: 0 printed; 1 NATS unreachable or no bucket; 2 config problem.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from llmgw import natsconn
from llmgw.config import Config
from llmgw.core.leasekeys import LEASE_PREFIX, PIN_PREFIX, PIN_SLOT_PREFIX
from llmgw.runtime import load_or_exit
from llmgw.services.state.report import StateReport, build_report, format_report, report_json
from llmgw.state.nats_kv import NatsKV
from llmgw.state.setup import limits_from_config

__all__ = ["BucketMissing", "read_report", "run"]

EMBEDDED_NATS_HELP = (
    "nats.url is 'embedded', so there is no server address to read from. Start the gateway "
    "with `llmgw up` (it prints 'NATS nats://HOST:PORT'), then run "
    "`LLMGW_NATS__URL=nats://HOST:PORT llmgw state`"
)


class BucketMissing(LookupError):
    """The configured routing bucket does not exist on the server."""


def run(args: argparse.Namespace) -> int:
    config = load_or_exit(args.config)
    if config.nats.is_embedded:
        print(f"llmgw state: {EMBEDDED_NATS_HELP}", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(_read(config))
    except BucketMissing as exc:
        print(f"llmgw state: {exc}", file=sys.stderr)
        return 1
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        print(
            f"llmgw state: cannot read from NATS at {config.nats.url}: {exc or type(exc).__name__}",
            file=sys.stderr,
        )
        return 1
    with_pins = bool(getattr(args, "pins", False))
    if getattr(args, "json", False):
        print(json.dumps(report_json(report, with_pins=with_pins), indent=2))
    else:
        print(format_report(report, with_pins=with_pins))
    return 0


async def _quiet(_: Exception) -> None:
    return None  # a CLI reports one clear error, not nats-py's retry tracebacks


async def _read(config: Config) -> StateReport:
    options: dict[str, Any] = natsconn.connect_options(config.nats, "llmgw-state")
    # One attempt per server: a tool must fail fast rather than wait for a server forever.
    options.update(max_reconnect_attempts=1, reconnect_time_wait=0.1, error_cb=_quiet)
    async with asyncio.timeout(config.nats.connect_timeout * 2 + 5):
        nc = await nats.connect(**options)
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
    kv = NatsKV(js, pinning.bucket, direct=bool(info.config.allow_direct))
    # Pins first: operations take a slot before writing the pin that names it, so every pin
    # read here has its slot taken when the slots are read next (unless it expired meanwhile);
    # an admission in flight shows as an extra taken slot, never as a pin beyond the limit.
    pins = await kv.list(PIN_PREFIX)
    pin_slots = await kv.list(PIN_SLOT_PREFIX)
    leases = await kv.list(LEASE_PREFIX)
    return build_report(
        bucket=pinning.bucket,
        pin_slots=pin_slots,
        leases=leases,
        pins=pins,
        limits=limits_from_config(config),
        now=time.time() if now is None else now,
        lease_timeout=pinning.lease_timeout,
        pin_inactivity_timeout=pinning.pin_inactivity_timeout,
    )
