"""`llmgw state`: what the routing bucket holds now (pins, leases, limits), for operators.

- `report`: the pure summary of one listing of the bucket, as text or JSON;
- `main.run`: the command (binds the configured bucket read-only and prints the report).
"""
