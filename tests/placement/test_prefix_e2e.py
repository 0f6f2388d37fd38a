"""Cache-aware placement end to end: benchmarks/prefix.py's main workload, shorter, side by side
on fresh engines with the same arrivals.

Four simulated engines (4 batch slots, an LRU prefix cache of 16-token blocks holding about a
third of the 12 tenants' 1,200-token system prompts) in this process; 35% of the benchmark's
sessions over 35% of its 30 s (the same rate), 1-3 streamed turns each. Routers: the
tenant-partition oracle (tenant t straight to engine t mod 4), llmgw cache-blind
(`prefix.enabled: false`), and llmgw with the shipped prefix defaults through `llmgw up` (flow
control on, G = 16 = the engines' slots, R = 4, no third party) with one admission instance and
with four (the edge's and three `llmgw admission` processes). Asserted with margin against the
benchmark's goals (docs/benchmarks.md, "Cache-aware placement"):

- llmgw serves at least 0.9x the oracle's share of prompt tokens from the engines' caches, and
  clearly more than cache-blind llmgw;
- at most 10 points more of its requests than the oracle's wait as long as a cold prefill for
  their first token (over 150 ms), and under 0.4x cache-blind llmgw's share (the full
  benchmark's p90 goal, 1.2x the oracle's, is met there: 1.05x on 2026-12-07);
- with four admission instances it is clearly above cache-blind llmgw's too, and within 5 points
  of one instance's.

With `prefix.weight: 0` (cache-blind placement, the chains still sent) the share of prompt
tokens from cache falls to the cache-blind router's: the checks of the share fail.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from prefix import run_phase

pytestmark = [pytest.mark.e2e, pytest.mark.latency]

SCALE = 0.35  # of the benchmark's 300 sessions over 30 s
ROUTERS = ["oracle", "blind", "llmgw", "llmgw-n4"]


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, dict[str, Any]]:
    found = run_phase(tmp_path_factory.mktemp("prefix"), "main", ROUTERS, scale=SCALE)
    for row in found:
        print({k: v for k, v in row.items() if k != "admission"})
    return {row["variant"]: row for row in found}


def test_every_router_served_every_request(rows):
    for row in rows.values():
        assert row["requests"] >= 200, row  # the arrivals ran
        assert row["errors"] == 0, row
        # What the responses said came from cache is what the engines counted.
        assert row["hit"] == pytest.approx(row["engine_hit"], abs=1e-9), row


def test_llmgw_serves_nearly_the_oracles_share_of_prompt_tokens_from_cache(rows):
    oracle, llmgw, blind = rows["oracle"], rows["llmgw"], rows["blind"]
    assert oracle["hit"] >= 0.8, oracle  # the workload is cacheable: the oracle shows it
    assert llmgw["hit"] >= 0.9 * oracle["hit"], (llmgw["hit"], oracle["hit"])
    assert llmgw["hit"] >= blind["hit"] + 0.15, (llmgw["hit"], blind["hit"])


def test_llmgw_keeps_slow_first_tokens_near_the_oracles_share(rows):
    """The tail of TTFT, as the share of requests slow as a cold prefill (the benchmark's
    `slow_share`: over 150 ms), not as a p90: with ~220 requests whose TTFT is either ~40 ms
    or ~300 ms, a p90 jumps between the two on a couple of requests (quiet runs of this test:
    llmgw 6.8% against the oracle's 6.4%, p90 64 against 41 ms; in a full parallel suite run
    p90 270 ms). The full benchmark's p90 goal (1.2x) is measured in docs/benchmarks.md."""
    oracle, llmgw, blind = rows["oracle"], rows["llmgw"], rows["blind"]
    print({r: (rows[r]["ttft_p90"], rows[r]["slow_share"]) for r in rows})
    assert llmgw["slow_share"] <= oracle["slow_share"] + 0.10, (llmgw, oracle)
    assert llmgw["slow_share"] <= 0.4 * blind["slow_share"], (llmgw, blind)


def test_four_admission_instances_place_by_prefix_too(rows):
    four, blind = rows["llmgw-n4"], rows["blind"]
    assert four["hit"] >= blind["hit"] + 0.15, (four["hit"], blind["hit"])


def test_four_admission_instances_place_by_prefix_as_one_does(rows):
    one, four = rows["llmgw"], rows["llmgw-n4"]
    assert abs(four["hit"] - one["hit"]) <= 0.05, (four["hit"], one["hit"])
