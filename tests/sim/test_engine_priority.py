"""Scheduling policies of the pure engine model: vLLM's ``fcfs`` and ``priority``."""

from __future__ import annotations

import random

import pytest
from engine_traces import CONFIGS, run_trace
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.services.sim.engine_model import (
    EngineModel,
    PriorityNotEnabled,
    PromptTooLong,
    SeqState,
    Sequence,
)
from llmgw.services.sim.params import EngineParams

MS = 0.001


def make_model(policy: str = "priority", **overrides: object) -> EngineModel:
    base = dict(
        scheduling_policy=policy,
        max_num_seqs=1,
        num_gpu_blocks=64,
        block_size=4,
        max_model_len=200,
        prefill_base=10 * MS,
        prefill_per_token=0,
        itl_base=5 * MS,
        itl_per_running_seq=0,
    )
    base.update(overrides)
    return EngineModel(EngineParams.model_validate(base), random.Random(7))


def run_until_idle(model: EngineModel, start: float = 0.0) -> float:
    now = start
    while (due := model.next_due()) is not None:
        now = max(now, due)
        model.advance(now)
    return now


def prompt(n: int, salt: int) -> list[int]:
    return [salt * 1_000_003 + i for i in range(n)]


def admission_order(seqs: dict[str, Sequence]) -> list[str]:
    """Labels sorted by admission time (ties: submission order, which is how they were admitted
    when several were admitted at once: one slot frees at a time here)."""
    return sorted(seqs, key=lambda label: (seqs[label].admitted_at, seqs[label].seq_id))


# (policy, [(label, priority, submitted at)], expected order of admission). A "busy" request
# submitted at 0 holds the engine's only slot until 0.5 s, so all of these wait behind it.
ORDER_CASES = [
    ("priority", [("a", 5, 0.01), ("b", 1, 0.02), ("c", 3, 0.03)], ["b", "c", "a"]),
    ("priority", [("a", 2, 0.01), ("b", 2, 0.02), ("c", 2, 0.03)], ["a", "b", "c"]),
    ("priority", [("a", 0, 0.01), ("b", -4, 0.02), ("c", 0, 0.02)], ["b", "a", "c"]),
    ("priority", [("a", 1, 0.01), ("b", 1, 0.01), ("c", 0, 0.01)], ["c", "a", "b"]),
    ("priority", [("a", 2**62, 0.01), ("b", -(2**62), 0.04)], ["b", "a"]),
    ("fcfs", [("a", 0, 0.01), ("b", 0, 0.02), ("c", 0, 0.03)], ["a", "b", "c"]),
]


@pytest.mark.parametrize(("policy", "requests", "expected"), ORDER_CASES)
def test_waiting_requests_are_admitted_in_policy_order(
    policy: str, requests: list[tuple[str, int, float]], expected: list[str]
) -> None:
    model = make_model(policy)
    busy = model.submit(0.0, prompt(4, 99), max_tokens=100, ignore_eos=True)  # until 0.505 s
    seqs = {
        label: model.submit(at, prompt(4, index), max_tokens=2, priority=priority)
        for index, (label, priority, at) in enumerate(requests)
    }
    assert all(seq.state is SeqState.WAITING for seq in seqs.values())
    assert [seq for seq in model.waiting] == [seqs[label] for label in expected]
    run_until_idle(model)
    assert admission_order(seqs) == expected
    assert seqs[expected[0]].admitted_at == pytest.approx(busy.finished_at)


@pytest.mark.parametrize("priority", [1, -1, 2**40])
def test_fcfs_refuses_a_non_zero_priority_and_leaves_no_trace(priority: int) -> None:
    model = make_model("fcfs")
    model.submit(0.0, prompt(4, 1), max_tokens=3)
    before = (model._ids, model.rng.getstate(), len(model.waiting), model.stats.prompt_tokens)
    with pytest.raises(PriorityNotEnabled, match=f"Got priority {priority} but Priority"):
        model.submit(0.0, prompt(4, 2), max_tokens=3, priority=priority)
    assert (model._ids, model.rng.getstate(), len(model.waiting), model.stats.prompt_tokens) == (
        before
    )
    # Priority 0 (the default) is what fcfs accepts.
    assert model.submit(0.0, prompt(4, 3), max_tokens=3, priority=0).priority == 0


def test_a_higher_priority_arrival_waits_for_a_slot_and_preempts_nobody() -> None:
    """vLLM preempts only when a running request cannot grow; here reservations rule that out,
    so running requests run exactly as if the urgent request never came."""

    def run(with_urgent: bool) -> tuple[list[float], float | None]:
        model = make_model(max_num_seqs=2, itl_per_running_seq=1 * MS)
        low = [
            model.submit(0.0, prompt(8, i), max_tokens=20, priority=9, ignore_eos=True)
            for i in range(2)
        ]
        urgent = None
        if with_urgent:
            urgent = model.submit(0.03, prompt(8, 5), max_tokens=2, priority=-1)
            assert urgent.state is SeqState.WAITING
            assert all(seq.state is SeqState.RUNNING for seq in low)
        run_until_idle(model)
        assert all(seq.emitted == 20 for seq in low)
        return [seq.finished_at for seq in low], None if urgent is None else urgent.admitted_at

    undisturbed, _ = run(with_urgent=False)
    finished, urgent_admitted = run(with_urgent=True)
    assert finished == undisturbed
    assert urgent_admitted == pytest.approx(min(finished))


