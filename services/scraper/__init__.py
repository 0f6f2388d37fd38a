"""`llmgw scraper`: reads every managed endpoint's /metrics and /health, publishes its load.

- `reports`: the decisions, pure (report building, outcomes, health transitions, pool reports);
- `service.Scraper`: the loop (HTTP scrapes, the load bucket, NATS events);
- `metrics.ScraperMetrics`: its Prometheus metrics in a registry of their own;
- `admin.create_admin_app`: the optional admin port (/metrics, /health);
- `main.run`: the composition root (config, NATS, the load bucket, HTTP client, signals).

Several scrapers may run at once; duplicates are harmless (see `llmgw.load`).
"""
