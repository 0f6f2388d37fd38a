"""Colocated admission against a separate admission process: the same gateway otherwise.

Two clusters run side by side, each with the shipped defaults (flow control on and the scraper
that feeds it, provider limits, 256 sessions) in front of one zero-delay simulated engine:
"separate" is an edge plus one `llmgw admission` process; "colocated" is an edge with
`admission.colocated: true` and no other admission instance, so its own instance owns every
shard and no decision crosses NATS. Gateway processes (edge, admission, nats-server) are pinned
to one core, the load generator and the engine to the other; runs alternate between the
clusters. Reported per concurrency: p50/p99 of each, the difference, and gateway CPU per
request (edge + admission + nats-server).

    python benchmarks/colocated.py [--rounds 5] [--requests 400]
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
            "separate": stack.enter_context(running_cluster(GATEWAY_CPUS, LOADGEN_CPUS, flow=True)),
            "colocated": stack.enter_context(
                running_cluster(GATEWAY_CPUS, LOADGEN_CPUS, flow=True, admissions=0, colocated=True)
            ),
        }
        side_by_side(clusters, (1, 64), args.rounds, args.requests, "admission")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
