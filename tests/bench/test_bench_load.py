"""The load generator over real HTTP against the engine simulator: counts, TTFT/TPOT, sessions,
bands and keys, faults, open loop."""

from __future__ import annotations

import itertools
import re

import pytest
from bench_helpers import Recorder, StartEngine, bench, quick_engine

from llmgw.services.bench.distributions import Fixed
from llmgw.services.bench.stats import summarize
from llmgw.services.bench.workload import WeightedChoice
from llmgw.services.sim.params import EngineParams
from llmgw.serving import free_port

ITL = 0.002


async def test_streamed_run_counts_match_the_engine_and_ttft_tpot_are_sane(engine: StartEngine):
    sim = await engine(quick_engine())
    records = await bench(sim.url, concurrency=4, requests=40, output=Fixed(8))
    summary = summarize(records)
    assert summary["requests"] == summary["ok"] == 40 and summary["errors"] == {}
    assert sorted(r.index for r in records) == list(range(40))
    assert summary["tokens"]["output"] == 8 * 40 and summary["tokens"]["usage_reported"] == 40
    assert await sim.metric("vllm:generation_tokens_total") == 320
    assert await sim.metric("vllm:prompt_tokens_total") == summary["tokens"]["prompt"]
    for record in records:
        assert record.ok and record.stream and record.output_tokens == 8
        # The engine emits a token every ITL after a 1 ms prefill: the whole answer cannot
        # arrive sooner (a late first token on a busy host shortens the measured TPOT instead).
        assert 0.001 <= record.ttft < record.latency
        assert record.latency >= 0.001 + 7 * ITL * 0.95
        assert record.tpot > 0
        assert record.first_token + record.tpot * 7 == pytest.approx(record.end)
    assert summary["tpot_s"]["p50"] < ITL * 5  # a few ms of loop jitter at most
    assert summary["throughput"]["output_tokens_per_s"] == pytest.approx(
        summary["throughput"]["requests_per_s"] * 8
    )


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_non_streamed_run_takes_tokens_from_usage_and_has_no_ttft(
    engine: StartEngine, api: str
):
    sim = await engine(quick_engine())
    records = await bench(sim.url + "/v1", stream=False, api=api, requests=12, output=Fixed(5))
    summary = summarize(records)
    assert summary["ok"] == 12 and summary["tokens"]["output"] == 60
    assert summary["ttft_s"] is None and summary["tpot_s"] is None
    assert summary["latency_s"]["p50"] >= 5 * ITL * 0.9
    assert await sim.metric("vllm:request_success_total") == 12


async def test_streamed_completions_have_ttft(engine: StartEngine):
    sim = await engine(quick_engine())
    records = await bench(sim.url, api="completions", requests=8, output=Fixed(4))
    assert all(r.ok and r.ttft is not None and r.output_tokens == 4 for r in records)


async def test_prompt_sizes_reach_the_engine_as_requested(engine: StartEngine):
    sim = await engine(quick_engine())
    records = await bench(sim.url, requests=10, prompt=Fixed(300), stream=False)
    # 300 words and periods plus the simulator's chat template (12 tokens for one message).
    assert {r.prompt_tokens for r in records} == {312}


