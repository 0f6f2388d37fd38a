"""The edge on a clock the test steps: the drain's last step (`EdgeDrain.cut`) cuts running
requests round after round until none holds a lease or `within` seconds of the drain's clock
pass; the parts `open_edge_deps` composes read the one clock it is given."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
from fakes import FakeLeases
from timing import SteppedClock

from llmgw.core.ledger import LeaseKind, LeaseRecord
from llmgw.services.edge.app import Edge
from llmgw.services.edge.drain import EdgeDrain
from llmgw.services.edge.main import close_edge_deps, open_edge_deps
from llmgw.serving import free_port


def record(lease_id: str) -> LeaseRecord:
    return LeaseRecord(lease_id, "iris", "m1", LeaseKind.TEMPORARY, False, 0, "edge", 0.0, 0.0)


async def test_a_request_that_ignores_the_cut_is_cut_again_until_within_passes_on_its_clock():
    clock = SteppedClock()
    drain = EdgeDrain(clock)
    leases = FakeLeases()
    stubborn = leases.hold(record("l-1"))  # its request never ends: the lease stays held
    cuts: list[float] = []

    def cut_once() -> None:  # each round takes 0.4 s of the drain's clock
        cuts.append(clock.monotonic())
        clock.advance(0.4)

    stubborn.on_lost = cut_once
    assert await asyncio.wait_for(drain.cut(leases, within=1.0), 5) == 1
    start = cuts[0]
    assert [round(c - start, 6) for c in cuts] == [0.0, 0.4, 0.8]  # at 1.2 s: past within
    assert drain.cut_requests == 1 and stubborn.cut_short


async def test_the_cut_ends_as_soon_as_no_request_holds_a_lease():
    clock = SteppedClock()
    drain = EdgeDrain(clock)
    leases = FakeLeases()
    hold = leases.hold(record("l-2"))
    hold.on_lost = lambda: leases.end(hold)  # its request ends when cut
    assert await asyncio.wait_for(drain.cut(leases, within=30.0), 5) == 1
    assert leases.held == {} and clock.monotonic() == 1_000_000.0  # no time had to pass


async def test_the_edges_parts_read_the_one_clock_its_composition_root_is_given(
    make_gateway_config: Any, nats_url: str, unique_id: str
) -> None:
    """`open_edge_deps(clock=...)`: a lease unconfirmed for lease_timeout of that clock is lost,
    spend is counted in that clock's day (1970-01-12 here, not today), and the edge and its
    request attempts are handed that clock (an end's stamp, a tpm key's window)."""
    urls = {n: f"http://127.0.0.1:{free_port()}" for n in ("engine-1", "engine-2", "tensorx-1")}
    config = make_gateway_config(nats_url, urls, f"routing_{unique_id}")
    clock = SteppedClock()
    nc = await nats.connect(nats_url)
    deps = await open_edge_deps(nc, config, "edge-clock", clock=clock)
    try:
        hold = deps.leases.hold(record("l-3"))
        assert not deps.leases.expired(hold)
        clock.advance(config.pinning.lease_timeout)
        assert deps.leases.expired(hold)
        deps.leases.end(hold)
        assert deps.spend is not None and deps.spend.day == "1970-01-12"
        assert deps.clock is clock
        edge = Edge(config, deps)
        assert edge.attempts.deps.clock is clock
    finally:
        await close_edge_deps(deps)
        await nc.close()
