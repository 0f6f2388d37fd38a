"""`llmgw reaper`: clears what dead admission instances left in the routing bucket, announces it.

Leases and idle pins expire at the admission instance that owns their shard, not here. The
reaper removes member keys that stopped being renewed and quota nobody adopted; beside it the
same process drains and removes self-registered endpoints that stopped heartbeating, follows
engines' model lists (`fleet.models_refresh`, and at once on an edge's notice of an engine's 404
for a model it lists) and, when configured, Kubernetes EndpointSlices.

- `service.Reaper`: the loop over the routing state's reaper primitives (one pass per interval);
- `metrics.ReaperMetrics`: its Prometheus metrics in a registry of their own;
- `main.run`: the composition root (config, NATS, routing state, signals).
"""
