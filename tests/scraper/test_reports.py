"""The scraper's pure decisions: what a scrape means, what it reports, and the wire additions."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.config import load_config
from llmgw.core.engine_metrics import EngineDialect, EngineSample
from llmgw.core.saturation import EndpointLoad, SaturationSettings
from llmgw.load import (
    EndpointReport,
    PoolReport,
    endpoint_event_subject,
    pool_event_subject,
)
from llmgw.services.scraper.reports import (
    ERROR_TEXT_LIMIT,
    Fetched,
    ScrapeOutcome,
    ScrapeTarget,
    build_report,
    classify,
    failed_report,
    health_event_verb,
    health_verdict,
    known_capacities,
    pool_reports,
    read_sample,
    scrape_targets,
)

REPO = Path(__file__).resolve().parents[2]
SETTINGS = SaturationSettings(target_waiting=4, kv_ceiling=0.8, stale_after=10)
TARGET = ScrapeTarget("e1", "iris", "gpu", ("m1", "m2"), "http://127.0.0.1:1")
OK_HEALTH = Fetched(status=200, body="ok")


def vllm_metrics(running: int, waiting: int, kv: float) -> Fetched:
    return Fetched(
        status=200,
        body=(
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m1"}} {running}.0\n'
            f'vllm:num_requests_waiting{{model_name="m1"}} {waiting}.0\n'
            f'vllm:kv_cache_usage_perc{{model_name="m1"}} {kv}\n'
        ),
    )


def report_at(
    load: EndpointLoad,
    metrics: Fetched,
    at: float,
    health: Fetched = OK_HEALTH,
    now: float | None = None,
) -> tuple[EndpointReport, EndpointLoad, ScrapeOutcome]:
    return build_report(
        TARGET,
        health,
        metrics,
        load,
        scraped_at=at,
        now=at if now is None else now,
        settings=SETTINGS,
        scraper="s1",
    )


@pytest.mark.parametrize(
    ("health", "verdict"),
    [
        (Fetched(status=200), (True, None)),
        (Fetched(status=503, body="unhealthy"), (False, "HTTP 503")),
        (Fetched(error="ConnectError: refused"), (False, "ConnectError: refused")),
        (Fetched(), (False, "no answer")),
    ],
    ids=["200", "503", "refused", "no-error-text"],
)
def test_healthy_means_health_answered_200(health: Fetched, verdict: tuple) -> None:
    assert health_verdict(health) == verdict


def test_a_vllm_exposition_gives_the_engines_load() -> None:
    sample, mode, error = read_sample(vllm_metrics(3, 2, 0.25))
    assert (mode, error) == ("full", None)
    assert sample == EngineSample(EngineDialect.VLLM, running=3, waiting=2, kv_usage=0.25)


@pytest.mark.parametrize(
    ("metrics", "mode", "error_part"),
    [
        (Fetched(status=500, body="oops"), "error", "HTTP 500"),
        (
            Fetched(status=200, body='vllm:num_requests_running{model_name="m1 3\n'),
            "error",
            "line 1",
        ),
        (Fetched(error="no answer within 1s", timed_out=True), "error", "no answer within 1s"),
        (Fetched(status=404, body="not found"), "none", None),  # no /metrics: not an error
        (Fetched(status=501, body="Start it with `--metrics`"), "none", None),  # llama.cpp
        (Fetched(status=200, body="up 1\n"), "none", None),  # no load gauges: not an error
    ],
    ids=[
        "http-error",
        "malformed",
        "timeout",
        "no-metrics-route",
        "llamacpp-without-metrics",
        "not-an-engine",
    ],
)
def test_metrics_without_a_sample_say_why(metrics: Fetched, mode: str, error_part) -> None:
    sample, got_mode, error = read_sample(metrics)
    assert sample is None and got_mode == mode
    if error_part is None:
        assert error is None
    else:
        assert error is not None and error_part in error


def test_partial_metrics_give_a_partial_sample() -> None:
    sample, mode, error = read_sample(
        Fetched(status=200, body="vllm:num_requests_running 3\nvllm:num_requests_waiting 1\n")
    )
    assert (mode, error) == ("partial", None)
    assert sample is not None and sample.kv_usage is None and sample.missing == ("kv_usage",)


def test_error_texts_are_bounded() -> None:
    huge = "ReadError: " + "x" * 10_000
    sample, _, error = read_sample(Fetched(error=huge))
    assert sample is None and error is not None and len(error) == ERROR_TEXT_LIMIT
    assert health_verdict(Fetched(error=huge)) == (False, error)


@pytest.mark.parametrize(
    ("health", "metrics", "outcome"),
    [
        (OK_HEALTH, vllm_metrics(1, 0, 0.1), ScrapeOutcome.OK),
        (OK_HEALTH, Fetched(status=500), ScrapeOutcome.METRICS_ERROR),
        (Fetched(status=503), vllm_metrics(1, 0, 0.1), ScrapeOutcome.UNHEALTHY),
        (
            Fetched(error="timeout", timed_out=True),
            vllm_metrics(1, 0, 0.1),
            ScrapeOutcome.UNHEALTHY,
        ),
        (Fetched(error="refused"), Fetched(error="refused"), ScrapeOutcome.UNREACHABLE),
        (Fetched(error="refused"), Fetched(error="slow", timed_out=True), ScrapeOutcome.TIMEOUT),
        (OK_HEALTH, Fetched(status=404), ScrapeOutcome.NO_METRICS),
    ],
    ids=[
        "ok",
        "metrics-error",
        "unhealthy",
        "health-timeout",
        "unreachable",
        "timeout",
        "no-metrics",
    ],
)
def test_outcome_precedence(health: Fetched, metrics: Fetched, outcome: ScrapeOutcome) -> None:
    healthy, _ = health_verdict(health)
    _, mode, _ = read_sample(metrics)
    assert classify(health, metrics, healthy=healthy, mode=mode) is outcome


def test_report_learns_capacity_as_the_high_water_mark_of_running() -> None:
    load = EndpointLoad()
    capacities = []
    for at, running in enumerate([2, 8, 5, 0]):
        report, load, outcome = report_at(load, vllm_metrics(running, 0, 0.1), float(at))
        capacities.append(report.capacity)
        assert outcome is ScrapeOutcome.OK
    assert capacities == [2, 8, 8, 8]
    assert report.sample is not None and report.sample.running == 0
    assert report.models == ("m1", "m2") and report.pool == "gpu" and report.scraper == "s1"


def test_saturation_is_the_worse_of_queue_and_kv() -> None:
    report, _, _ = report_at(EndpointLoad(), vllm_metrics(4, 2, 0.2), 0.0)
    assert report.saturation == pytest.approx(0.5)  # queue 2 / 4 beats kv 0.2 / 0.8
    report, _, _ = report_at(EndpointLoad(), vllm_metrics(4, 1, 0.72), 0.0)
    assert report.saturation == pytest.approx(0.9)  # kv 0.72 / 0.8 beats queue 1 / 4


def test_failed_metrics_drop_the_last_reading_but_keep_the_capacity() -> None:
    """A metrics read that fails is no evidence of load: the endpoint answered, so it is
    reported fresh, on the gateway's own accounting, never as saturated."""
    _, load, _ = report_at(EndpointLoad(), vllm_metrics(3, 5, 0.95), 100.0)
    assert load.sample is not None
    report, after, outcome = report_at(load, Fetched(status=500), 105.0)
    assert outcome is ScrapeOutcome.METRICS_ERROR
    assert report.sample is None and report.metrics_error == "HTTP 500"
    assert report.healthy and report.metrics == "error"
    assert (after.capacity, after.sample, after.sampled_at, after.reported_at) == (
        3,
        None,
        None,
        105.0,
    )
    assert report.capacity == 3
    assert report.saturation == 0.0  # not the last reading's 0.95 / 0.8


