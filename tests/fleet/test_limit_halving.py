"""`llmgw config apply` halving a pair's `max_global_in_flight_request_slots` under load, with
two admission instances following the fleet bucket as `llmgw admission` composes them: once
every instance runs on the new config (the command's acknowledgement), no request starts at
the engines while the new limit's worth run there, no client sees an error, and the audit
checker finds no grant above the limit in force when it was made."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
import nats
from fleet_helpers import add_following_admission, engines_values, stop_fleet_cluster
from inproc import Cluster, InFlight

from llmgw.config import config_from_dict
from llmgw.services.admission.service import limits_from_config
from llmgw.services.fleet.apply import apply_file
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import start_server
from llmgw.state.checker import AuditLog, check_audit

PAIR = ("iris", "m1")
OLD, NEW = 8, 4  # iris/m1's G (fleet_helpers.engines_values), halved


async def test_halving_a_limit_under_load_never_starts_a_request_above_the_new_limit(
    nats_url: str,
) -> None:
    unique = uuid.uuid4().hex[:12]
    ours: dict[str, Any] = {"now": 0, "max": 0, "starts": []}
    params = EngineParams.zero_delay(itl_base=0.01, max_num_seqs=64)
    engines = {}
    for seed, name in enumerate(("engine-1", "engine-2", "tensorx-1")):
        app = create_engine_app(params.model_copy(update={"seed": seed}), ["m1", "m2"])
        engines[name] = await start_server(
            InFlight(app, ours) if name.startswith("engine") else app
        )
    values = engines_values(nats_url, {k: v.url for k, v in engines.items()}, f"r_{unique}")
    config = config_from_dict(values, env={})
    audit = AuditLog()
    cluster = Cluster(config, nats_url, observer_for=audit.observer)
    mirrors = []
    errors: list[str] = []
    stop = asyncio.Event()
    try:
        for _ in range(2):
            mirrors.append(await add_following_admission(cluster, config))
        await cluster.balanced()
        edge = await cluster.add_edge()

        async def client(worker: int) -> None:
            async with httpx.AsyncClient(base_url=edge.url, timeout=20) as http:
                n = 0
                while not stop.is_set():
                    n += 1
                    response = await http.post(
                        "/v1/chat/completions",
                        json={
                            "model": "m1",
                            "messages": [{"role": "user", "content": f"w{worker} r{n}"}],
                            "max_tokens": 24,
                        },
                    )
                    if response.status_code != 200:
                        errors.append(response.text[:200])

        workers = [asyncio.create_task(client(w)) for w in range(24)]
        await asyncio.sleep(2.0)
        before = max(count for _, count in ours["starts"])
        assert NEW < before <= OLD  # more than the new limit ran under the old one
        values["providers"][0]["models"][0]["limits"]["max_global_in_flight_request_slots"] = NEW
        nc = await nats.connect(nats_url)
        try:
            revision, on_it, answering = await apply_file(nc, config, values, "<test>", wait=10)
        finally:
            await nc.close()
        acknowledged = time.time()
        assert on_it == answering >= 2, (on_it, answering)
        await asyncio.sleep(3.0)
        stop.set()
        await asyncio.gather(*workers)
    finally:
        stop.set()
        await stop_fleet_cluster(mirrors, cluster, engines.values(), nats_url, config)
    assert not errors, errors[:3]
    after = [count for at, count in ours["starts"] if at > acknowledged]
    assert after, "no request reached our engines after the change"
    assert max(after) <= NEW, f"a request started with {max(after)} at our engines > {NEW}"
    new_limits = dict(limits_from_config(config))
    new_limits[PAIR] = new_limits[PAIR].model_copy(  # type: ignore[union-attr]
        update={"max_global_in_flight_request_slots": NEW}
    )
    violations = check_audit(
        audit.events,
        limits_from_config(config),
        lease_timeout=config.pinning.lease_timeout,
        changed=[(acknowledged, new_limits)],
    )
    assert not violations, [str(v) for v in violations[:5]]
    print(
        f"\nhalving G {OLD} -> {NEW} under load: revision {revision} acknowledged by {on_it} "
        f"instances; {len(after)} requests started at the engines after it, at most "
        f"{max(after)} running then; audit: {len(audit.events)} events, 0 violations"
    )