async def test_sessions_resend_history_and_hit_the_prefix_cache(engine: StartEngine):
    recorder = None

    def wrap(app):
        nonlocal recorder
        recorder = Recorder(app)
        return recorder

    sim = await engine(quick_engine(block_size=16), wrap=wrap)
    bands = WeightedChoice(("platinum", "bronze"), (1.0, 1.0))
    records = await bench(
        sim.url,
        concurrency=8,
        requests=24,
        prompt=Fixed(40),
        sessions=4,
        turns=Fixed(3),
        bands=bands,
        api_keys=("key-a", "key-b"),
    )
    assert summarize(records)["ok"] == 24
    by_session: dict[str, list] = {}
    for record in sorted(records, key=lambda r: r.index):
        by_session.setdefault(record.session_id, []).append(record)
    # 4 conversations at a time, each replaced by a new one after its 3 turns: in lockstep 8
    # conversations of 3 turns, but one that runs ahead starts the next sooner, and the 24th
    # request may then leave two conversations part-way (the replies' timing decides).
    assert sum(len(turns) for turns in by_session.values()) == 24
    assert sum(len(turns) == 3 for turns in by_session.values()) >= 6
    for turns in by_session.values():
        assert [r.turn for r in turns] == list(range(len(turns))) and len(turns) <= 3
        assert turns[0].cached_tokens == 0
        # each turn resends the previous prompt and reply, so the cache holds its head
        assert all(a.prompt_tokens < b.prompt_tokens for a, b in itertools.pairwise(turns))
        assert all(r.cached_tokens >= 16 for r in turns[1:])
    state = (await sim.get("/sim/state")).json()
    cached = sum(r.cached_tokens for r in records)
    assert state["prefix_cache_hits_total"] == cached > 0
    # what reached the engine: session, band and key headers, one conversation per session
    seen: dict[str, tuple[str, str]] = {}
    history: dict[str, list] = {}
    for request in recorder.requests:
        headers = request["headers"]
        session = headers["x-session-id"]
        identity = (headers["x-llmgw-band"], headers["authorization"])
        assert seen.setdefault(session, identity) == identity
        assert identity[0] in ("platinum", "bronze")
        assert identity[1] in ("Bearer key-a", "Bearer key-b")
        assert request["body"]["stream_options"] == {"include_usage": True}
        messages = request["body"]["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2) + [
            "user"
        ]
        # the replies resent are the engine's answers: 8 filler pieces (" word" or ".")
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert all(len(re.findall(r" \w+|\.", reply)) == 8 for reply in replies)
        history.setdefault(session, []).append(messages)
    assert set(seen) == set(by_session)
    for turns in history.values():  # each turn resends the previous one's messages unchanged
        assert all(b[: len(a)] == a for a, b in itertools.pairwise(turns))
    assert sorted(len(r["body"]["messages"]) for r in recorder.requests) == sorted(
        1 + 2 * r.turn for r in records
    )


async def test_errors_are_reported_by_status(engine: StartEngine):
    sim = await engine(quick_engine())
    await sim.faults(error_rate=0.25, rate_limit_rate=0.25)
    records = await bench(sim.url, requests=80)
    summary = summarize(records)
    served = await sim.metric("vllm:request_success_total")
    assert set(summary["errors"]) == {"500", "429"}
    assert summary["ok"] == served
    assert summary["ok"] + summary["errors"]["500"] + summary["errors"]["429"] == 80
    assert all(r.status == int(r.error_key) for r in records if not r.ok)
    assert "simulated" in summary["error_examples"]["500"]
    assert "Rate limit" in summary["error_examples"]["429"]


@pytest.mark.parametrize("stream", [True, False])
async def test_a_connection_cut_mid_response_is_incomplete(engine: StartEngine, stream: bool):
    sim = await engine(quick_engine())
    await sim.faults(die_at_token=3)
    records = await bench(sim.url, requests=6, stream=stream, output=Fixed(8))
    assert summarize(records)["errors"] == {"incomplete": 6}


async def test_an_unreachable_target_is_a_connection_error():
    records = await bench(f"http://127.0.0.1:{free_port()}", requests=3, concurrency=1)
    assert [r.error_key for r in records] == ["connection"] * 3


async def test_open_loop_spaces_arrivals_by_the_rate(engine: StartEngine):
    sim = await engine(EngineParams.zero_delay())
    records = await bench(sim.url, rate=100.0, concurrency=None, requests=20)
    starts = sorted(r.start for r in records)
    assert summarize(records)["ok"] == 20
    # fixed arrivals every 10 ms: the 20th starts 190 ms after the first, never sooner
    assert starts[-1] - starts[0] >= 0.19 - 0.002


async def test_a_duration_stops_sending_but_lets_requests_finish(engine: StartEngine):
    sim = await engine(quick_engine())
    records = await bench(sim.url, requests=None, duration=0.3, concurrency=2, output=Fixed(20))
    assert len(records) >= 2 and all(r.ok for r in records)
    first = min(r.start for r in records)
    assert max(r.start for r in records) - first < 0.3
    assert max(r.end for r in records) - first >= 0.3 - 0.05  # the last ones ran past it


async def test_ttft_waits_for_generated_text_not_the_first_chunk(engine: StartEngine):
    sim = await engine(quick_engine())
    # The role chunk (no text) comes at once, then the stream stalls before the first token.
    await sim.faults(stall_after_headers=0.15)
    records = await bench(sim.url, requests=4, concurrency=4, output=Fixed(3))
    assert all(r.ok and r.ttft >= 0.15 for r in records)
    assert all(r.tpot < 0.15 for r in records)
