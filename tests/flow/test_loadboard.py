"""The load board's inflight: the gateway's own exact count plus the engine's foreign load.

No phantom load: a request counts from its grant to its end message, never longer, whatever the
scraper saw; the engine's numbers only add what the gateway did not send.
"""

from __future__ import annotations

import time

from rig import MODEL, rig_config
from timing import eventually

from llmgw.core.context import ContextWindow
from llmgw.load import EndpointReport, LoadSample, report_key
from llmgw.services.admission.health import HealthBoard
from llmgw.services.admission.loadboard import (
    FOREIGN_WINDOW,
    PEER_FORGET_AFTER,
    LoadBoard,
    LoadFollower,
)
from llmgw.state.memory_kv import MemoryKV

T = 1_000_000.0


def board(**endpoint: object) -> LoadBoard:
    """A board of the rig's config, engine-1's capacity not configured unless given."""
    config = rig_config(
        "nats://127.0.0.1:4222",
        "x",
        router={"scrape_interval": "400ms"},
        endpoints={"engine-1": {"capacity": None, **endpoint}},
    )
    return LoadBoard(config, HealthBoard())


def report(
    board: LoadBoard,
    at: float,
    running: int | None,
    waiting: int | None = 0,
    kv: float | None = 0.1,
) -> None:
    sample = None
    if running is not None or waiting is not None or kv is not None:
        sample = LoadSample(dialect="vllm", running=running, waiting=waiting, kv_usage=kv)
    board.apply(engine_report(at, sample))


def engine_report(
    at: float, sample: LoadSample | None, capacity: int = 0, stated: int | None = None
) -> EndpointReport:
    return EndpointReport(
        stated_capacity=stated,
        endpoint="engine-1",
        provider="iris",
        pool="p",
        models=(MODEL,),
        healthy=True,
        sample=sample,
        capacity=capacity,
        scraped_at=at,
        scraper="test",
    )


def test_own_requests_count_from_grant_to_end_and_never_after():
    b = board()
    b.set_own("engine-1", 2, T)
    report(b, T + 0.01, running=2)  # the scrape sees exactly the gateway's two
    assert b.foreign("engine-1") == 0 and b.inflight("engine-1", T + 0.02) == 2
    b.set_own("engine-1", 0, T + 0.05)  # both end right after the scrape
    assert b.inflight("engine-1", T + 0.06) == 0  # no phantom until the next scrape


def test_what_the_engine_runs_beyond_the_gateways_requests_is_foreign_load():
    b = board()
    b.set_own("engine-1", 1, T)
    report(b, T + 1, running=5, waiting=2)  # 7 at the engine, 1 of them ours
    assert b.foreign("engine-1") == 6 and b.inflight("engine-1", T + 1.1) == 7
    report(b, T + 2, running=1, waiting=0)  # the other client went away
    assert b.foreign("engine-1") == 0


def test_a_request_that_ended_just_after_the_scrape_is_not_taken_for_foreign_load():
    b = board()
    b.set_own("engine-1", 3, T)
    b.set_own("engine-1", 0, T + 0.5 * FOREIGN_WINDOW)  # ended just after the scrape below
    report(b, T + 0.4 * FOREIGN_WINDOW, running=3)  # the report arrives after the ends
    assert b.foreign("engine-1") == 0


def test_a_long_running_request_is_never_counted_twice():
    b = board()
    b.set_own("engine-1", 1, T)
    report(b, T + 30, running=1)  # long after its grant: history of the grant trimmed
    assert b.foreign("engine-1") == 0 and b.inflight("engine-1", T + 30) == 1


def test_peers_live_leases_count_until_they_go_quiet():
    b = board()
    b.peer_load("admission-2", T, {"engine-1": 4}, T)
    assert b.inflight("engine-1", T + 1) == 4
    assert b.inflight("engine-1", T + PEER_FORGET_AFTER + 0.1) == 0


def test_capacity_starts_from_the_config_and_only_grows():
    b = board()
    assert b.capacity("engine-1") >= 1  # scoring.target_inflight by weight: never 0
    floor = b.capacity("engine-1")
    report(b, T, running=floor + 5)
    assert b.capacity("engine-1") == floor + 5
    report(b, T + 1, running=1)
    assert b.capacity("engine-1") == floor + 5


def test_an_engine_without_load_metrics_is_fresh_and_scored_by_the_gateways_count():
    b = board()
    capacity = b.capacity("engine-1")
    report(b, T, running=None, waiting=None, kv=None)  # answered /health, no load gauges
    assert b.saturation("engine-1", T + 1) == 0.0  # not stale: nothing black-holes the pool
    b.set_own("engine-1", capacity + 2, T + 1)
    assert b.saturation("engine-1", T + 1) == 2 / 4  # 2 queued over target_waiting 4
    assert b.metrics_mode("engine-1") == "none"


