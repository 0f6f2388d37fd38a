"""`llmgw config apply` halving a pair's `max_global_in_flight_request_slots` under load, with
two admission instances following the fleet bucket as `llmgw admission` composes them: once
every instance runs on the new config (the command's acknowledgement), no request starts at
the engines while the new limit's worth run there, no client sees an error, and the audit
checker finds no grant above the limit in force when it was made."""

from __future__ import annotations

import uuid
from typing import Any

from fleet_helpers import LoadRun, engines_values
from inproc import InFlight
from timing import eventually

from llmgw.config import limits_from_config
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import start_server
from llmgw.state.checker import check_audit

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
    run = LoadRun(values, nats_url)
    config, audit = run.config, run.audit
    try:
        await run.start()
        await eventually(  # the load runs past the new limit under the old one
            lambda: max((count for _, count in ours["starts"]), default=0) > NEW,
            10,
            f"more than {NEW} requests running at our engines",
        )
        before = max(count for _, count in ours["starts"])
        assert NEW < before <= OLD  # more than the new limit ran under the old one
        values["providers"][0]["models"][0]["limits"]["max_global_in_flight_request_slots"] = NEW
        revision, acknowledged = await run.apply(values, 3.0)
    finally:
        await run.close(engines.values())
    assert not run.errors, run.errors[:3]
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
        f"\nhalving G {OLD} -> {NEW} under load: revision {revision} acknowledged by both "
        f"instances; {len(after)} requests started at the engines after it, at most "
        f"{max(after)} running then; audit: {len(audit.events)} events, 0 violations"
    )
