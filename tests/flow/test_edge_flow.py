"""Flow control as a client sees it through the real edge: statuses, Retry-After, leaving early."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from rig import BODY
from test_flow_control import open_headroom, saturate
from timing import eventually


async def post(rig, band: str, timeout: float = 10) -> httpx.Response:
    async with httpx.AsyncClient(timeout=timeout) as client:
        return await client.post(
            rig.edge_url + "/v1/chat/completions", json=BODY, headers={"x-llmgw-band": band}
        )


async def leases(rig) -> int:
    """Leases admission accounts, plus those the edge still holds."""
    return sum(len(a.ledger.leases) for a in rig.admissions) + len(rig.edge.deps.leases.held)


@pytest.mark.parametrize("stack", [{"queue_capacity_per_band": 1}], indirect=True)
async def test_a_full_queue_answers_429_with_retry_after(stack):
    await saturate(stack)
    first = asyncio.create_task(post(stack, "bronze"))
    await eventually(lambda: stack.queued() == 1)
    response = await post(stack, "bronze")
    assert response.status_code == 429
    assert int(response.headers["retry-after"]) >= 1
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
    assert "bronze" in error["message"]
    await open_headroom(stack)
    assert (await first).status_code == 200
    assert await leases(stack) == 0 or await until_no_leases(stack)


@pytest.mark.parametrize("stack", [{"queue_ttl": "300ms"}], indirect=True)
async def test_a_request_that_outwaits_the_queue_ttl_answers_503_with_retry_after(stack):
    await saturate(stack)
    started = time.monotonic()
    response = await post(stack, "silver")
    assert time.monotonic() - started >= 0.3
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["code"] == "queue_timeout"
    assert await leases(stack) == 0  # waiting never held a lease


async def test_an_unknown_band_is_a_400_naming_the_header(stack):
    response = await post(stack, "diamond")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "x-llmgw-band" and "diamond" in error["message"]
    assert stack.queued() == 0 and await leases(stack) == 0


async def test_a_client_that_leaves_while_queued_leaves_the_queue(stack):
    await saturate(stack)
    with pytest.raises(httpx.ReadTimeout):
        await post(stack, "bronze", timeout=0.3)
    await eventually(lambda: stack.queued() == 0, what="the queue to empty after the client left")
    assert stack.admissions[0].metrics.cancellations._value.get() == 1


async def test_a_client_leaving_does_not_cancel_another_with_the_same_request_id(stack):
    """x-request-id is the client's: two clients may send the same one. The one that leaves
    takes only its own request out of the queue."""
    await saturate(stack)
    same = {"x-llmgw-band": "bronze", "x-request-id": "shared-id"}
    async with httpx.AsyncClient(timeout=10) as client:
        staying = asyncio.create_task(
            client.post(stack.edge_url + "/v1/chat/completions", json=BODY, headers=same)
        )
        await eventually(lambda: stack.queued() == 1)
        async with httpx.AsyncClient(timeout=0.3) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                await impatient.post(
                    stack.edge_url + "/v1/chat/completions", json=BODY, headers=same
                )
        await eventually(lambda: stack.queued() == 1, what="only the client that left, gone")
        await open_headroom(stack)
        response = await staying
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "shared-id"


async def until_no_leases(rig, timeout: float = 2.0) -> bool:
    async def none_left() -> bool:
        return await leases(rig) == 0

    return await eventually(none_left, timeout, "no lease outlives its request", interval=0.02)


async def test_a_grant_that_races_with_the_client_leaving_is_released_at_once(stack):
    """Clients give up just as room opens; whichever wins, no lease outlives them.

    Leases are renewed for 30 s, so one that the edge failed to release would stay in the
    ledger far beyond the 2 s this test allows.
    """
    outcomes = []
    for attempt in range(12):
        await saturate(stack)
        leaving = asyncio.create_task(post(stack, "bronze", timeout=0.2))
        # Queued only until the client leaves (0.2 s): looked at often enough not to miss it.
        await eventually(lambda: stack.queued() == 1, interval=0.002)
        await asyncio.sleep(0.2 - 0.012 * attempt)  # room opens around the client's timeout
        await stack.report_all(running=8, waiting=0)
        try:
            outcomes.append((await leaving).status_code)
        except httpx.ReadTimeout:
            outcomes.append("left")
        await eventually(lambda: stack.queued() == 0)
        await until_no_leases(stack)
    assert "left" in outcomes


# The test's one report stays fresh however slow the host (with the rig's 5 s, a loaded host
# took longer, the report went stale, the pool counted as saturated and bronze waited there).
@pytest.mark.parametrize("stack", [{"router": {"stale_after": "120s"}}], indirect=True)
async def test_a_finished_request_stops_counting_against_its_engine_before_the_next_scrape(stack):
    """Short requests must not look like load for a whole scrape interval: with one report
    (nothing running, 8 slots) and no other, 33 requests one after another all pass at once;
    a finished request counted until the next report would fill the 8 slots and hold the
    ninth."""
    await stack.report_all(running=0, capacity=8)
    board = stack.admissions[0].load
    for _ in range(3):
        response = await post(stack, "bronze")
        assert response.status_code == 200
        endpoint = response.headers["x-llmgw-endpoint"]
        await eventually(
            lambda e=endpoint: board.own(e) == 0,
            what="the edge's end-of-request notice to reach admission",
        )
    # 30 short requests one after another all go through at once: none waits on stale counts.
    for _ in range(30):
        assert (await post(stack, "bronze")).status_code == 200
    assert stack.admissions[0].metrics.flow_decisions.labels("bronze", "granted")._value.get() == 33
