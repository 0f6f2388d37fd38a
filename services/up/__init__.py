"""`llmgw up`: a local cluster (embedded NATS, simulators, admission, edge) under one supervisor."""
