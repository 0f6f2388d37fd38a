"""Workload generation: prompt sizes, conversations that resend their history, arrivals."""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.services.bench.distributions import Fixed, Uniform
from llmgw.services.bench.workload import (
    WORDS,
    Conversations,
    Message,
    WeightedChoice,
    WorkloadSpec,
    arrival_times,
    completion_prompt,
    prompt_text,
)
from llmgw.services.sim.tokenizer import token_ids


def spec(**overrides) -> WorkloadSpec:
    values = {"prompt_tokens": Fixed(20), "output_tokens": Fixed(8), "run_id": "t"}
    return WorkloadSpec(**{**values, **overrides})


def test_words_are_distinct_short_lower_case_words():
    assert len(set(WORDS)) == len(WORDS) >= 100
    assert all(word.isalpha() and word.islower() and 2 <= len(word) <= 4 for word in WORDS)


@given(st.integers(1, 3000), st.integers(0, 2**32))
@settings(max_examples=60)
def test_prompt_text_is_the_requested_number_of_simulator_tokens(tokens, seed):
    text = prompt_text(random.Random(seed), tokens)
    assert len(token_ids(text)) == tokens


def test_prompt_text_is_about_four_and_a_half_characters_per_token():
    text = prompt_text(random.Random(3), 2000)
    assert 4.0 <= len(text) / 2000 <= 5.0
    assert text.count(".") == 2000 // 12


def test_without_sessions_every_request_is_a_fresh_single_message():
    conversations = Conversations(spec(output_tokens=Uniform(1, 9)), random.Random(1))
    plans = [conversations.next_request() for _ in range(20)]
    assert [p.index for p in plans] == list(range(20))
    assert all(p.session_id is None and p.turn == 0 and len(p.messages) == 1 for p in plans)
    assert all(p.messages[0].role == "user" for p in plans)
    assert len({p.messages[0].content for p in plans}) == 20
    assert all(1 <= p.max_tokens <= 9 for p in plans)
    assert conversations.in_flight == 20


def test_a_conversation_resends_its_whole_history_each_turn():
    conversations = Conversations(spec(sessions=2, turns=Fixed(3)), random.Random(2))
    first = [conversations.next_request(), conversations.next_request()]
    assert conversations.next_request() is None  # both conversations await their reply
    assert [p.session_id for p in first] == ["t-s0", "t-s1"]
    history = {p.session_id: p for p in first}
    for step in range(1, 3):
        for plan in list(history.values()):
            conversations.complete(plan, f"reply {step}")
        for _ in range(2):
            plan = conversations.next_request()
            previous = history[plan.session_id]
            assert plan.turn == step
            assert plan.messages[: len(previous.messages)] == previous.messages
            assert plan.messages[len(previous.messages)] == Message("assistant", f"reply {step}")
            assert plan.messages[-1].role == "user"
            assert len(plan.messages) == 2 * step + 1
            history[plan.session_id] = plan
    for plan in list(history.values()):
        conversations.complete(plan, "last")
    fresh = [conversations.next_request(), conversations.next_request()]
    assert {p.session_id for p in fresh} == {"t-s2", "t-s3"}
    assert all(p.turn == 0 and len(p.messages) == 1 for p in fresh)


def test_a_failed_turn_leaves_the_history_and_the_conversation_goes_on():
    conversations = Conversations(spec(sessions=1, turns=Fixed(3)), random.Random(3))
    first = conversations.next_request()
    conversations.complete(first, "ok")
    second = conversations.next_request()
    conversations.complete(second, None)
    third = conversations.next_request()
    assert third.turn == 2
    assert third.messages[:2] == (first.messages[0], Message("assistant", "ok"))
    assert len(third.messages) == 3
    assert second.messages[-1] not in third.messages


@given(st.integers(1, 5), st.integers(1, 4), st.lists(st.integers(0, 10), max_size=60))
def test_no_conversation_ever_has_two_requests_in_flight(sessions, turns, picks):
    conversations = Conversations(spec(sessions=sessions, turns=Fixed(turns)), random.Random(0))
    in_flight = []
    for pick in picks:
        plan = conversations.next_request()
        if plan is not None:
            assert plan.session_id not in {p.session_id for p in in_flight}
            in_flight.append(plan)
        if in_flight:
            done = in_flight.pop(pick % len(in_flight))
            conversations.complete(done, None if pick % 3 == 0 else "reply")
        assert len(in_flight) == conversations.in_flight <= sessions


def test_same_seed_and_calls_give_the_same_requests():
    def run(seed: int) -> list:
        conversations = Conversations(
            spec(sessions=3, turns=Uniform(1, 4), prompt_tokens=Uniform(5, 50)),
            random.Random(seed),
        )
        plans = []
        for _ in range(30):
            plan = conversations.next_request()
            conversations.complete(plan, "r")
            plans.append(plan)
        return plans

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_bands_and_keys_belong_to_a_conversation():
    bands = WeightedChoice(("platinum", "bronze"), (1.0, 3.0))
    conversations = Conversations(
        spec(sessions=4, turns=Fixed(2), bands=bands, api_keys=("a", "b")), random.Random(4)
    )
    seen = {}
    for _ in range(200):
        plan = conversations.next_request()
        assert seen.setdefault(plan.session_id, (plan.band, plan.api_key)) == (
            plan.band,
            plan.api_key,
        )
        conversations.complete(plan, "r")
    keys = [key for _, key in seen.values()]
    assert keys == ["a", "b"] * (len(keys) // 2)
    share = sum(band == "bronze" for band, _ in seen.values()) / len(seen)
    assert 0.6 < share < 0.9


def test_a_single_band_consumes_no_randomness():
    rng = random.Random(9)
    state = rng.getstate()
    assert WeightedChoice(("gold",), (1.0,)).pick(rng) == "gold"
    assert rng.getstate() == state


def test_completion_prompts_of_a_conversation_extend_each_other():
    one = (Message("user", "plan a trip"),)
    two = (*one, Message("assistant", "where to"), Message("user", "rome"))
    assert completion_prompt(one) == "User: plan a trip\nAssistant:"
    assert completion_prompt(two).startswith(completion_prompt(one))


def test_fixed_arrivals_are_evenly_spaced_from_zero():
    times = arrival_times(4.0, "fixed", random.Random(0))
    assert [next(times) for _ in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_poisson_arrivals_increase_with_mean_gap_one_over_rate():
    times = arrival_times(50.0, "poisson", random.Random(1))
    values = [next(times) for _ in range(20000)]
    gaps = [b - a for a, b in zip([0.0, *values], values, strict=False)]
    assert all(gap > 0 for gap in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.05)  # exponential: sd = mean


@pytest.mark.parametrize(("rate", "process"), [(0.0, "fixed"), (-1.0, "poisson"), (1.0, "burst")])
def test_arrivals_reject_bad_parameters(rate, process):
    with pytest.raises(ValueError):
        next(arrival_times(rate, process, random.Random(0)))
