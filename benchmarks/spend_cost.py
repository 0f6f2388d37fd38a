"""What prices and budgets cost a request: the same keyed gateway without and with them.

Two clusters run side by side (`benchmarks/ab.py`), identical but for `spend`: the second prices
the engine's tokens and gives the key's tenant a monthly `max_spend` far above the load, so
every request reserves its estimate from the edge's grant before admission and settles its cost
at its end (the edge asks admission for a larger grant when its grant runs low). Both count
spend per attempt (the edge always does). Reported per concurrency: p50/p99 of each, the paired
difference of p50 and gateway CPU per request. A second part times the accounting alone, in
this process (CPU time): pricing one attempt (whole response; a stream cut short, estimated and
calibrated) and one reservation with its settlement.

    python benchmarks/spend_cost.py [--rounds 5] [--requests 400]
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import yaml
from ab import compare

from llmgw.config import config_from_dict
from llmgw.core.budget import period_id
from llmgw.core.usage import Usage
from llmgw.services.edge.budgets import BudgetGuard
from llmgw.services.edge.metrics import EdgeMetrics
from llmgw.services.edge.spend import SpendBook

KEY_OPTIONS = ("--rpm", "100000000", "--tpm", "1000000000")
SPEND = {
    "prices": [{"provider": "local", "input": 0.5, "output": 1.5}],
    "budgets": [{"tenant": "bench", "period": "monthly", "max_spend": 1000000}],
}
BODY = {
    "model": "bench-model",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Explain what a prefix cache is, in two sentences."},
    ],
    "max_tokens": 20,
}


def _local_config():  # type: ignore[no-untyped-def]
    data = yaml.safe_load((Path(__file__).parents[1] / "config" / "local.yaml").read_text())
    data["spend"] = {
        "prices": [{"provider": "tensorx", "input": 0.6, "output": 2.4}],
        "budgets": [{"tenant": "bench", "period": "monthly", "max_spend": 1000000}],
    }
    return config_from_dict(data, env={})


def accounting_alone(calls: int = 100_000) -> dict[str, float]:
    """CPU microseconds per call of each part of the accounting (process CPU time)."""
    config = _local_config()
    book = SpendBook(None, "bench", config, EdgeMetrics().spend)  # with its metrics
    usage = Usage(40, 20, 8)
    result = {}
    started = time.process_time()
    for _ in range(calls):
        book.attempt_ended(
            key="k", tenant="bench", provider="tensorx", model="llama-3.3-70b", usage=usage
        )
    result["priced attempt (usage)"] = (time.process_time() - started) / calls * 1e6
    started = time.process_time()
    for _ in range(calls):
        book.attempt_ended(
            key="k",
            tenant="bench",
            provider="tensorx",
            model="llama-3.3-70b",
            usage=None,
            relayed=8,
            body=BODY,
            chat=True,
        )
    result["priced stream cut short (estimate)"] = (time.process_time() - started) / calls * 1e6

    async def reservations() -> float:
        guard = BudgetGuard(None, "bench", config)
        budget = guard.tenants["bench"]
        period = period_id(budget.period, time.time())
        account = guard._account("spend", "tenant-bench", period, budget.max_spend or 0)
        account.purse.grant = 10**30  # a grant that never runs out: no ask in the loop
        began = time.process_time()
        for _ in range(calls):
            held = await guard.reserve("bench", "llama-3.3-70b", BODY)
            held.settle(1000, third_party=True)  # type: ignore[union-attr]
        return (time.process_time() - began) / calls * 1e6

    result["reservation + settlement"] = asyncio.run(reservations())
    return result


def main() -> int:
    variants = {
        "none": {"auth": True, "key_options": KEY_OPTIONS},
        "spend": {"auth": True, "key_options": KEY_OPTIONS, "spend": SPEND},
    }
    compare(__doc__ or "", variants, (1, 64), "spend")
    runs = [accounting_alone() for _ in range(3)]
    print("\nThe accounting alone (median of 3 x 100,000, CPU us per call):")
    for name in runs[0]:
        print(f"  {name}: {statistics.median(r[name] for r in runs):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