def test_a_priority_head_that_does_not_fit_blocks_those_behind_it() -> None:
    # 10 blocks of 4 tokens: "big" (16 + 8 tokens) needs 6 blocks and cannot join "running".
    model = make_model(max_num_seqs=8, num_gpu_blocks=10)
    running = model.submit(0.0, prompt(16, 1), max_tokens=8, priority=5, ignore_eos=True)
    big = model.submit(0.01, prompt(16, 2), max_tokens=8, priority=0, ignore_eos=True)
    small = model.submit(0.02, prompt(2, 3), max_tokens=1, priority=7)
    assert (big.state, small.state) == (SeqState.WAITING, SeqState.WAITING)
    run_until_idle(model)
    assert big.admitted_at == pytest.approx(running.finished_at)
    assert small.admitted_at >= big.admitted_at
    model.kv.check_invariants()


def test_aborting_a_waiting_request_keeps_the_others_in_priority_order() -> None:
    model = make_model()
    model.submit(0.0, prompt(4, 9), max_tokens=50, ignore_eos=True)  # busy until 0.255 s
    a, b, c, d = (
        model.submit(0.01, prompt(4, i), 2, priority=p) for i, p in enumerate((3, 1, 2, 0))
    )
    model.abort(c, 0.02)
    assert list(model.waiting) == [d, b, a]
    assert c.state is SeqState.ABORTED
    run_until_idle(model, 0.02)
    assert [s.state for s in (a, b, d)] == [SeqState.FINISHED] * 3
    assert d.admitted_at < b.admitted_at < a.admitted_at


def key(seq: Sequence) -> tuple[int, float, int]:
    return (seq.priority, seq.arrived_at, seq.seq_id)


@settings(max_examples=80, deadline=None)
@given(
    shape=st.sampled_from(["slots", "kv"]),
    ops=st.lists(
        st.tuples(
            st.integers(0, 3),  # prompt family
            st.integers(1, 40),  # prompt length
            st.integers(1, 12),  # max_tokens
            st.integers(-2, 2),  # priority
            st.sampled_from([0, 1, 3, 10]),  # ms since the previous request
            st.booleans(),  # abort a random earlier request now
        ),
        min_size=1,
        max_size=50,
    ),
)
def test_no_request_starts_while_a_better_one_has_been_waiting(
    shape: str, ops: list[tuple[int, int, int, int, int, bool]]
) -> None:
    """Under ``priority``, if w was already waiting when r started and w's (priority, arrival)
    is smaller, w started no later than r, whether slots or KV blocks are the constraint."""
    if shape == "slots":
        model = make_model(max_num_seqs=2, num_gpu_blocks=400, itl_per_running_seq=0.5 * MS)
    else:
        model = make_model(max_num_seqs=8, num_gpu_blocks=20, itl_per_running_seq=0.5 * MS)
    now, seqs = 0.0, []
    for family, length, max_tokens, priority, gap, abort in ops:
        now += gap * MS
        model.advance(now)
        if abort and seqs:
            model.abort(seqs[(family * 7 + length) % len(seqs)], now)
        try:
            seqs.append(model.submit(now, prompt(length, family), max_tokens, priority=priority))
        except PromptTooLong:
            pass
        model.kv.check_invariants()
        assert len(model.running) <= model.params.max_num_seqs
    run_until_idle(model, now)
    model.kv.check_invariants()
    assert model.kv.used_blocks == 0 and model.kv.reserved == 0
    started = [seq for seq in seqs if seq.admitted_at is not None]
    for r in started:
        for w in seqs:
            if w is r or key(w) >= key(r) or not w.arrived_at < r.admitted_at:
                continue
            if w.state is SeqState.ABORTED and w.admitted_at is None:
                assert w.finished_at <= r.admitted_at  # gone before r started
                continue
            assert w.admitted_at is not None and w.admitted_at <= r.admitted_at, (w, r)


@settings(max_examples=40, deadline=None)
@given(
    config=st.sampled_from(sorted(CONFIGS)),
    seed=st.integers(0, 10_000),
    priority=st.integers(-(2**63), 2**63 - 1),
)
def test_equal_priorities_under_the_priority_policy_behave_exactly_like_fcfs(
    config: str, seed: int, priority: int
) -> None:
    def same_priority(model, now, tokens, max_tokens, _rng):
        return model.submit(now, tokens, max_tokens, priority=priority)

    fcfs = run_trace(config, seed, ops=60)
    assert run_trace(config, seed, ops=60, submit=same_priority, scheduling_policy="priority") == (
        fcfs
    )


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_mixed_priorities_change_the_schedule_but_keep_the_cache_consistent(config: str) -> None:
    """Sanity for the trace harness: different priorities do reorder a saturated engine."""

    def mixed(model, now, tokens, max_tokens, rng):
        return model.submit(now, tokens, max_tokens, priority=rng.randrange(-3, 4))

    fcfs = run_trace(config, 1)
    mixed_trace = run_trace(config, 1, submit=mixed, scheduling_policy="priority")
    if config == "zero":
        assert mixed_trace == fcfs  # zero timings: nothing ever waits, so order cannot matter
    else:
        assert mixed_trace != fcfs
