"""What API keys cost a request: the same gateway with auth.mode none and with keys.

Two clusters run side by side, identical but for `auth.mode` (edge + admission + nats-server
pinned to one core, a zero-delay engine and the load generator on the other); the keys cluster's
one key has an rpm, a tpm and a max_parallel_requests (all far above the load), so every request
passes every check: the key lookup in the edge's mirror, the rpm/tpm window, the model and band
rules, and the key's parallel-request quota in admission. Runs alternate between the clusters.
Reported per concurrency: p50/p99 of each, the paired difference of p50 (keys - none) and gateway
CPU per request. A second part times the edge's check alone, in this process (CPU time), over a
mirror of 10,000 keys.

    python benchmarks/keys_cost.py [--rounds 5] [--requests 400]
"""

from __future__ import annotations

import statistics
import time

from ab import compare

from llmgw.core.apikeys import ApiKey, digest_of
from llmgw.services.edge.auth import KeyAuth
from llmgw.services.edge.limits import KeyLimiter
from llmgw.state.apikeys import KeyMirror

KEY_OPTIONS = ("--rpm", "100000000", "--tpm", "1000000000", "--max-parallel", "10000")


def check_alone(calls: int = 200_000) -> tuple[float, float]:
    """CPU seconds per check (caller + model + band) and per refused unknown key (process CPU
    time, so other processes on a shared machine do not inflate it)."""
    mirror = KeyMirror(kv=None, clock=time.time)  # type: ignore[arg-type]
    secrets = [f"sk-llmgw-{i:048x}" for i in range(10_000)]
    for i, secret in enumerate(secrets):
        mirror.keys[digest_of(secret)] = ApiKey(
            digest_of(secret), f"t{i}", models=("bench-*",), rpm=10**9, tpm=10**9
        )
    auth = KeyAuth(
        mirror,
        KeyLimiter(None, "bench", interval=1.0, clock=time.time),
        default_band="gold",
        clock=time.time,
    )
    header = f"Bearer {secrets[1234]}"
    ids = {"x-request-id": "r"}
    started = time.process_time()
    for _ in range(calls):
        caller = auth.caller(header, ids)
        auth.model_denied(caller, "bench-model", "bench-model")  # type: ignore[arg-type]
        auth.band(caller, None)  # type: ignore[arg-type]
    per_check = (time.process_time() - started) / calls
    started = time.process_time()
    for _ in range(calls):
        auth.caller("Bearer sk-llmgw-unknown", ids)
    return per_check, (time.process_time() - started) / calls


def main() -> int:
    variants = {v: {"auth": v == "keys", "key_options": KEY_OPTIONS} for v in ("none", "keys")}
    compare(__doc__ or "", variants, (1, 64), "auth.mode")
    checks = [check_alone() for _ in range(3)]
    per_check = statistics.median(c[0] for c in checks)
    missing = statistics.median(c[1] for c in checks)
    print(
        f"\nThe edge's check alone (10,000 keys in the mirror; median of 3 x 200,000): "
        f"{per_check * 1e6:.2f} us per request (lookup, rpm/tpm window, model, band), "
        f"{missing * 1e6:.2f} us for an unknown key (the 401 response built)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
