"""The rate balancer inside admission: deployment rates learned from every edge's traffic.

`RateBoard` keeps one `RateWindows` (llmgw.core.balancer) over all endpoints, fed (by the
service) with the per-request stats every edge publishes on llmgw.v1.stats.request, so each
admission instance
learns from all of the gateway's traffic, not only from the requests it placed itself. Placing
a request on a provider whose strategy is "rate" draws its endpoint with the balancer's weights.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from llmgw.clock import SYSTEM, Clock, TimeSource, wall_of
from llmgw.core.balancer import BalancerSettings, RateSample, RateWindows, choose, weights
from llmgw.wire import RequestEnded

# Outcomes that are the endpoint's failure (llmgw.core.outcomes.Outcome values).
UPSTREAM_FAILURES = frozenset(
    {"upstream_unreachable", "upstream_timeout", "upstream_error", "upstream_broken_stream"}
)

if TYPE_CHECKING:
    from llmgw.config.schema import Config


def balancer_settings(config: Config) -> BalancerSettings:
    section = config.balancer
    return BalancerSettings(
        window=section.window,
        input_to_output_token_ratio=section.input_to_output_token_ratio,
        greediness=section.greediness,
    )


class RateBoard:
    """Rates per endpoint in the sliding window; `pick` draws one of the given endpoints."""

    def __init__(
        self,
        config: Config,
        *,
        rng: random.Random | None = None,
        clock: Clock | TimeSource = SYSTEM,
    ) -> None:
        self.windows = RateWindows(balancer_settings(config))
        self._known = {e.id for e in config.endpoints}
        self._rng = rng or random.Random()
        self._clock = wall_of(clock)
        self.max_exploring = config.balancer.max_exploring
        self.samples = 0

    def reconfigure(self, config: Config) -> None:
        """Follow a change of the live fleet: learn rates of its endpoints (windows of endpoints
        that left age out) and of its balancer settings (the windows kept, read with them)."""
        self._known = {e.id for e in config.endpoints}
        self.windows.settings = balancer_settings(config)
        self.max_exploring = config.balancer.max_exploring

    def add(self, stats: RequestEnded) -> None:
        """A sample: a success with its tokens, or an upstream failure with none. Anything else
        (the client left, the engine refused the request itself, it never reached the upstream)
        says nothing about the rate."""
        if stats.endpoint not in self._known or not stats.sent:
            return  # another gateway's endpoint, or a config this instance does not have
        if not (stats.ok or stats.outcome in UPSTREAM_FAILURES):
            return
        self.samples += 1
        self.windows.add(
            stats.endpoint,
            RateSample(
                at=stats.ended_at,
                latency=stats.latency,
                output_tokens=stats.output_tokens if stats.ok else 0,
                input_tokens=stats.input_tokens if stats.ok else 0,
            ),
        )

    def weights(
        self, endpoint_ids: Sequence[str], exploring: Mapping[str, int] | None = None
    ) -> dict[str, float]:
        """The balancer's weights; ``exploring``: this instance's requests in flight per
        endpoint (caps exploration of endpoints without samples: `balancer.max_exploring`)."""
        rates = self.windows.snapshot(endpoint_ids, self._clock())
        return weights(rates, self.windows.settings, exploring, self.max_exploring)

    def pick(self, endpoint_ids: Sequence[str]) -> str:
        return choose(self.weights(endpoint_ids), self._rng)
