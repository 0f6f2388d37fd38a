"""`llmgw register`: an engine announces itself to the live fleet and heartbeats (a sidecar).

    llmgw register ID --url URL --provider P --models m1,m2 --ttl 10 [--capacity N] [--once]

It registers the endpoint with a heartbeat TTL (checked like `llmgw endpoints add`; registering
again brings the record up to date and active), then heartbeats every TTL/3 until SIGTERM or
SIGINT, when it drains the endpoint and exits 0: no new work goes there, what runs finishes,
and the reaper removes it once silent for twice the TTL. An engine that dies stops
heartbeating: the reaper drains it after the TTL and removes it after twice the TTL.
`--once` registers and exits (heartbeat by HTTP: `POST /admin/endpoints/ID/heartbeat`, with
the admin token). `--admin-url URL` registers and heartbeats through that admin port's API
instead of NATS, with the admin token (`auth.admin_token_file`, LLMGW_AUTH__ADMIN_TOKEN_FILE
or LLMGW_AUTH__ADMIN_TOKEN): a sidecar needs no NATS credentials.

Exit codes: 0 done; 1 NATS (or the admin port) unreachable; 2 a refused registration (nothing
written; a missing or wrong admin token too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

import httpx

from llmgw import natsconn
from llmgw.core.fleet import EndpointState
from llmgw.runtime import load_tool_config
from llmgw.services.fleet.main import fleet_calls, spec_from_args
from llmgw.services.fleet.ops import FleetError

__all__ = ["run"]

# A heartbeat that did not arrive: the next one may (the TTL allows two more).
_UNREACHABLE: tuple[type[Exception], ...] = (*natsconn.UNREACHABLE, httpx.TransportError)


def run(args: argparse.Namespace) -> int:
    config = load_tool_config(args)
    refusals = natsconn.Refusals()

    async def main() -> int:
        async with fleet_calls(config, args, "llmgw-register", refusals) as ops:
            spec = {"id": args.id, **spec_from_args(args)}
            await ops.register(spec, args.ttl, probe=not args.no_probe)
            print(f"llmgw register: {args.id} registered (heartbeat every {args.ttl / 3:g}s)")
            sys.stdout.flush()
            if args.once:
                return 0
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(args.ttl / 3):
                        await stop.wait()
                if not stop.is_set():
                    try:
                        await ops.heartbeat(args.id)
                    except FleetError as exc:  # removed meanwhile: register again
                        print(f"llmgw register: {exc.message}; registering again", flush=True)
                        await ops.register(spec, args.ttl, probe=False)
                    except _UNREACHABLE as exc:
                        print(f"llmgw register: heartbeat failed: {exc!r}", flush=True)
            await ops.set_state(args.id, EndpointState.DRAINING)
            print(f"llmgw register: {args.id} draining", flush=True)
            return 0

    try:
        return asyncio.run(main())
    except FleetError as exc:
        print(f"llmgw register: {exc.message}", file=sys.stderr)
        return 2
    except httpx.TransportError as exc:
        print(f"llmgw register: cannot reach the admin API: {exc!r}", file=sys.stderr)
        return 1
    except natsconn.UNREACHABLE as exc:
        return refusals.report("register", exc)
