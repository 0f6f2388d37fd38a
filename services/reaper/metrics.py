"""The reaper's Prometheus metrics, in a registry of its own (never the global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from llmgw.telemetry import service_registry

_PASS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
STEPS = ("remove_dead_members", "reclaim_quota")
ACTIONS = ("member_expired", "quota_reclaimed")


class ReaperMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or service_registry("reaper")
        self.actions = Counter(
            "llmgw_reaper_actions",
            "Changes this reaper made to the routing bucket, by kind (member_expired, "
            "quota_reclaimed).",
            ["kind"],
            registry=self.registry,
        )
        self.pass_duration = Histogram(
            "llmgw_reaper_pass_duration_seconds",
            "Duration of one reaper pass (every step, events included).",
            buckets=_PASS_BUCKETS,
            registry=self.registry,
        )
        self.last_pass = Gauge(
            "llmgw_reaper_last_pass_timestamp_seconds",
            "Unix time at which the last reaper pass ended.",
            registry=self.registry,
        )
        self.step_failures = Counter(
            "llmgw_reaper_step_failures",
            "Reaper steps that raised or timed out (the next pass retries them).",
            ["step"],
            registry=self.registry,
        )
        self.model_list_reads = Counter(
            "llmgw_reaper_model_list_reads",
            "Engines' GET /v1/models read to follow what they serve, by trigger: interval "
            "(fleet.models_refresh) or model_unloaded (an edge's notice of an engine's 404 for a "
            "model the fleet lists there).",
            ["trigger"],
            registry=self.registry,
        )
        self.unpublished_events = Counter(
            "llmgw_reaper_unpublished_events",
            "Changes made whose event could not be published.",
            registry=self.registry,
        )
        # Pre-create every label so dashboards see zeros before the first action.
        self._actions = {kind: self.actions.labels(kind) for kind in ACTIONS}
        for step in STEPS:
            self.step_failures.labels(step)
        self._reads = {t: self.model_list_reads.labels(t) for t in ("interval", "model_unloaded")}

    def count_model_list_read(self, trigger: str) -> None:
        self._reads[trigger].inc()

    def count_action(self, kind: str) -> None:
        counter = self._actions.get(kind)
        (counter if counter is not None else self.actions.labels(kind)).inc()