def test_a_scrape_that_shows_none_waiting_teaches_the_capacity_the_gateways_count():
    """Short requests end between scrapes, so the engine's running stays low; the gateway's own
    count at a scrape that found none waiting is what the engine ran at once."""
    b = board()
    floor = b.capacity("engine-1")
    b.set_own("engine-1", floor + 22, T)
    report(b, T + 0.5, running=3, waiting=0)
    assert b.capacity("engine-1") == floor + 22
    # Its capacity learned, a count past it is no queue while the engine reports none waiting.
    b.set_own("engine-1", 3 * floor + 66, T + 0.6)
    assert b.saturation("engine-1", T + 0.7) == 0.1 / 0.9  # KV usage alone
    report(b, T + 1, running=floor + 22, waiting=5)  # some wait: it runs floor + 22 at once
    assert b.saturation("engine-1", T + 1.01) == (2 * floor + 44) / 4


def test_requests_waiting_or_ours_arriving_after_the_scrape_teach_nothing():
    b = board()
    floor = b.capacity("engine-1")
    b.set_own("engine-1", floor + 20, T)
    report(b, T + 0.5, running=3, waiting=1)  # something waited: our count proves nothing
    assert b.capacity("engine-1") == floor
    b.set_own("engine-1", 0, T + 1)
    b.set_own("engine-1", floor + 20, T + 1.06)  # granted just after the scrape below
    report(b, T + 1.05, running=0, waiting=0)  # the report arrives after those grants
    assert b.capacity("engine-1") == floor


def test_a_capacity_the_engine_states_replaces_the_default_and_counts_what_exceeds_it():
    b = board()
    assert b.capacity("engine-1") == 8  # scoring.target_inflight, nothing stated
    b.apply(engine_report(T, LoadSample(dialect="llamacpp", running=0, waiting=0), 8, stated=4))
    assert b.capacity("engine-1") == 4  # llama.cpp's total_slots, below the default
    b.set_own("engine-1", 6, T + 0.5)
    assert b.saturation("engine-1", T + 0.5) == 2 / 4  # stated: 2 past its slots are queue
    b.set_own("engine-1", 20, T + 1)  # our count does not raise what the engine stated
    b.apply(engine_report(T + 1.01, LoadSample(dialect="llamacpp", running=4, waiting=0), 4, 4))
    assert b.capacity("engine-1") == 4


def test_a_configured_capacity_wins_over_the_engines_statement():
    b = board(capacity=16)
    b.apply(engine_report(T, LoadSample(dialect="tgi", running=0, waiting=0), 16, stated=128))
    assert b.capacity("engine-1") == 16
    b.set_own("engine-1", 18, T + 0.5)
    assert b.saturation("engine-1", T + 0.5) == 2 / 4


class SlowToStartKV(MemoryKV):
    """A bucket whose first read times out (JetStream not ready yet on a fresh cluster)."""

    def __init__(self) -> None:
        super().__init__()
        self.lists = 0

    async def list(self, prefix: str):  # type: ignore[no-untyped-def]
        self.lists += 1
        if self.lists == 1:
            raise TimeoutError
        return await super().list(prefix)


async def test_a_load_bucket_that_does_not_answer_at_start_is_followed_once_it_does():
    kv = SlowToStartKV()
    sample = LoadSample(dialect="vllm", running=3, waiting=0, kv_usage=0.1)
    stored = engine_report(time.time(), sample, capacity=8)
    await kv.put(report_key("engine-1"), stored.to_bytes())
    b = board()
    follower = LoadFollower(b, kv)
    await follower.start()  # the read timed out: the start goes on
    try:
        # The watch replays the stored report.
        await eventually(lambda: b.knows("engine-1"), 5, "the report on the board")
        assert b.capacity("engine-1") == 8
    finally:
        await follower.stop()


def test_the_window_an_engine_reported_is_kept_until_a_newer_report_says_another():
    b = board()
    assert b.window("engine-1") is None  # never reported: unknown (every request fits)
    b.apply(engine_report(T, None).model_copy(update={"context_window": 4096}))
    assert b.window("engine-1") == ContextWindow(4096)
    b.apply(engine_report(T + 1, None))  # a scrape that did not read it keeps it
    assert b.window("engine-1") == ContextWindow(4096)
    newer = {"context_window": 8192, "window_holds_output": False}
    b.apply(engine_report(T + 2, None).model_copy(update=newer))
    assert b.window("engine-1") == ContextWindow(8192, hold_output=False)
    b.apply(engine_report(T + 1.5, None).model_copy(update={"context_window": 1000}))
    assert b.window("engine-1") == ContextWindow(8192, hold_output=False)  # older: ignored


def test_a_capacity_configured_or_removed_live_is_stated_or_learned_from_then_on():
    def config(**endpoint: object):
        return rig_config(
            "nats://127.0.0.1:4222", "x", endpoints={"engine-1": {"capacity": None, **endpoint}}
        )

    b = LoadBoard(config(), HealthBoard())
    report(b, T, running=0, waiting=0)
    b.set_own("engine-1", 20, T + 0.5)
    assert b.saturation("engine-1", T + 0.5) == 0.1 / 0.9  # learned: none waiting, no queue
    b.reconfigure(config(capacity=16))
    assert (b.capacity("engine-1"), b.load("engine-1").stated) == (16, True)
    assert b.saturation("engine-1", T + 0.6) == 4 / 4  # 4 past the configured 16
    b.reconfigure(config())
    assert (b.capacity("engine-1"), b.load("engine-1").stated) == (8, False)
    assert b.saturation("engine-1", T + 0.7) == 0.1 / 0.9
