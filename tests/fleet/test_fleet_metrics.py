"""An admission instance's metrics follow the live fleet: composed as `llmgw admission
--admin-listen` composes it (its admin port serves /metrics and the fleet API), an endpoint
added through the admin API gets its breaker gauge, and one drained and removed loses it."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from inproc import before_any_lease, stop_servers
from prometheus_client.parser import text_string_to_metric_families
from timing import eventually

from llmgw.config import Config
from llmgw.services.admission.admin import create_admin_app
from llmgw.services.admission.compose import open_admission
from llmgw.services.fleet.http import AdminGuard, add_fleet_routes
from llmgw.services.fleet.ops import FleetOps
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import start_server
from llmgw.state.fleet import FleetBucket

BREAKER = "llmgw_admission_endpoint_breaker"


async def breaker_endpoints(http: httpx.AsyncClient) -> dict[str, str]:
    """Each endpoint the breaker gauge names, with its current state (the one at 1)."""
    text = (await http.get("/metrics")).text
    found: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        if family.name == BREAKER:
            for sample in family.samples:
                found.setdefault(sample.labels["endpoint"], "?")
                if sample.value == 1.0:
                    found[sample.labels["endpoint"]] = sample.labels["state"]
    return found


async def until_metrics(
    http: httpx.AsyncClient, check: Callable[[dict[str, str]], bool], what: str
) -> dict[str, str]:
    seen: dict[str, str] = {}

    async def shown() -> dict[str, str] | None:
        nonlocal seen
        seen = await breaker_endpoints(http)
        return seen if check(seen) else None

    try:
        return await eventually(shown, 10.0, what, interval=0.02)
    except AssertionError as failure:
        raise AssertionError(f"{failure} ({seen})") from None


async def test_the_breaker_gauge_names_the_endpoints_an_instance_runs_on_after_a_fleet_change(
    config: Config, fleet: FleetBucket
) -> None:
    engine = await start_server(create_engine_app(EngineParams.zero_delay(max_num_seqs=4)))
    with before_any_lease(config):
        running = await open_admission(config, "adm-metrics", "adm-metrics")
    admin_app = create_admin_app(running.service, running.nc)
    token = "admin-token-of-the-metrics-test"
    ops = FleetOps.on(running.nc, running.fleet.bucket, lambda: running.service.config)
    add_fleet_routes(admin_app, ops, AdminGuard(token))
    admin = await start_server(admin_app)
    try:
        headers = {"authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=admin.url, timeout=10, headers=headers) as http:
            seeded = {e.id for e in config.endpoints}
            assert set(await breaker_endpoints(http)) == seeded
            body = {"id": "engine-9", "url": engine.url, "provider": "iris"}
            added = await http.post("/admin/endpoints", json={**body, "models": ["qwen2.5-32b"]})
            assert added.status_code == 201, added.text
            shown = await until_metrics(http, lambda m: "engine-9" in m, "engine-9 shown")
            assert shown["engine-9"] == "closed" and set(shown) == seeded | {"engine-9"}
            for endpoint in ("engine-9", "engine-2"):  # one added live, one the file seeded
                drained = await http.post(f"/admin/endpoints/{endpoint}/drain")
                assert drained.status_code == 200, drained.text
                removed = await http.delete(f"/admin/endpoints/{endpoint}", params={"wait": 5})
                assert removed.status_code == 200, removed.text
            left = await until_metrics(
                http, lambda m: not {"engine-9", "engine-2"} & set(m), "both gone"
            )
            assert set(left) == seeded - {"engine-2"}
    finally:
        await admin.stop()
        await running.close()
        await stop_servers([engine])
