"""`llmgw config apply` under load giving limits to a pair that had none and adding a managed
provider with limits, then taking both back, with two admission instances following the fleet
bucket as `llmgw admission` composes them: from the acknowledgement on, no request starts at
the pair's engines while its new limit's worth run there (the requests granted before, without
limits, count); the new provider never runs more than its limit, from its first request; once
removed it takes no new work and what ran there finishes, and the pair runs without limits
again; no client sees an error, and the audit checker finds no grant above the limits in
force when it was made."""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from fleet_helpers import LoadRun, engines_values
from inproc import InFlight
from timing import eventually

from llmgw.config import config_from_dict, limits_from_config
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import start_server
from llmgw.state.checker import check_audit

G_IRIS, G_VEGA = 4, 2  # the limits iris/m1 gains and the new vega/m1 starts with


def _limits(g: int) -> dict[str, int]:
    return {
        "max_pinned_sessions": 8,
        "max_global_in_flight_request_slots": g,
        "global_in_flight_request_slots_reserved_for_pinned_sessions": 1,
        "max_per_session_in_flight_request_slots": 2,
    }


async def test_a_pair_given_limits_and_a_provider_added_under_load_never_run_above_them(
    nats_url: str,
) -> None:
    unique = uuid.uuid4().hex[:12]
    iris: dict[str, Any] = {"now": 0, "max": 0, "starts": []}
    vega: dict[str, Any] = {"now": 0, "max": 0, "starts": []}
    params = EngineParams.zero_delay(itl_base=0.01, max_num_seqs=64)
    engines = {}
    for seed, name in enumerate(("engine-1", "engine-2", "tensorx-1", "vega-1")):
        app = create_engine_app(params.model_copy(update={"seed": seed}), ["m1"])
        counted = {"engine-1": iris, "engine-2": iris, "vega-1": vega}.get(name)
        engines[name] = await start_server(InFlight(app, counted) if counted else app)
    urls = {k: v.url for k, v in engines.items() if k != "vega-1"}
    values = engines_values(nats_url, urls, f"r_{unique}")
    del values["providers"][0]["models"][0]["limits"]  # iris/m1 starts without limits
    run = LoadRun(values, nats_url)
    try:
        await run.start()
        # more than the new limit runs while the pair has none
        await eventually(lambda: iris["max"] > G_IRIS, 10, f"{G_IRIS}+ requests on iris")
        before = iris["max"]
        changed = copy.deepcopy(values)
        changed["providers"][0]["models"][0]["limits"] = _limits(G_IRIS)
        changed["providers"].append(
            {
                "id": "vega",
                "kind": "managed",
                "priority": 200,  # ahead of iris: takes what its limits allow
                "models": [{"name": "m1", "limits": _limits(G_VEGA)}],
            }
        )
        changed["endpoints"].append(
            {"id": "vega-1", "url": engines["vega-1"].url, "provider": "vega", "models": ["m1"]}
        )
        _, acknowledged = await run.apply(changed, 2.5, then_stop=False)
        # vega removed, iris/m1's limits too: vega takes no new work, iris more than 4 again
        final = copy.deepcopy(values)
        removing = time.time()
        _, removed = await run.apply(final, 1.5)
    finally:
        await run.close(engines.values())
    assert not run.errors, run.errors[:3]
    after = [count for at, count in iris["starts"] if acknowledged < at < removing]
    assert after, "no request reached iris's engines after the change"
    assert max(after) <= G_IRIS, f"a request started with {max(after)} at iris's engines"
    assert vega["starts"], "the new provider took no request"
    assert vega["max"] <= G_VEGA, f"{vega['max']} requests ran at once on the new provider"
    assert not [at for at, _ in vega["starts"] if at > removed], "vega took work once removed"
    assert vega["now"] == 0  # what ran there finished
    again = max(count for at, count in iris["starts"] if at > removed)
    assert again > G_IRIS  # no limits any more
    # limits given hold from the acknowledgement on; taken away, from the apply on
    steps = [(acknowledged, config_from_dict(changed, env={})), (removing, run.config)]
    violations = check_audit(
        run.audit.events,
        limits_from_config(run.config),
        lease_timeout=run.config.pinning.lease_timeout,
        changed=[(at, limits_from_config(config)) for at, config in steps],
    )
    assert not violations, [str(v) for v in violations[:5]]
    print(
        f"\nlimits given under load: iris/m1 ran {before} at once without limits; after the "
        f"acknowledgement at most {max(after)} (G={G_IRIS}) in {len(after)} starts; the new "
        f"vega/m1 served {len(vega['starts'])} requests, at most {vega['max']} at once "
        f"(G={G_VEGA}); both taken back: vega took no new work, iris ran {again} at once; "
        f"audit: {len(run.audit.events)} events, 0 violations"
    )
