"""What flow control costs a request when nothing is saturated: the same gateway, flow off vs on.

Two clusters run side by side (same config but `admission.enabled`; the flow-on one also runs
the scraper that feeds it), each an edge + admission in front of one zero-delay simulated
engine, gateway processes pinned to one core, the load generator to the other. Runs alternate
between the clusters, so both see the same machine noise. Reported per concurrency: latency
p50/p99 of each, the difference, and gateway CPU (edge + admission) per request.

    python benchmarks/flow_cost.py [--rounds 5] [--requests 400]
"""

from __future__ import annotations

import argparse
import contextlib
import os

from ab import side_by_side
from cluster import running_cluster
from overhead import GATEWAY_CPUS, LOADGEN_CPUS


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=400, help="requests per run")
    args = parser.parse_args()
    os.sched_setaffinity(0, LOADGEN_CPUS)
    with contextlib.ExitStack() as stack:
        clusters = {
            name: stack.enter_context(running_cluster(GATEWAY_CPUS, LOADGEN_CPUS, flow=flow))
            for name, flow in (("off", False), ("on", True))
        }
        side_by_side(clusters, (1, 32), args.rounds, args.requests, "flow control")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
