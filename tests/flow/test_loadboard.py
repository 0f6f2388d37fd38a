"""The load board's inflight estimate: engine numbers at the last scrape, corrected in between."""

from __future__ import annotations

from rig import MODEL, rig_config

from llmgw.load import EndpointReport, LoadSample
from llmgw.services.admission.health import HealthBoard
from llmgw.services.admission.loadboard import LoadBoard

T = 1_000_000.0


def board_with_sample(running: int, waiting: int = 0, at: float = T) -> LoadBoard:
    config = rig_config("nats://127.0.0.1:4222", "x", router={"scrape_interval": "400ms"})
    board = LoadBoard(config, HealthBoard())
    board.apply(
        EndpointReport(
            endpoint="engine-1",
            provider="iris",
            pool="p",
            models=(MODEL,),
            healthy=True,
            sample=LoadSample(dialect="vllm", running=running, waiting=waiting, kv_usage=0.1),
            capacity=8,
            scraped_at=at,
            scraper="test",
        )
    )
    return board


def test_grants_count_until_they_end_or_a_later_scrape_shows_them():
    board = board_with_sample(running=3)
    assert board.visibility_margin == 0.1  # a quarter of the scrape interval
    board.record_grant("engine-1", T + 0.01)
    board.record_grant("engine-1", T + 0.02)
    assert board.inflight("engine-1", T + 0.03) == 5
    board.request_ended("engine-1", T + 0.01, T + 0.05)  # short: ended before any scrape
    assert board.inflight("engine-1", T + 0.06) == 4
    board.apply(
        EndpointReport(
            endpoint="engine-1",
            provider="iris",
            pool="p",
            models=(MODEL,),
            healthy=True,
            sample=LoadSample(dialect="vllm", running=4, waiting=0, kv_usage=0.1),
            capacity=8,
            scraped_at=T + 0.2,
            scraper="test",
        )
    )
    assert board.inflight("engine-1", T + 0.21) == 4  # the grant at +0.02 is in the sample now


def test_a_request_the_last_scrape_saw_frees_its_place_when_it_ends():
    board = board_with_sample(running=6, waiting=1, at=T)
    board.request_ended("engine-1", T - 5, T + 0.3)  # running at the scrape, ended after it
    board.request_ended("engine-1", T - 5, T + 0.3)
    assert board.inflight("engine-1", T + 0.31) == 5
    board.request_ended("engine-1", T - 5, T - 0.1)  # ended before the scrape: not in it
    board.request_ended("engine-1", T - 0.05, T + 0.3)  # too recent to be trusted in it
    assert board.inflight("engine-1", T + 0.31) == 5
    for _ in range(10):  # never below zero, whatever arrives
        board.request_ended("engine-1", T - 5, T + 0.3)
    assert board.inflight("engine-1", T + 0.31) == 0


def test_a_new_scrape_replaces_the_corrections():
    board = board_with_sample(running=6, at=T)
    board.request_ended("engine-1", T - 5, T + 0.3)
    board.apply(
        EndpointReport(
            endpoint="engine-1",
            provider="iris",
            pool="p",
            models=(MODEL,),
            healthy=True,
            sample=LoadSample(dialect="vllm", running=5, waiting=0, kv_usage=0.1),
            capacity=8,
            scraped_at=T + 0.4,
            scraper="test",
        )
    )
    assert board.inflight("engine-1", T + 0.41) == 5
