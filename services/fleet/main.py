"""`llmgw endpoints`: the live fleet's endpoints (docs/architecture.md, "Live fleet").

    llmgw endpoints list | show ID
    llmgw endpoints add ID --url URL --provider P --models m1,m2 [--weight N] [--capacity N]
                        [--priority N] [--pool P] [--upstream-model M=NAME] [--no-probe]
    llmgw endpoints update ID [the same options]
    llmgw endpoints drain ID | undrain ID
    llmgw endpoints remove ID [--wait SECONDS] [--force]

Every admission instance, scraper and edge follows the change within a second, no restart.
With `nats.url: embedded` (the local config) the CLI talks to `llmgw up`'s server. With
`--admin-url URL` it calls that admin port's API instead (no NATS needed), with the admin
token (`auth.admin_token`, `auth.admin_token_file` or their LLMGW_AUTH__ variables).

Exit codes: 0 done; 1 NATS (or the admin port) unreachable, or no such endpoint; 2 a refused
change (bad input, a duplicate id, an unreachable URL, an endpoint still running requests, a
missing or wrong admin token): nothing was written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx

from llmgw import natsconn
from llmgw.config import Config
from llmgw.config.credentials import CredentialsError, admin_token
from llmgw.core.fleet import EndpointState
from llmgw.runtime import load_tool_config
from llmgw.services.fleet.adminclient import AdminApi
from llmgw.services.fleet.ops import (
    FleetCalls,
    FleetError,
    FleetOps,
    running_config,
)
from llmgw.state.fleet import open_fleet

__all__ = ["fleet_calls", "run", "spec_from_args"]


def run(args: argparse.Namespace) -> int:
    config = load_tool_config(args)
    refusals = natsconn.Refusals()
    try:
        return asyncio.run(_run(config, args, refusals))
    except FleetError as exc:
        print(f"llmgw endpoints: {exc.message}", file=sys.stderr)
        return 1 if exc.status == 404 else 2
    except httpx.TransportError as exc:
        print(f"llmgw endpoints: cannot reach the admin API: {exc!r}", file=sys.stderr)
        return 1
    except natsconn.UNREACHABLE as exc:
        return refusals.report("endpoints", exc)


async def _run(config: Config, args: argparse.Namespace, refusals: natsconn.Refusals) -> int:
    async with fleet_calls(config, args, "llmgw-endpoints", refusals) as ops:
        result = await _act(ops, config, args)
    _print(result, as_json=bool(args.json), action=args.endpoints_command)
    return 0


@contextlib.asynccontextmanager
async def fleet_calls(
    config: Config, args: argparse.Namespace, name: str, refusals: natsconn.Refusals
) -> AsyncIterator[FleetCalls]:
    """The fleet's calls: the admin API at ``--admin-url`` (with the config's admin token),
    else `FleetOps` on a NATS connection of its own; closed at the end."""
    url = getattr(args, "admin_url", None)
    if url:
        try:
            token = admin_token(config)
        except CredentialsError as exc:
            raise FleetError(str(exc), code="admin_token_unreadable") from None
        if token is None:
            raise FleetError(
                "--admin-url needs the admin token: set LLMGW_AUTH__ADMIN_TOKEN_FILE (llmgw up "
                "prints where its token is), auth.admin_token_file or LLMGW_AUTH__ADMIN_TOKEN",
                code="missing_admin_token",
            )
        api = AdminApi(url, token)
        try:
            yield api
        finally:
            await api.close()
        return
    nc = await natsconn.connect_tool(config.nats, name, refusals)
    try:
        bucket = await open_fleet(nc, config)
        running = await running_config(bucket, config)
        yield FleetOps.on(nc, bucket, running)
    finally:
        await nc.close()


async def _act(ops: FleetCalls, config: Config, args: argparse.Namespace) -> Any:
    command = args.endpoints_command
    probe = not getattr(args, "no_probe", False)
    if command == "list":
        return await ops.list()
    if command == "show":
        return await ops.show(args.id)
    if command == "add":
        return await ops.add({"id": args.id, **spec_from_args(args)}, probe=probe)
    if command == "update":
        return await ops.update(args.id, spec_from_args(args), probe=probe)
    if command == "drain":
        return await ops.set_state(args.id, EndpointState.DRAINING)
    if command == "undrain":
        return await ops.set_state(args.id, EndpointState.ACTIVE)
    if command == "remove":
        wait = config.fleet.drain_timeout if args.wait is None else args.wait
        return await ops.remove(args.id, force=args.force, wait=wait)
    raise FleetError(f"unknown action {command!r}", code="invalid_value")


def spec_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The endpoint fields the options give (only those given)."""
    spec: dict[str, Any] = {}
    for field in ("url", "provider", "pool", "weight", "priority", "capacity", "context_window"):
        value = getattr(args, field, None)
        if value is not None:
            spec[field] = value
    if getattr(args, "models", None):
        spec["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    renames = {}
    for item in getattr(args, "upstream_model", None) or []:
        model, sep, name = item.partition("=")
        if not sep or not model or not name:
            raise FleetError(
                f"--upstream-model {item!r}: expected MODEL=NAME",
                code="invalid_value",
                param="upstream_model",
            )
        renames[model] = name
    if renames:
        spec["upstream_model"] = renames
    return spec


def _print(result: Any, *, as_json: bool, action: str) -> None:
    if as_json:
        print(json.dumps(result))
        return
    if action == "list":
        print(f"{'ID':20}  {'STATE':8}  {'PROVIDER':12}  {'LEASES':6}  {'URL':28}  MODELS")
        for e in result:
            leases = "?" if e["leases"] is None else str(e["leases"])
            print(
                f"{e['id']:20}  {e['state']:8}  {e['provider']:12}  {leases:6}  "
                f"{e['url']:28}  {','.join(e['models'])}"
            )
        return
    if action == "show":
        print(json.dumps(result, indent=2))
        return
    past = {"add": "added", "update": "updated", "drain": "draining", "undrain": "active"}
    print(f"endpoint {result['id']}: {past.get(action, 'removed')}")
