"""`llmgw edge`: the composition root of the HTTP edge.

It prints its ready line once it serves: NATS connected, its inbox and roll-call subscriptions
up, the HTTP listeners bound, and an admission instance answered (or, with none running yet,
after a bounded wait: the edge then answers 503 until one does, and /ready says so).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import uuid
from typing import TYPE_CHECKING

from llmgw import natsconn
from llmgw.clock import SYSTEM, Clock
from llmgw.config import parse_hostport
from llmgw.config.credentials import CredentialsError, provider_keys
from llmgw.config.fleet import fleet_bucket
from llmgw.core.keys import safe_token
from llmgw.core.outage import LocalBudget
from llmgw.runtime import (
    load_or_exit,
    require_nats_server,
    run_service,
    service_instance,
    setup_logging,
    tune_gc,
    wait_for_stop_signal,
)
from llmgw.services.admission.compose import open_admission
from llmgw.services.edge.admin import create_admin_app
from llmgw.services.edge.admission_client import NatsAdmission
from llmgw.services.edge.app import ConfigFollower, EdgeDeps, create_app
from llmgw.services.edge.auth import (
    TokenCountingReporter,
    close_key_auth,
    open_key_auth,
)
from llmgw.services.edge.budgets import BudgetGuard
from llmgw.services.edge.colocated import ColocatedAdmission, instance_grants_problem
from llmgw.services.edge.leases import EdgeLeases
from llmgw.services.edge.live import follow_applied_config
from llmgw.services.edge.metrics import EdgeMetrics
from llmgw.services.edge.outage import OutageAdmission
from llmgw.services.edge.prompts import TokenizerUnavailable
from llmgw.services.edge.reporting import NatsReporter
from llmgw.services.edge.spend import SpendBook
from llmgw.services.edge.upstream import new_pool
from llmgw.services.fleet.http import add_fleet_routes, admin_guard
from llmgw.services.fleet.ops import FleetOps
from llmgw.serving import RunningServer, start_server
from llmgw.state.responses import open_response_store
from llmgw.tracing import open_tracing

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from llmgw.config.schema import Config
    from llmgw.contracts import AdmissionClient, RequestReporter
    from llmgw.services.admission.service import AdmissionService

log = logging.getLogger("llmgw.edge")

_FIRST_ANSWER_WAIT = 10.0  # seconds the edge waits for an admission instance before it is ready
_CUT_GRACE = 2.0  # seconds requests cut at the drain deadline get to end and report


def run(args: argparse.Namespace) -> int:
    config = load_or_exit(args.config)
    setup_logging("edge", config)
    require_nats_server(config, "edge")
    try:
        provider_keys(config)
    except CredentialsError as exc:
        print(f"llmgw edge: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    guard = admin_guard(config, "edge") if config.admission.colocated else None
    if config.auth.mode == "none":
        log.warning(
            "auth.mode is none: every caller is accepted and may choose its band "
            "(set auth.mode: keys before exposing this edge; docs/keys.md)"
        )
    if not config.admission.colocated and (
        getattr(args, "admission_instance", None) or getattr(args, "supersedes", None)
    ):
        print(
            "llmgw edge: --admission-instance and --supersedes name this edge's own admission "
            "instance, and admission.colocated is false: it runs none",
            file=sys.stderr,
        )
        raise SystemExit(2)
    host, port = parse_hostport(args.listen or config.listen)
    admin_host, admin_port = parse_hostport(args.admin_listen or config.admin_listen)

    refused: list[str] = []

    async def main() -> None:
        nc = await natsconn.connect(config.nats, name="llmgw-edge")
        edge_id = safe_token(f"{service_instance('edge')}-{uuid.uuid4().hex[:6]}")
        colocated = None
        if config.admission.colocated:  # decides its shards' requests in this process
            problem = await instance_grants_problem(config)
            if problem is not None:  # a per-role NATS user: refuse to start, naming the field
                refused.append(problem)
                await natsconn.drain_or_close(nc)
                return
            instance = getattr(args, "admission_instance", None) or f"{edge_id}-admission"
            colocated = await open_admission(
                config,
                safe_token(instance),
                "llmgw-edge-admission",
                supersedes=getattr(args, "supersedes", None),
            )
        deps = await open_edge_deps(
            nc, config, edge_id, colocated=colocated.service if colocated else None
        )
        try:
            app = create_app(config, deps)
        except TokenizerUnavailable as exc:  # refuse to start, naming the field
            refused.append(str(exc))
            await close_edge_deps(deps)
            if colocated is not None:
                await colocated.close()
            await natsconn.drain_or_close(nc)
            return
        applied = await follow_applied_config(
            nc, config, app.edge, colocated.fleet if colocated is not None else None
        )
        router = config.router
        # uvicorn's own graceful window outlasts the drain: the edge ends what is left itself.
        api = await start_server(
            app, host, port, timeout_graceful_shutdown=router.drain_timeout + _CUT_GRACE
        )
        registries = [colocated.metrics.registry] if colocated is not None else []
        admin_app = create_admin_app(deps, nc, registries)
        if colocated is not None:  # the fleet's admin API, where an admission instance runs
            assert guard is not None
            service = colocated.service  # its config follows every applied config
            ops = FleetOps.on(colocated.nc, colocated.fleet.bucket, lambda: service.config)
            add_fleet_routes(admin_app, ops, guard)
        admin = await start_server(admin_app, admin_host, admin_port)
        await wait_for_admission(deps.admission)
        print(f"llmgw edge ready on {api.url} (admin {admin.url})", flush=True)
        tune_gc()
        try:
            await wait_for_stop_signal()
            await drain(deps, api, router.drain_delay, router.drain_timeout)
        finally:
            await asyncio.gather(api.stop(timeout=_CUT_GRACE), admin.stop())
            app.edge.telemetry.flush()  # the last ends' metrics and access lines
            await applied.stop()
            await close_edge_deps(deps)  # the cut requests' releases are sent before this ends
            await app.edge.prompts.aclose()
            if colocated is not None:  # after the edge's releases: then its shards move
                await colocated.close()
            await natsconn.drain_or_close(nc)

    code = run_service(main)
    if refused:
        print(f"llmgw edge: {refused[0]}", file=sys.stderr)
        return 2
    return code


async def drain(deps: EdgeDeps, api: RunningServer, delay: float, timeout: float) -> None:
    """The graceful stop (services/edge/drain.py): unready for `delay` while still serving,
    then no new connections and running requests until `timeout`, then cut what is left."""
    deps.drain.begin()
    log.info("stopping: /ready is false; serving %.1fs more before draining", delay)
    await asyncio.sleep(delay)
    stopping = asyncio.ensure_future(api.stop(timeout=timeout + _CUT_GRACE))
    done, _ = await asyncio.wait({stopping}, timeout=timeout)
    if not done:
        cut = await deps.drain.cut(deps.leases, within=_CUT_GRACE)
        log.warning("drain deadline (%.1fs) passed: ended %d running requests", timeout, cut)
    await stopping


async def open_edge_deps(
    nc: NATS,
    config: Config,
    edge_id: str,
    *,
    colocated: AdmissionService | None = None,
    clock: Clock = SYSTEM,
) -> EdgeDeps:
    """The edge's ports over one NATS connection, started. With `admission.on_nats_outage:
    local` the admission client decides alone while NATS is unreachable (`OutageAdmission`);
    with a `colocated` admission instance it decides its shards' requests in this process
    (`ColocatedAdmission`). The parts built here read time from `clock`."""
    over_nats = NatsAdmission(
        nc,
        request_timeout=config.nats.request_timeout,
        queue_ttl=config.admission.queue_ttl,
        clock=clock,
    )
    budget = LocalBudget() if config.admission.on_nats_outage == "local" else None
    admission: AdmissionClient = over_nats
    followers: list[ConfigFollower] = [over_nats.follow]
    if budget is not None:
        outage = OutageAdmission(
            over_nats, config, edge_id, budget, is_connected=lambda: nc.is_connected, clock=clock
        )
        admission = outage
        followers.append(outage.follow)
    if colocated is not None:
        colocated.serve_edge(edge_id)  # its ends are handed over in process (NatsReporter)
        admission = ColocatedAdmission(colocated, admission)
    await admission.start()
    leases = EdgeLeases(
        nc,
        edge_id,
        lease_timeout=config.pinning.lease_timeout,
        request_timeout=config.nats.request_timeout,
        local_budget=budget,
        monotonic=clock,
    )
    await leases.start()
    auth = await open_key_auth(nc, config, edge_id, clock=clock)
    reporter: RequestReporter = NatsReporter(
        nc,
        local=colocated.ended_here if colocated is not None else None,
        scope=fleet_bucket(config),
        clock=clock,
    )
    metrics = EdgeMetrics(
        tenant_label=config.metrics.tenant_label, max_tenants=config.metrics.max_tenants
    )
    if auth is not None:
        reporter = TokenCountingReporter(reporter, auth)
    spend = SpendBook(nc, edge_id, config, metrics.spend, clock=clock)
    await spend.start()
    budgets = BudgetGuard(
        nc, edge_id, config, metrics=metrics.spend, scale=spend.scaled_input, clock=clock
    )
    await budgets.start()
    followers += [spend.follow, budgets.follow]
    return EdgeDeps(
        clock=clock,
        followers=followers,
        spend=spend,
        budgets=budgets,
        admission=admission,
        leases=leases,
        reporter=reporter,
        upstream=new_pool(config.timeouts, clock),
        metrics=metrics,
        edge_id=edge_id,
        tracing=open_tracing("edge", config.tracing),
        auth=auth,
        responses=await open_response_store(nc, config, clock),
    )


async def close_edge_deps(deps: EdgeDeps) -> None:
    if deps.budgets is not None:
        await deps.budgets.stop()
    if deps.spend is not None:
        await deps.spend.stop()
    if deps.auth is not None:
        await close_key_auth(deps.auth)
    await deps.responses.close()  # the stored responses' writes in flight
    await deps.reporter.drain()
    await deps.leases.stop()
    await deps.admission.stop()
    await deps.upstream.close()
    if deps.tracing is not None:
        deps.tracing.shutdown()  # flushes the exporter


async def wait_for_admission(
    admission: AdmissionClient, timeout: float = _FIRST_ANSWER_WAIT
) -> bool:
    """Until an admission instance answers (True), or `timeout` (False: ready line anyway,
    /ready stays false until one answers)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await admission.probe():
            return True
        await asyncio.sleep(0.1)
    log.warning(
        "no admission instance answered within %.0fs; answering 503 until one does", timeout
    )
    return False
