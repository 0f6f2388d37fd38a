"""`llmgw reaper`: expires leases and idle pins, repairs interrupted operations, announces it.

- `service.Reaper`: the loop over the routing state's reaper primitives (one pass per interval);
- `metrics.ReaperMetrics`: its Prometheus metrics in a registry of their own;
- `main.run`: the composition root (config, NATS, routing state, signals).
"""
