"""Concurrency: 4 admission instances and 2 edges drive 200 sessions against small limits.

While the load runs, providers flip to degraded and engines start and stop
failing; clients cancel streams at random. A recorder keeps every write of
the routing bucket; the checker replays the whole history and fails on any
breach of the limits, a double grant, or a pin that expired under a live
lease. A second test runs a deliberately non-atomic variant and shows the
checker catches it.
"""

from __future__ import annotations

import asyncio
import random
import time
import types
from collections import Counter

import httpx
import pytest
from mesh import MODEL, Mesh, start_mesh

from llmgw.core.leasekeys import LEASE_PREFIX, LeaseSlotValue
from llmgw.state.checker import check_history
from llmgw.state.history import HistoryRecorder

pytestmark = pytest.mark.e2e

SESSIONS = 200
SOAK_SECONDS = 20
ALLOWED_STATUSES = {200, 502, 503}


async def _client(
    mesh: Mesh, session: int, deadline: float, rng: random.Random, outcomes: Counter
) -> None:
    headers = {"x-session-id": f"conversation-{session}"}
    async with httpx.AsyncClient(timeout=15, limits=httpx.Limits(max_connections=2)) as http:
        while time.monotonic() < deadline:
            edge = rng.choice(mesh.edges)
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"hello {session}"}],
                "max_tokens": rng.randint(1, 25),
                "stream": rng.random() < 0.5,
            }
            cancel = body["stream"] and rng.random() < 0.2
            try:
                if body["stream"]:
                    async with http.stream(
                        "POST", edge.url + "/v1/chat/completions", json=body, headers=headers
                    ) as r:
                        outcomes[r.status_code] += 1
                        async for _ in r.aiter_lines():
                            if cancel:
                                outcomes["cancelled"] += 1
                                break
                else:
                    r = await http.post(
                        edge.url + "/v1/chat/completions", json=body, headers=headers
                    )
                    outcomes[r.status_code] += 1
            except httpx.TimeoutException:
                outcomes["client_timeout"] += 1
            await asyncio.sleep(rng.uniform(0, 0.05))


async def _chaos(mesh: Mesh, deadline: float, rng: random.Random, log: list[str]) -> None:
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            provider = rng.choice("ab")
            mesh.set_degraded(provider, True)
            faults = {"error_rate": rng.choice([0.0, 0.2]), "die_at_token": rng.choice([None, 3])}
            engine = mesh.engines[rng.choice("ab")]
            await http.post(engine.url + "/sim/faults", json=faults)
            log.append(f"{provider} degraded; {faults}")
            await asyncio.sleep(rng.uniform(0.5, 1.5))
            mesh.set_degraded(provider, False)
            await asyncio.sleep(rng.uniform(0.2, 1.0))
        for engine in mesh.engines.values():
            await http.post(engine.url + "/sim/faults", json={"reset": True})
        mesh.set_degraded("a", False)
        mesh.set_degraded("b", False)


async def _taken_leases(mesh: Mesh) -> int:
    entries = await mesh.admissions[0].routing._kv.list(LEASE_PREFIX)
    return sum(1 for e in entries if LeaseSlotValue.from_json(e.value).is_taken)


async def _run(nats_client, nats_url, unique_id, seconds, **mesh_kwargs):
    bucket = f"soak_{unique_id}"
    mesh = await start_mesh(nats_url, bucket, **mesh_kwargs)
    recorder = await HistoryRecorder(nats_client.jetstream(), bucket).start()
    rng = random.Random(20261130)
    outcomes: Counter = Counter()
    chaos_log: list[str] = []
    deadline = time.monotonic() + seconds
    try:
        await asyncio.gather(
            _chaos(mesh, deadline, random.Random(rng.random()), chaos_log),
            *(
                _client(mesh, s, deadline, random.Random(rng.random()), outcomes)
                for s in range(SESSIONS)
            ),
        )
        for app in mesh.edge_apps:
            await app.edge.drain()
        leftover = await _taken_leases(mesh)
        entries = await recorder.sync(timeout=10)
    finally:
        await recorder.stop()
        await mesh.stop()
        await nats_client.jetstream().delete_key_value(bucket)
    violations = check_history(entries, mesh.limits, mesh.config.pinning.lease_timeout)
    return violations, outcomes, leftover, entries, chaos_log


async def test_limits_pins_and_leases_hold_under_concurrency_and_chaos(
    nats_client, nats_url, unique_id
):
    violations, outcomes, leftover, entries, chaos_log = await _run(
        nats_client, nats_url, unique_id, SOAK_SECONDS
    )
    assert violations == [], "\n".join(str(v) for v in violations[:20])
    # It was a real load: thousands of transitions, every kind of ending.
    assert len(entries) > 5_000, len(entries)
    assert (
        outcomes[200] > 1_000 and outcomes["cancelled"] > 50 and outcomes[503] + outcomes[502] > 0
    ), outcomes
    assert len(chaos_log) >= 8
    # I4: every request ended with a status from the table; none hung.
    assert set(outcomes) - {"cancelled"} <= ALLOWED_STATUSES, outcomes
    # I1: once traffic stops and releases drain, no lease is left behind.
    assert leftover == 0


def _blind_slot_taker(routing):
    """A broken variant: take a lease slot by a plain write, without compare-and-swap."""

    async def take(self, family, ranges, value, owner):
        index = self._rng.choice([i for r in ranges for i in r])
        revision = await self._kv.put(family.key(index), value)
        self.mirror.note(family, index, revision, owner, taken=True)
        return index, revision

    routing._take_slot = types.MethodType(take, routing)
    return routing


async def test_the_checker_catches_a_non_atomic_variant(nats_client, nats_url, unique_id):
    violations, *_ = await _run(
        nats_client, nats_url, unique_id, 3, routing_state_factory=_blind_slot_taker
    )
    kinds = Counter(v.invariant for v in violations)
    assert violations, "the checker missed a variant that overwrites taken slots"
    assert kinds["double-grant"] > 0, kinds