def test_a_fault_in_reading_a_scrape_reports_a_metrics_error_not_saturation() -> None:
    _, load, _ = report_at(EndpointLoad(), vllm_metrics(3, 5, 0.95), 100.0)
    report, after, outcome = failed_report(
        TARGET,
        OK_HEALTH,
        load,
        "scraper error: KeyError: 'x'",
        scraped_at=105.0,
        now=105.0,
        settings=SETTINGS,
        scraper="s1",
    )
    assert outcome is ScrapeOutcome.METRICS_ERROR
    assert report.healthy and report.metrics == "error" and report.sample is None
    assert report.metrics_error == "scraper error: KeyError: 'x'"
    assert report.saturation == 0.0 and after.capacity == 3 and after.reported_at == 105.0


def test_an_endpoint_unread_for_stale_after_scores_saturated_but_is_still_reported() -> None:
    _, load, _ = report_at(EndpointLoad(), vllm_metrics(3, 0, 0.1), 100.0)
    unreachable = Fetched(error="ConnectError")
    report, _, outcome = report_at(load, unreachable, 111.0, health=unreachable)
    assert outcome is ScrapeOutcome.UNREACHABLE
    assert not report.healthy and report.sample is None
    assert report.saturation == 1.0
    never, _, _ = report_at(EndpointLoad(), unreachable, 0.0, health=unreachable)
    assert never.saturation == 1.0 and never.capacity == 0


