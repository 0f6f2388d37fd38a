"""Placement with every policy on at once, end to end, with the shipped defaults (flow control
on).

One scenario (benchmarks/placement.py, which reports the figures) on one fresh `llmgw up`
cluster: config/local.yaml on free ports, its two engines (8 and 16 batch slots) and two
third-party deployments served by simulators in this process, so that every request's fate is
observed where it happens (did it wait for a batch slot; did the other engine have one free).
Shorter phases than the benchmark, so each bound is asserted with a margin:

- cold start: 16 concurrent gold requests on the fresh cluster: none to the third party;
- 300 one-shot conversations (more than the pin table holds), then a new multi-turn session:
  pinned on our engines, and none of the one-shots went away either;
- a mix at 50% and 90% of managed capacity: no request to the third party while an engine had
  a free slot, chat turns on their session's replica, prefix-cache hits near the ideal, no
  interactive request waiting at an engine while the other had a free slot;
- a session pinned on the third party during an engine outage returns home.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from placement import run_once

pytestmark = [pytest.mark.e2e, pytest.mark.latency]

SECONDS = 8  # arrivals per load level
THINK = 0.2  # seconds between a chat's turns (the benchmark: 0.5)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Any]:
    found = run_once(
        tmp_path_factory.mktemp("placement"), SECONDS, (0.5, 0.9), THINK, limits="local"
    )
    print(found)
    return found


def test_a_cold_cluster_keeps_concurrent_requests_on_its_own_engines(results):
    assert results["cold_start"] == {"requests": 16, "third_party": 0, "failed": 0}


def test_one_shot_conversations_cannot_lock_new_sessions_out_of_our_engines(results):
    one_shots = results["one_shots"]
    assert one_shots["one_shots_failed"] == 0
    assert one_shots["one_shots_on_third_party"] == 0, one_shots
    assert one_shots["session_providers"] == ["iris"] * 5, one_shots
    assert one_shots["session_routes"] == ["new_pin"] + ["pinned"] * 4, one_shots


@pytest.mark.parametrize("load", [50, 90])
def test_the_mix_stays_on_our_engines_and_on_each_sessions_replica(results, load):
    mix = results[f"mix_{load}"]
    assert mix["failed"] == 0, mix
    assert mix["requests"] > 40 * load / 50, mix  # a real load: the Poisson arrivals ran
    assert mix["third_party_while_free"] <= 0.01, mix
    assert mix["interactive_waited_while_free"] <= 0.02, mix
    assert mix["later_turns"] >= 10, mix
    assert mix["turns_on_replica"] >= (0.95 if load == 50 else 0.85), mix
    assert mix["prefix_vs_ideal"] >= (0.9 if load == 50 else 0.85), mix


def test_a_session_pinned_away_during_an_outage_returns_home(results):
    home = results["return_home"]
    assert home["returned_after"] is not None, home
    assert home["returned_after"] >= 30, home  # pinning.return_home_after: no flapping
    assert home["providers"][-1] == "iris", home
    # Its engines were healthy again at once, but it stayed put until return_home_after.
    assert home["before_return_home_after"] == ["tensorx", "pinned"], home
