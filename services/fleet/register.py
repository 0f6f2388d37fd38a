"""`llmgw register`: an engine announces itself to the live fleet and heartbeats (a sidecar).

    llmgw register ID --url URL --provider P --models m1,m2 --ttl 10 [--capacity N] [--once]

It registers the endpoint with a heartbeat TTL (checked like `llmgw endpoints add`; registering
again brings the record up to date and active), then heartbeats every TTL/3 until SIGTERM or
SIGINT, when it drains the endpoint and exits 0: no new work goes there, what runs finishes,
and the reaper removes it once silent for twice the TTL. An engine that dies stops
heartbeating: the reaper drains it after the TTL and removes it after twice the TTL.
`--once` registers and exits (heartbeat by HTTP: `POST /admin/endpoints/ID/heartbeat`).

Exit codes: 0 done; 1 NATS unreachable; 2 a refused registration (nothing written).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

import nats

from llmgw import natsconn
from llmgw.core.fleet import EndpointState
from llmgw.runtime import load_tool_config
from llmgw.services.fleet.main import spec_from_args
from llmgw.services.fleet.ops import FleetError, FleetOps, admission_leases, running_config
from llmgw.state.fleet import open_fleet

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    config = load_tool_config(args)
    refusals = natsconn.Refusals()

    async def main() -> int:
        nc = await natsconn.connect_tool(config.nats, "llmgw-register", refusals)
        try:
            bucket = await open_fleet(nc, config)
            running = await running_config(bucket, config)
            ops = FleetOps(bucket, running, lambda: admission_leases(nc))
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
                    except (OSError, TimeoutError, nats.errors.Error) as exc:
                        print(f"llmgw register: heartbeat failed: {exc!r}", flush=True)
            await ops.set_state(args.id, EndpointState.DRAINING)
            print(f"llmgw register: {args.id} draining", flush=True)
            return 0
        finally:
            await nc.close()

    try:
        return asyncio.run(main())
    except FleetError as exc:
        print(f"llmgw register: {exc.message}", file=sys.stderr)
        return 2
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        refused = refusals.explain("register")
        print(refused or f"llmgw register: cannot reach NATS: {exc}", file=sys.stderr)
        return 1
