"""What flow control costs a request when nothing is saturated: the same gateway, flow off vs on.

Two clusters run side by side (same config but `admission.enabled`; the flow-on one also runs
the scraper that feeds it), each an edge + admission in front of one zero-delay simulated
engine, gateway processes pinned to one core, the load generator to the other. Runs alternate
between the clusters, so both see the same machine noise. Reported per concurrency: latency
p50/p99 of each, the difference, and gateway CPU (edge + admission) per request.

    python benchmarks/flow_cost.py [--rounds 5] [--requests 400]
"""

from __future__ import annotations

from ab import compare


def main() -> int:
    variants = {"off": {"flow": False}, "on": {"flow": True}}
    return compare(__doc__ or "", variants, (1, 32), "flow control")


if __name__ == "__main__":
    raise SystemExit(main())