def test_wire_payload_round_trips() -> None:
    report, _, _ = report_at(EndpointLoad(), vllm_metrics(3, 1, 0.5), 12.5)
    assert EndpointReport.model_validate_json(report.to_bytes()) == report


@pytest.mark.parametrize(
    ("previous", "healthy", "verb"),
    [
        (None, True, "healthy"),
        (None, False, "unhealthy"),
        (True, True, None),
        (False, False, None),
        (True, False, "unhealthy"),
        (False, True, "healthy"),
    ],
    ids=[
        "first-healthy",
        "first-unhealthy",
        "still-healthy",
        "still-unhealthy",
        "fell",
        "recovered",
    ],
)
def test_health_events_on_transitions_and_on_the_first_verdict(
    previous: bool | None, healthy: bool, verb: str | None
) -> None:
    assert health_event_verb(previous, healthy) == verb


def test_pool_reports_group_by_provider_and_pool_and_average() -> None:
    targets = [
        ScrapeTarget("a1", "iris", "gpu", ("m1",), "http://a1"),
        ScrapeTarget("b1", "iris", "cpu", ("m1",), "http://b1"),
        ScrapeTarget("a2", "iris", "gpu", ("m1",), "http://a2"),
        ScrapeTarget("c1", "other", "gpu", ("m1",), "http://c1"),
    ]
    now = 50.0
    fresh = EngineSample(EngineDialect.VLLM, running=4, waiting=2, kv_usage=0.0)
    loads = {
        "a1": EndpointLoad(4, fresh, now - 1),  # saturation 2 / 4 = 0.5
        "a2": EndpointLoad(4, fresh, now - 30),  # stale: max(1.0, 0.5)
        "b1": EndpointLoad(),  # never sampled
        # c1 absent: counts as never sampled and not healthy
    }
    healthy = {"a1": True, "a2": False, "b1": True}
    reports = pool_reports(targets, loads, healthy, now=now, settings=SETTINGS, scraper="s1")
    by_key = {(r.provider, r.pool): r for r in reports}
    assert list(by_key) == [("iris", "gpu"), ("iris", "cpu"), ("other", "gpu")]
    gpu = by_key["iris", "gpu"]
    assert gpu.endpoints == ("a1", "a2") and gpu.healthy == ("a1",) and gpu.stale == ("a2",)
    assert gpu.saturation == pytest.approx(0.75)
    assert by_key["iris", "cpu"].saturation == 1.0 and by_key["iris", "cpu"].stale == ("b1",)
    other = by_key["other", "gpu"]
    assert other.healthy == () and other.stale == ("c1",) and other.measured_at == now
    assert PoolReport.model_validate_json(gpu.to_bytes()) == gpu


def test_only_endpoints_of_managed_providers_are_scraped() -> None:
    config = load_config(REPO / "config" / "local.yaml", env={})
    targets = scrape_targets(config)
    assert [t.endpoint for t in targets] == ["engine-1", "engine-2"]
    assert targets[0] == ScrapeTarget(
        "engine-1",
        "iris",
        "local/sim-gpu",
        ("llama-3.3-70b", "qwen2.5-32b"),
        "http://127.0.0.1:8101",
        ("llama-3.3-70b", "qwen2.5-32b"),  # the names its engine serves them under
        configured=True,  # its simulate block's max_num_seqs
    )


def test_subjects() -> None:
    assert pool_event_subject("measured", "iris") == "llmgw.v1.events.pool.measured.iris"
    assert endpoint_event_subject("unhealthy", "iris") == "llmgw.v1.events.endpoint.unhealthy.iris"
    with pytest.raises(ValueError, match="unknown pool event verb"):
        pool_event_subject("scraped", "iris")


def test_known_capacities_keep_the_largest_per_endpoint() -> None:
    a, _, _ = report_at(EndpointLoad(5), vllm_metrics(1, 0, 0.0), 1.0)
    b, _, _ = report_at(EndpointLoad(2), vllm_metrics(1, 0, 0.0), 2.0)
    assert known_capacities([a, b]) == {"e1": 5}
