"""Flow control's promise, end to end: a bronze flood must not hurt platinum's latency.

The scenario lives in benchmarks/interference.py (the benchmark repeats it and reports figures):
a whole cluster under `llmgw up` with the shipped defaults, two 8-slot engines, 500 bronze
requests running continuously, platinum probes of similar length at a fixed rate (the hard
case: a bronze request holds a slot as long as a probe needs one). Both directions are asserted, so the test fails if admission regresses and also if the
load stops being a real load:

- admission on, the engines running vLLM's priority scheduling and the edge sending each band's
  priority (`endpoints[].priority_scheduling`): platinum p99 <= 1.2x idle (the goal; measured
  1.06-1.09x, docs/benchmarks.md), and bronze really waited in admission's queue. With FIFO
  engines the shipped batch headroom alone gives 1.07-1.71x: the tail needs the engine's help;
- admission off (`admission.enabled: false`, FIFO engines): platinum p99 >= 10x idle (measured
  ~39x).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from up_harness import REPO, UpProcess

sys.path.insert(0, str(REPO / "benchmarks"))
from interference import (
    READY,
    cluster_endpoints,
    interference_config,
    measure,
    p99,
    summary,
)

pytestmark = [pytest.mark.e2e, pytest.mark.latency]


def run_cluster(
    tmp_path: Path,
    start_up,
    *,
    admission: bool,
    engine_priority: bool = False,
    cap_factor: float | None = None,
) -> dict[str, Any]:
    config = interference_config(
        tmp_path / f"admission-{admission}.yaml",
        admission=admission,
        engine_priority=engine_priority,
    )
    up: UpProcess = start_up(config)
    api = up.wait_for(READY, timeout=90).group(1)
    try:
        return asyncio.run(measure(api, *cluster_endpoints(config), cap_factor=cap_factor))
    finally:
        # Ctrl-C twice: this test is about latency, not stopping (tests/up/test_up_e2e.py). A
        # graceful stop would wait for the flood's abandoned requests still at the engines (up
        # to llmgw up's grace); the second signal kills what is left, NATS still stops cleanly.
        up.process.send_signal(signal.SIGTERM)
        up.wait_for(r"^\[edge\] stopping", timeout=10)
        up.stop()


def test_platinum_latency_holds_under_a_bronze_flood_only_with_admission(tmp_path, start_up):
    on = run_cluster(tmp_path, start_up, admission=True, engine_priority=True)
    print("admission on: " + summary(on))
    assert on["bronze_done"] > 50, "bronze made no progress: the load was not a real load"
    assert on["bronze_queued"] > 100, "bronze was not held back in admission"
    assert on["bronze_failed"] == 0, summary(on)
    assert p99(on["loaded"]) <= 1.2 * p99(on["idle"]), summary(on)

    # A probe counts as at most 11x the idle p99 (a lower bound on its latency: ~7 s instead of
    # the ~22 s it waits behind the flood). The p99 of those is never above the true p99, so a
    # pass is never a false pass; it is the true p99 capped while the second-worst probe
    # reaches the cap (measured: all of them wait ~20 s).
    off = run_cluster(tmp_path, start_up, admission=False, cap_factor=11)
    print("admission off: " + summary(off))
    assert p99(off["loaded"]) >= 10 * p99(off["idle"]), summary(off)
    assert off["bronze_queued"] == 0 and off["bronze_failed"] == 0, summary(off)
