"""Several admission instances are as generous as one, end to end.

The same scenario as test_placement_e2e.py (benchmarks/placement.py), with the shipped
defaults on, but with limits as a platform team sets them (the managed pair's G = the engines'
24 batch slots, R = 6: the limits bind) and four admission instances: `llmgw up`'s edge runs
one and three `llmgw admission` processes join it, so each limit is split four ways. A request
sent to the third party is *avoidable* when the engines' own running + waiting count, read at
that instant, was below G - R (a new session) or G (a pinned session's temporary fallback): a
lone instance holding the whole limit would have kept it. Before instances borrowed from each
other, 9.8-13% of requests were avoidable offloads at 90% load; the bounds below are the goal,
1%, with a margin for a short run on a shared host.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from placement import run_once

pytestmark = [pytest.mark.e2e, pytest.mark.latency]

SECONDS = 10  # arrivals per load level
THINK = 0.2


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Any]:
    found = run_once(
        tmp_path_factory.mktemp("placement-instances"),
        SECONDS,
        (0.5, 0.9),
        THINK,
        instances=4,
        limits="capacity",
        outage=False,
    )
    print(found)
    return found


def test_a_cold_cluster_of_four_instances_keeps_concurrent_requests_on_our_engines(results):
    assert results["admission_instances"] == 4
    assert results["cold_start"] == {"requests": 16, "third_party": 0, "failed": 0}


def test_one_shots_across_four_instances_stay_on_our_engines(results):
    one_shots = results["one_shots"]
    assert one_shots["one_shots_failed"] == 0
    # 16 at a time, below G - R = 18: a lone instance never offloads one (margin: 1%).
    assert one_shots["one_shots_on_third_party"] <= 3, one_shots
    assert one_shots["session_providers"] == ["iris"] * 5, one_shots


@pytest.mark.parametrize("load", [50, 90])
def test_no_avoidable_offload_with_four_instances_at_the_fleets_real_capacity(results, load):
    mix = results[f"mix_{load}"]
    assert mix["failed"] == 0, mix
    assert mix["requests"] > 50 * load / 50, mix
    assert mix["avoidable_new_session"] <= 0.02, mix
    assert mix["avoidable_pinned_fallback"] <= 0.02, mix
    assert mix["later_turns"] >= 10, mix
    assert mix["turns_on_replica"] >= (0.92 if load == 50 else 0.82), mix
    # At 90% the unreserved limit binds (G - R = 18 of ~22 in flight): new sessions that a
    # lone instance would offload too are pinned on the third party, where their later turns
    # hit no prefix cache of ours (docs/benchmarks.md, "Placement", compares N = 1 and 4).
    assert mix["prefix_vs_ideal"] >= (0.87 if load == 50 else 0.65), mix
    # Batch bands wait for our engines when only the limits are full (ADR 0002, "a band that
    # waits is held for quota"): none starts a session on the third party.
    batch = {
        route: n
        for route, n in mix["third_party_by_route_band"].items()
        if route.startswith("new_pin/") and route.split("/")[1] in ("silver", "bronze")
    }
    assert not batch, mix
    # The instances really borrowed: their shares alone would not have held the load.
    loans = results["quota_loans"]
    assert loans.get("loans_total:free", 0) + loans.get("loans_total:lent", 0) > 0, loans
