"""The pure engine model, driven by a fake clock (no asyncio, no HTTP)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.services.sim.engine_model import EngineModel, PromptTooLong, SeqState
from llmgw.services.sim.params import EngineParams

MS = 0.001


def make_model(**overrides: object) -> EngineModel:
    base = dict(
        max_num_seqs=4,
        num_gpu_blocks=64,
        block_size=4,
        max_model_len=200,
        prefill_base=10 * MS,
        prefill_per_token=1 * MS,
        itl_base=5 * MS,
        itl_per_running_seq=1 * MS,
    )
    base.update(overrides)
    return EngineModel(EngineParams.model_validate(base), random.Random(7))


def run_until_idle(model: EngineModel, start: float = 0.0, limit: int = 100_000) -> float:
    """Step the model from event to event until nothing is running; returns the final time."""
    now = start
    for _ in range(limit):
        due = model.next_due()
        if due is None:
            return now
        now = max(now, due)
        model.advance(now)
    raise AssertionError("the model never went idle")


def prompt(n: int, salt: int = 0) -> list[int]:
    return [salt * 1_000_003 + i for i in range(n)]


def test_ttft_is_prefill_of_the_prompt_when_idle() -> None:
    model = make_model()
    seq = model.submit(0.0, prompt(40), max_tokens=3)
    run_until_idle(model)
    assert seq.state is SeqState.FINISHED
    assert seq.ttft == pytest.approx(10 * MS + 40 * MS)


def test_prefix_hit_cuts_ttft_and_counts_hit_tokens() -> None:
    model = make_model()
    shared = prompt(40)
    first = model.submit(0.0, [*shared, 1, 2], max_tokens=2)
    run_until_idle(model)
    hits_before = model.stats.prefix_cache_hits
    second = model.submit(10.0, [*shared, 3, 4, 5], max_tokens=2)
    run_until_idle(model, 10.0)
    # 40 shared tokens = 10 full blocks of 4, all cached by the first request.
    assert second.cached_tokens == 40
    assert model.stats.prefix_cache_hits - hits_before == 40
    assert model.stats.prefix_cache_queries == 42 + 43
    assert second.ttft == pytest.approx(10 * MS + 3 * MS)
    assert second.ttft < first.ttft


def test_identical_prompt_recomputes_at_least_the_last_block() -> None:
    model = make_model()
    model.submit(0.0, prompt(16), max_tokens=1)
    run_until_idle(model)
    again = model.submit(5.0, prompt(16), max_tokens=1)
    run_until_idle(model, 5.0)
    assert again.cached_tokens == 12


def test_requests_beyond_max_num_seqs_wait_fifo_and_their_ttft_includes_the_wait() -> None:
    model = make_model(max_num_seqs=2)
    running = [model.submit(0.0, prompt(8, salt), max_tokens=10) for salt in range(2)]
    queued = model.submit(0.0, prompt(8, 9), max_tokens=1)
    assert len(model.running) == 2
    assert list(model.waiting) == [queued]
    end = run_until_idle(model)
    first_done = min(seq.finished_at for seq in running)
    assert queued.admitted_at == pytest.approx(first_done)
    assert queued.ttft == pytest.approx(first_done + 10 * MS + 8 * MS)
    assert end >= queued.finished_at


def test_kv_capacity_blocks_admission_even_below_max_num_seqs() -> None:
    # 10 blocks of 4 tokens; each request needs ceil((16 + 8) / 4) = 6 blocks.
    model = make_model(num_gpu_blocks=10, max_num_seqs=8)
    big = model.submit(0.0, prompt(16, 1), max_tokens=8, ignore_eos=True)
    blocked = model.submit(0.0, prompt(16, 2), max_tokens=8, ignore_eos=True)
    small_behind = model.submit(0.0, prompt(2, 3), max_tokens=1)
    assert big.state is SeqState.RUNNING
    assert blocked.state is SeqState.WAITING
    # FIFO: the small request doesn't overtake the blocked head of the queue.
    assert small_behind.state is SeqState.WAITING
    run_until_idle(model)
    assert blocked.admitted_at == pytest.approx(big.finished_at)
    assert all(seq.state is SeqState.FINISHED for seq in (big, blocked, small_behind))
    model.kv.check_invariants()


def test_request_larger_than_the_whole_cache_is_rejected_at_submission() -> None:
    model = make_model(num_gpu_blocks=4)
    with pytest.raises(PromptTooLong, match="prompt too long"):
        model.submit(0.0, prompt(17), max_tokens=1)
    assert model.stats.rejected == 1
    assert not model.waiting


def test_prompt_reaching_max_model_len_is_rejected_and_output_is_capped() -> None:
    model = make_model(max_model_len=50, num_gpu_blocks=1000)
    with pytest.raises(PromptTooLong, match="maximum context length"):
        model.submit(0.0, prompt(50), max_tokens=1)
    seq = model.submit(0.0, prompt(45), max_tokens=100, ignore_eos=True)
    assert seq.output_len == 5
    assert seq.finish_reason == "length"


def test_lru_eviction_drops_the_least_recently_released_prefix() -> None:
    # 12 blocks of 4 tokens. Prompts a, b: 16 tokens = 4 cached blocks each.
    model = make_model(num_gpu_blocks=12, max_num_seqs=1)
    a, b = prompt(16, 1), prompt(16, 2)
    model.submit(0.0, [*a, 7], max_tokens=1)
    run_until_idle(model)
    model.submit(1.0, [*b, 7], max_tokens=1)
    run_until_idle(model, 1.0)
    assert model.kv.cached_blocks == 8
    # c needs 7 blocks; 4 free, so 3 cached idle blocks go, all from a (released first).
    model.submit(2.0, prompt(25, 3), max_tokens=2)
    run_until_idle(model, 2.0)
    model.kv.check_invariants()
    hit_b = model.submit(3.0, [*b, 8], max_tokens=1)
    run_until_idle(model, 3.0)
    hit_a = model.submit(4.0, [*a, 8], max_tokens=1)
    run_until_idle(model, 4.0)
    assert hit_b.cached_tokens == 16
    # a was released first, tail first: its blocks 3, 2, 1 went; its head block survived.
    assert hit_a.cached_tokens == 4


def test_inter_token_latency_grows_with_the_batch() -> None:
    def mean_itl(batch: int) -> float:
        model = make_model(max_num_seqs=16, num_gpu_blocks=1000)
        seqs = [
            model.submit(0.0, prompt(4, salt), max_tokens=20, ignore_eos=True)
            for salt in range(batch)
        ]
        run_until_idle(model)
        seq = seqs[0]
        return (seq.finished_at - seq.first_token_at) / (seq.output_len - 1)

    alone, eight = mean_itl(1), mean_itl(8)
    assert alone == pytest.approx(5 * MS + 1 * MS)
    assert eight == pytest.approx(5 * MS + 8 * MS)


def test_zero_delay_finishes_inside_submit_without_pending_events() -> None:
    model = EngineModel(EngineParams.zero_delay(), random.Random(1))
    seq = model.submit(3.0, prompt(30), max_tokens=50, ignore_eos=True)
    assert seq.state is SeqState.FINISHED
    assert seq.emitted == 50
    assert model.next_due() is None
    assert model.kv.used_blocks == 0


def test_output_length_without_max_tokens_is_drawn_within_bounds_and_seeded() -> None:
    params = EngineParams.zero_delay(output_len_mean=20, output_len_max=40)
    lengths = []
    for _ in range(2):
        model = EngineModel(params, random.Random(42))
        lengths.append([model.submit(0.0, prompt(4, i), None).output_len for i in range(200)])
    assert lengths[0] == lengths[1]
    assert all(1 <= n <= 40 for n in lengths[0])
    assert 14 < sum(lengths[0]) / 200 < 24


def test_abort_frees_blocks_and_admits_the_next_request() -> None:
    model = make_model(max_num_seqs=1)
    first = model.submit(0.0, prompt(8), max_tokens=100, ignore_eos=True)  # still running at 0.05
    second = model.submit(0.0, prompt(8, 1), max_tokens=1)
    assert second.state is SeqState.WAITING
    model.abort(first, 0.05)
    assert first.state is SeqState.ABORTED
    assert second.state is SeqState.RUNNING
    assert model.stats.finished["abort"] == 1
    run_until_idle(model, 0.05)
    assert model.kv.used_blocks == 0
    model.kv.check_invariants()


def test_listener_sees_every_token_and_the_end() -> None:
    model = make_model()
    seen: list[tuple[int, bool]] = []
    seq = model.submit(
        0.0,
        prompt(8),
        max_tokens=4,
        ignore_eos=True,
        listener=lambda s: seen.append((s.emitted, s.done)),
    )
    run_until_idle(model)
    assert seen == [(1, False), (2, False), (3, False), (4, True)]
    assert seq.done


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 60), st.integers(1, 20), st.integers(0, 5)),
        min_size=1,
        max_size=40,
    )
)
def test_random_workloads_keep_the_cache_consistent_and_drain(
    ops: list[tuple[int, int, int, int]],
) -> None:
    model = make_model(num_gpu_blocks=24, max_num_seqs=3)
    now = 0.0
    submitted = []
    for family, length, max_tokens, gap in ops:
        now += gap * MS
        model.advance(now)
        try:
            submitted.append(model.submit(now, prompt(length, family), max_tokens))
        except PromptTooLong:
            pass
        model.kv.check_invariants()
        assert len(model.running) <= 3
    run_until_idle(model, now)
    model.kv.check_invariants()
    assert all(seq.state is SeqState.FINISHED for seq in submitted)
    assert model.kv.used_blocks == 0 and model.kv.reserved == 0
