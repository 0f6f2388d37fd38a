"""`llmgw admission`: the composition root of the admission service.

Endpoint health and load come from the scraper through the load bucket (`LoadFollower`); with
no scraper running, every managed endpoint counts as healthy but stale, i.e. saturated: only
bands whose ceiling is at least 1 reach our engines, the others overflow or wait. The instance
prints its ready line once it serves: it has joined, holds its quotas and serves its shards.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys

from llmgw.config import parse_hostport
from llmgw.core.keys import is_safe_token, safe_token
from llmgw.runtime import (
    load_or_exit,
    require_nats_server,
    run_service,
    service_instance,
    setup_logging,
    tune_gc,
    wait_for_stop_signal,
)
from llmgw.services.admission.admin import create_admin_app
from llmgw.services.admission.compose import open_admission
from llmgw.services.admission.successor import NameInUse
from llmgw.services.fleet.http import add_fleet_routes, admin_guard
from llmgw.services.fleet.ops import FleetOps
from llmgw.serving import start_server

log = logging.getLogger("llmgw.admission")


def run(args: argparse.Namespace) -> int:
    config = load_or_exit(args.config)
    setup_logging("admission", config)
    require_nats_server(config, "admission")
    admin_listen = getattr(args, "admin_listen", None)
    admin = parse_hostport(admin_listen) if admin_listen else None
    guard = admin_guard(config, "admission") if admin is not None else None

    name = getattr(args, "instance_name", None) or config.admission.instance_name
    if name is not None and not is_safe_token(name):
        print(f"--instance-name {name!r}: only letters, digits, - and _", file=sys.stderr)
        return 2
    given = getattr(args, "instance", None)
    supersedes = getattr(args, "supersedes", None)

    async def main() -> None:
        if given is not None:
            instance = safe_token(given)
        elif name is not None:  # unique per start, the name first (logs, shard keys)
            instance = f"{name}-{secrets.token_hex(3)}"
        else:
            instance = safe_token(service_instance("admission"))
        try:
            running = await open_admission(
                config, instance, "llmgw-admission", supersedes=supersedes, name=name
            )
        except NameInUse as exc:
            print(f"llmgw admission: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        service = running.service
        admin_server = None
        if admin is not None:
            admin_app = create_admin_app(service, running.nc)
            assert guard is not None
            # its config follows every applied config: changes are checked against it
            ops = FleetOps.on(running.nc, running.fleet.bucket, lambda: service.config)
            add_fleet_routes(admin_app, ops, guard)
            admin_server = await start_server(admin_app, *admin)
        suffix = f", admin {admin_server.url}" if admin_server is not None else ""
        print(
            f"llmgw admission ready ({service.instance}, {len(service.shards.serving)} shards"
            f"{suffix})",
            flush=True,
        )
        tune_gc()
        try:
            await wait_for_stop_signal()
        finally:
            await running.close()
            if admin_server is not None:
                await admin_server.stop()

    return run_service(main)
