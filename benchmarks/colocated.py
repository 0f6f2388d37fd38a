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

from ab import compare


def main() -> int:
    variants = {
        "separate": {"flow": True},
        "colocated": {"flow": True, "admissions": 0, "colocated": True},
    }
    return compare(__doc__ or "", variants, (1, 64), "admission")


if __name__ == "__main__":
    raise SystemExit(main())
