"""The steps of an attempt at the edge (services/edge/attempts.py), each alone: admit (what is
asked of admission, the answer to a refusal), send (what goes upstream), classify (what an
upstream's answer other than 200 means, whether a failure is worth another endpoint), finish
(one RequestEnded per attempt however it ends, the lease's loss first), the retry decision
(`Tries`), and the frozen record of what an attempt uses of the edge (`AttemptDeps`).

Plain values, and the edge's port doubles (tests/edge/fakes.py) where an attempt holds a lease
and reports its end; the whole path runs over real HTTP in the other tests of this folder."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import FrozenInstanceError
from typing import Any

import httpx
import pytest
from fakes import FakeAdmission, FakeLeases, Queued, RecordingReporter, target
from hypothesis import given, settings
from hypothesis import strategies as st
from inproc import HeaderRecorder
from timing import eventually

from llmgw.config import config_from_dict
from llmgw.config.sections import Timeouts
from llmgw.core.ledger import LeaseKind, LeaseRecord
from llmgw.core.outcomes import Outcome, Refusal
from llmgw.core.requests import Feature, parse_request
from llmgw.services.edge.app import EdgeDeps, create_app
from llmgw.services.edge.attempts import (
    AttemptDeps,
    AttemptEnd,
    Failed,
    RoutedRequest,
    Tries,
    admit_request,
    answer_headers,
    classify,
    not_admitted,
    retryable,
    upstream_body,
    upstream_request,
)
from llmgw.services.edge.main import close_edge_deps
from llmgw.services.edge.metrics import EdgeMetrics
from llmgw.services.edge.telemetry import EdgeTelemetry, RequestRecord
from llmgw.services.edge.upstream import UpstreamFailure, new_pool
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import start_server
from llmgw.wire import AdmitReply, ContextExceeded, FailedAttempt, ReplyStatus, Target

ENGINE = target("iris", "engine-1", "http://127.0.0.1:9", "m1")
THIRD_PARTY = Target(
    provider="tensorx",
    provider_kind="unlimited",
    endpoint="tensorx-1",
    url="http://127.0.0.1:9",
    upstream_model="tx/m1",
)
CHAT = {"model": "m1", "max_tokens": 7, "messages": [{"role": "user", "content": "hi"}]}


def routed(body: dict[str, Any] | None = None) -> RoutedRequest:
    raw = json.dumps(body or CHAT).encode()
    record = RequestRecord("req-1", Feature.CHAT, time.perf_counter())
    return RoutedRequest(
        request_id="req-1",
        feature=Feature.CHAT,
        parsed=parse_request(Feature.CHAT, raw),
        raw=raw,
        model="m1",
        session="s-1",
        shard=3,
        band=None,
        tenant="acme",
        headers={"x-request-id": "req-1"},
        started=record.started,
        client_gone=None,
        record=record,
    )


def admitted(to: Target = ENGINE, **fields: Any) -> AdmitReply:
    now = time.time()
    lease = LeaseRecord(
        lease_id="lease-1",
        provider=to.provider,
        model="m1",
        kind=LeaseKind.TEMPORARY,
        unreserved=False,
        shard=3,
        edge="edge-test",
        granted_at=now,
        renewed_at=now,
        session="s-1",
        endpoint=to.endpoint,
    )
    return AdmitReply(id="a", status=ReplyStatus.ADMITTED, target=to, lease=lease, **fields)


def attempt_deps() -> AttemptDeps:
    metrics = EdgeMetrics()
    return AttemptDeps(
        edge_id="edge-test",
        admission=FakeAdmission(ENGINE),
        leases=FakeLeases(),
        reporter=RecordingReporter(),
        upstream=new_pool(Timeouts()),
        metrics=metrics,
        telemetry=EdgeTelemetry(metrics),
        spend=None,
        budgets=None,
        inject_usage=True,
        spend_header=False,
        retries={"m1": 1},
        timeouts={},
        default_timeouts=Timeouts(),
        provider_headers={},
    )


def failure(endpoint: str = "engine-1", exceeded: ContextExceeded | None = None) -> Failed:
    attempt = FailedAttempt(attempt="edge-test.0", endpoint=endpoint, outcome="upstream_error")
    answer = not_admitted(AdmitReply(id="x", status=ReplyStatus.REFUSED), routed(), None)[0]
    return Failed(answer, Outcome.UPSTREAM_ERROR, endpoint, "lease-1", attempt, exceeded)


# -- classify -----------------------------------------------------------------------------------

UNLOADED = json.dumps(
    {"error": {"message": "The model `m1` does not exist.", "type": "NotFoundError"}}
).encode()
TOO_LONG = json.dumps(
    {
        "error": {
            "message": "This model's maximum context length is 8192 tokens. However, your "
            "request has 8320 input tokens. Please reduce the length of the input messages.",
            "type": "BadRequestError",
            "code": 400,
        }
    }
).encode()
OPENAI_ERROR = json.dumps({"error": {"message": "key revoked", "type": "auth"}}).encode()


@pytest.mark.parametrize(
    ("status", "payload", "kind", "outcome", "client_status", "window"),
    [
        # a managed engine's 404 for a model the fleet lists there: another endpoint may serve it
        (404, UNLOADED, "managed", Outcome.MODEL_UNLOADED, 404, None),
        (404, UNLOADED, "unlimited", Outcome.BAD_REQUEST, 404, None),  # a third party's own 404
        (404, b'{"detail": "Not Found"}', "managed", Outcome.BAD_REQUEST, 404, None),  # a path
        # a managed engine's refusal of the request's length names its window
        (400, TOO_LONG, "managed", Outcome.CONTEXT_LENGTH_EXCEEDED, 400, 8192),
        (400, TOO_LONG, "unlimited", Outcome.BAD_REQUEST, 400, None),
        (422, b"{}", "managed", Outcome.BAD_REQUEST, 422, None),
        # the endpoint's failures: the gateway's error, 429 and 503 kept, any other a 502
        (429, OPENAI_ERROR, "managed", Outcome.UPSTREAM_ERROR, 429, None),
        (503, b"", "managed", Outcome.UPSTREAM_ERROR, 503, None),
        (500, b"", "unlimited", Outcome.UPSTREAM_ERROR, 502, None),
        (401, OPENAI_ERROR, "unlimited", Outcome.UPSTREAM_ERROR, 502, None),
        (403, OPENAI_ERROR, "managed", Outcome.UPSTREAM_ERROR, 502, None),
    ],
)
def test_classify_reads_an_answer_other_than_200(
    status: int,
    payload: bytes,
    kind: str,
    outcome: Outcome,
    client_status: int,
    window: int | None,
) -> None:
    verdict = classify(status, payload, "iris", kind)
    assert (verdict.outcome, verdict.status, verdict.window) == (outcome, client_status, window)
    if outcome is Outcome.UPSTREAM_ERROR:  # the gateway's own error, naming the upstream's
        assert verdict.rewritten
        error = json.loads(verdict.body)["error"]
        assert (error["type"], error["code"]) == ("upstream_error", "upstream_error")
        if payload == OPENAI_ERROR:
            assert error["message"].endswith("key revoked")
    else:  # the engine's own answer, as it sent it
        assert not verdict.rewritten and verdict.body is payload


def test_classify_names_the_provider_that_refused_the_gateway_s_credentials() -> None:
    message = json.loads(classify(401, OPENAI_ERROR, "tensorx", "unlimited").body)["error"]
    assert message["message"] == (
        "The provider 'tensorx' refused the gateway's credentials (401): key revoked"
    )
    assert (
        "credentials"
        not in json.loads(classify(500, OPENAI_ERROR, "tensorx", "x").body)["error"]["message"]
    )


@pytest.mark.parametrize(
    ("outcome", "status", "exceeded", "retried"),
    [
        (Outcome.UPSTREAM_UNREACHABLE, None, False, True),
        (Outcome.UPSTREAM_TIMEOUT, None, False, True),
        (Outcome.UPSTREAM_BROKEN_STREAM, 200, False, True),
        (Outcome.MODEL_UNLOADED, 404, False, True),
        (Outcome.UPSTREAM_ERROR, None, False, True),  # not HTTP at all
        (Outcome.UPSTREAM_ERROR, 502, False, True),
        (Outcome.UPSTREAM_ERROR, 429, False, True),
        (Outcome.UPSTREAM_ERROR, 401, False, True),  # the gateway's key, not the client's
        (Outcome.UPSTREAM_ERROR, 400, False, False),  # a stream's error event judged the request
        (Outcome.CONTEXT_LENGTH_EXCEEDED, 400, True, True),
        (Outcome.CONTEXT_LENGTH_EXCEEDED, 400, False, False),
        (Outcome.BAD_REQUEST, 400, False, False),
        (Outcome.INTERNAL_ERROR, None, False, False),
    ],
)
def test_retryable_is_the_endpoint_s_failure_or_a_length_refusal(
    outcome: Outcome, status: int | None, exceeded: bool, retried: bool
) -> None:
    assert retryable(outcome, status, exceeded) is retried


# -- the retry decision -------------------------------------------------------------------------


def test_tries_follow_failures_up_to_the_profile_s_retries() -> None:
    tries = Tries("edge-test.4", retries=1)
    assert (tries.attempt_id, tries.excluded, tries.previous, tries.earlier()) == (
        "edge-test.4",
        (),
        None,
        None,
    )
    first = failure("engine-1")
    assert tries.failed(first)
    assert (tries.attempt_id, tries.excluded, tries.previous) == (
        "edge-test.4-1",
        ("engine-1",),
        first,
    )
    assert tries.earlier() == (first.response, first.outcome)
    assert not tries.failed(failure("engine-2"))  # its one retry is spent
    assert tries.excluded == ("engine-1",) and tries.previous is first


def test_a_length_refusal_is_retried_once_beside_the_retries() -> None:
    exceeded = ContextExceeded(endpoint="engine-1", model="m1", window=8192)
    tries = Tries("e.0", retries=0)
    assert tries.failed(failure("engine-1", exceeded))
    assert tries.exceeded == exceeded and tries.attempt_id == "e.0-1"
    assert not tries.failed(failure("engine-2", exceeded))  # once
    tries = Tries("e.0", retries=0)
    assert tries.failed(failure("engine-1", exceeded))
    assert not tries.failed(failure("engine-2"))  # retries 0: no endpoint failure is retried


# -- admit --------------------------------------------------------------------------------------


def test_admit_request_names_the_failed_attempt_it_retries() -> None:
    request = routed()
    tries = Tries("edge-test.0", retries=2)
    first = admit_request("edge-test", request, tries, (), no_overflow=False)
    assert (first.id, first.edge, first.model, first.feature) == (
        "edge-test.0",
        "edge-test",
        "m1",
        "chat",
    )
    assert (first.session, first.shard, first.tenant, first.max_output) == ("s-1", 3, "acme", 7)
    assert first.retry_of is None and first.failed is None and first.exclude == ()
    failed = failure("engine-1")
    tries.failed(failed)
    again = admit_request("edge-test", request, tries, ("engine-1", "tensorx-1"), no_overflow=True)
    assert (again.id, again.retry_of, again.failed) == ("edge-test.0-1", "lease-1", failed.failed)
    assert again.exclude == ("engine-1", "tensorx-1") and again.no_overflow


@pytest.mark.parametrize(
    ("refusal", "status", "outcome", "param"),
    [
        (Refusal.QUEUE_FULL, 429, Outcome.QUEUE_FULL, None),
        (Refusal.UNKNOWN_MODEL, 404, Outcome.MODEL_NOT_FOUND, "model"),
        (Refusal.CONTEXT_LENGTH_EXCEEDED, 400, Outcome.CONTEXT_LENGTH_EXCEEDED, "messages"),
        (None, 503, Outcome.NO_CAPACITY, None),
    ],
)
def test_a_refusal_is_the_client_s_answer(
    refusal: Refusal | None, status: int, outcome: Outcome, param: str | None
) -> None:
    reply = AdmitReply(
        id="a", status=ReplyStatus.REFUSED, refusal=refusal, message="no", retry_after=3
    )
    response, got = not_admitted(reply, routed(), None)
    assert (response.status_code, got) == (status, outcome)
    error = json.loads(bytes(response.body))["error"]
    assert error["param"] == param and error["message"] == "no"
    assert response.headers["x-request-id"] == "req-1"


def test_a_retry_refused_for_capacity_answers_the_failure_it_followed() -> None:
    previous = failure()
    no_capacity = AdmitReply(id="a", status=ReplyStatus.REFUSED, refusal=Refusal.NO_CAPACITY)
    assert not_admitted(no_capacity, routed(), previous) == (previous.response, previous.outcome)
    # a refusal of the request itself is its own answer, retry or not
    too_long = AdmitReply(
        id="a", status=ReplyStatus.REFUSED, refusal=Refusal.CONTEXT_LENGTH_EXCEEDED
    )
    assert not_admitted(too_long, routed(), previous)[1] is Outcome.CONTEXT_LENGTH_EXCEEDED
    cancelled = AdmitReply(id="a", status=ReplyStatus.REFUSED, refusal=Refusal.CANCELLED)
    response, outcome = not_admitted(cancelled, routed(), previous)
    assert (response.status_code, outcome) == (499, Outcome.CLIENT_DISCONNECTED)


# -- send ---------------------------------------------------------------------------------------


def test_the_client_s_bytes_go_upstream_unless_something_must_change() -> None:
    request = routed({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert upstream_body(request.parsed, request.raw, ENGINE, inject_usage=False) is request.raw


def test_an_openai_request_goes_to_its_api_s_path() -> None:
    request = routed()
    assert upstream_request(request, ENGINE, False) == ("/v1/chat/completions", request.raw)


def test_the_body_sent_names_the_target_s_model_priority_and_usage() -> None:
    request = routed({**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": 1}})
    priority = Target(**{**ENGINE.model_dump(), "priority": -5})
    sent = json.loads(upstream_body(request.parsed, request.raw, priority, inject_usage=True))
    assert sent["priority"] == -5 and sent["model"] == "m1"
    assert sent["stream_options"] == {"continuous_usage_stats": 1, "include_usage": True}
    assert request.parsed.body["stream_options"] == {"continuous_usage_stats": 1}  # untouched
    renamed = json.loads(upstream_body(request.parsed, request.raw, THIRD_PARTY, False))
    assert renamed == {**request.parsed.body, "model": "tx/m1"}


_FIELD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=5), st.lists(st.integers())
)


@settings(max_examples=200, deadline=None)
@given(
    extra=st.dictionaries(
        st.sampled_from(["stream_options", "priority", "metadata", "x", "y"]),
        _FIELD_VALUES,
        max_size=4,
    ),
    layout=st.sampled_from([{}, {"indent": 2}, {"separators": (",", ":")}]),
    trailing=st.sampled_from(["", "\n", " \r\n "]),
    inject_usage=st.booleans(),
    priority=st.sampled_from([None, -5, 3]),
    renamed=st.booleans(),
)
def test_the_body_sent_is_the_clients_with_what_the_target_needs_changed(
    extra, layout, trailing, inject_usage, priority, renamed
) -> None:
    """The body sent decodes to the client's with the target's model, its priority and the
    stream's request for usage, whether those were added to the client's bytes or the body
    was encoded anew."""
    if isinstance(extra.get("stream_options"), (bool, int, str, list)):
        extra["stream_options"] = {"continuous_usage_stats": True}  # an object, as parsed
    body = {**CHAT, "stream": True, **extra}
    raw = (json.dumps(body, **layout) + trailing).encode()
    parsed = parse_request(Feature.CHAT, raw)
    goal = Target(
        **{
            **(THIRD_PARTY if renamed else ENGINE).model_dump(),
            "priority": priority,
        }
    )
    sent = json.loads(upstream_body(parsed, raw, goal, inject_usage))
    expected = {**body, "model": goal.upstream_model}
    if inject_usage:
        expected["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    if priority is not None:
        expected["priority"] = priority
    assert sent == expected
    assert parsed.body == body  # untouched


def test_the_answer_says_where_the_attempt_ran() -> None:
    reply = admitted(THIRD_PARTY, route="overflow", served_model="m1-large")
    assert answer_headers(routed(), reply) == {
        "x-request-id": "req-1",
        "x-llmgw-route": "overflow",
        "x-llmgw-fallback-from": "m1",
        "x-llmgw-provider": "tensorx",
        "x-llmgw-endpoint": "tensorx-1",
    }
    assert "x-llmgw-fallback-from" not in answer_headers(routed(), admitted(served_model="m1"))


# -- finish -------------------------------------------------------------------------------------


def ending(deps: AttemptDeps, reply: AdmitReply | None = None) -> AttemptEnd:
    request = routed()
    admit = admit_request(deps.edge_id, request, Tries("edge-test.0", 1), (), False)
    return AttemptEnd(deps, request, admit, reply or admitted())


def test_an_attempt_ends_once_and_reports_its_end() -> None:
    deps = attempt_deps()
    end = ending(deps)
    assert isinstance(deps.leases, FakeLeases) and isinstance(deps.reporter, RecordingReporter)
    assert list(deps.leases.held) == ["lease-1"]
    end.upstream_started = time.perf_counter()
    end.status = 200
    end.finish(Outcome.SUCCESS)
    end.finish(Outcome.UPSTREAM_ERROR)  # once: the second is nothing
    [report] = deps.reporter.ended
    assert (report.id, report.lease, report.outcome, report.ok) == (
        "edge-test.0",
        "lease-1",
        "success",
        True,
    )
    assert (report.provider, report.endpoint, report.sent, report.shard) == (
        "iris",
        "engine-1",
        True,
        3,
    )
    assert deps.leases.held == {} and [h.record.lease_id for h in deps.leases.ended] == ["lease-1"]
    assert end.routed.record.endpoint == "engine-1"


def test_a_failure_is_retried_with_what_the_breakers_learn() -> None:
    deps = attempt_deps()
    end = ending(deps)
    end.upstream_started = time.perf_counter()
    refused = UpstreamFailure(Outcome.UPSTREAM_UNREACHABLE, "refused", refused=True)
    result = end.upstream_failed(refused, {"x-request-id": "req-1"})
    assert isinstance(result, Failed)
    assert (result.endpoint, result.lease, result.outcome) == (
        "engine-1",
        "lease-1",
        Outcome.UPSTREAM_UNREACHABLE,
    )
    assert result.failed == FailedAttempt(
        attempt="edge-test.0", endpoint="engine-1", outcome="upstream_unreachable", refused=True
    )
    assert result.response.status_code == 502
    [report] = deps.reporter.ended
    assert report.refused and report.outcome == "upstream_unreachable" and not report.ok


def test_a_stream_s_error_event_that_judges_the_request_is_the_client_s_answer() -> None:
    deps = attempt_deps()
    end = ending(deps)
    event = UpstreamFailure(Outcome.UPSTREAM_ERROR, "bad tool schema", 400)
    response, outcome = end.upstream_failed(event, {})  # not a Failed: no retry
    assert outcome is Outcome.UPSTREAM_ERROR and response.status_code == 502
    assert deps.reporter.ended[0].status == 400


def test_a_lost_lease_decides_the_outcome_before_anything_else() -> None:
    deps = attempt_deps()
    end = ending(deps)
    end.upstream_started = time.perf_counter()
    assert end.hold is not None
    end.hold.lose()  # type: ignore[attr-defined]  # FakeHold: what the store does
    response, outcome = end.failed(Outcome.UPSTREAM_UNREACHABLE, "reset", {})
    assert outcome is Outcome.LEASE_LOST and response.status_code == 503
    [report] = deps.reporter.ended
    # never released (the owner expired it), never a breaker's input
    assert report.lease is None and not report.sent and report.outcome == "lease_lost"


def test_a_drain_that_cut_the_attempt_short_is_no_endpoint_s_failure() -> None:
    deps = attempt_deps()
    end = ending(deps)
    assert end.hold is not None
    end.hold.cut()  # type: ignore[attr-defined]
    assert end.stopped()
    response, outcome = end.failed(Outcome.UPSTREAM_UNREACHABLE, "", {})
    assert outcome is Outcome.SHUTTING_DOWN and response.status_code == 503
    assert deps.reporter.ended[0].outcome == "shutting_down"


# -- the record of what an attempt uses of the edge ---------------------------------------------


async def test_the_edge_gives_its_attempts_a_new_record_for_each_config_it_follows(
    make_gateway_config: Any,
) -> None:
    urls = {name: "http://127.0.0.1:9" for name in ("engine-1", "engine-2", "tensorx-1")}
    config = make_gateway_config("nats://127.0.0.1:9", urls)
    deps = EdgeDeps(
        admission=FakeAdmission(ENGINE),
        leases=FakeLeases(),
        reporter=RecordingReporter(),
        upstream=new_pool(config.timeouts),
        metrics=EdgeMetrics(),
        edge_id="edge-test",
    )
    edge = create_app(config, deps).edge
    try:
        first = edge.attempts.deps
        assert (first.edge_id, first.admission, first.leases) == (
            "edge-test",
            deps.admission,
            deps.leases,
        )
        assert first.retries["m1"] == config.router.retries
        with pytest.raises(FrozenInstanceError):
            first.retries = {}  # type: ignore[misc]
        timeouts = {**config.timeouts.model_dump(), "total": 20.0}
        follow = make_gateway_config(
            "nats://127.0.0.1:9", urls, router={"retries": 5}, timeouts=timeouts
        )
        edge.follow_config(follow)
        now = edge.attempts.deps
        assert now is not first and first.retries["m1"] == config.router.retries
        assert now.retries["m1"] == 5 and now.timeouts_for("m1").total == 20.0
        assert edge.timeouts_for("m1").total == 20.0
        assert now.provider_headers is edge.upstream_headers
    finally:
        await edge.prompts.aclose()


async def test_an_attempt_is_sent_on_the_config_current_once_it_is_admitted(
    make_gateway_config: Any, tmp_path: Any
) -> None:
    """A request that waited in admission's queue while the edge followed a new config (here its
    provider's key file, rotated) is sent on the new one: what an attempt uses of the config is
    read once it is admitted, not when the request began."""
    recorder = HeaderRecorder(create_engine_app(EngineParams.zero_delay(), ["m1", "m2"]))
    engine = await start_server(recorder)
    key = tmp_path / "iris.key"
    key.write_text("key-before\n")
    nowhere = "http://127.0.0.1:9"
    urls = {"engine-1": engine.url, "engine-2": nowhere, "tensorx-1": nowhere}
    data = make_gateway_config("nats://127.0.0.1:9", urls).model_dump(
        mode="json", exclude_unset=True
    )
    data["providers"][0]["api_key_file"] = str(key)  # iris
    config = config_from_dict(data, source="<test>", env={})
    queued = Queued(target("iris", "engine-1", engine.url, "m1"))
    admission = FakeAdmission(queued)
    deps = EdgeDeps(
        admission=admission,
        leases=FakeLeases(),
        reporter=RecordingReporter(),
        upstream=new_pool(config.timeouts),
        metrics=EdgeMetrics(),
        edge_id="edge-test",
    )
    app = create_app(config, deps)
    server = await start_server(app)
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            asking = asyncio.create_task(http.post(server.url + "/v1/chat/completions", json=CHAT))
            await eventually(lambda: admission.asked)  # queued
            key.write_text("key-after\n")
            app.edge.follow_config(config_from_dict(data, source="<test>", env={}))
            queued.release.set()
            response = await asking
        assert response.status_code == 200, response.text
        [sent] = recorder.seen
        assert sent["authorization"] == "Bearer key-after"
    finally:
        await server.stop()
        await engine.stop()
        await close_edge_deps(deps)
