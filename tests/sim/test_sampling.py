"""Output lengths: where the model would stop, cut by the request's caps (pure)."""

from __future__ import annotations

import random

import pytest

from llmgw.services.sim.params import EngineParams
from llmgw.services.sim.sampling import output_length

# The model always wants 10 tokens (then samples its end-of-sequence token).
TEN = EngineParams(output_len_distribution="fixed", output_len_mean=10)

CASES = [
    # (room, max_tokens, min_tokens, ignore_eos) -> (output tokens, finish reason)
    pytest.param((100, None, 0, False), (10, "stop"), id="no-cap-ends-at-eos"),
    pytest.param((100, 64, 0, False), (10, "stop"), id="ends-before-max-tokens"),
    pytest.param((100, 10, 0, False), (10, "stop"), id="eos-as-the-last-allowed-token-is-stop"),
    pytest.param((100, 9, 0, False), (9, "length"), id="max-tokens-cuts"),
    pytest.param((6, None, 0, False), (6, "length"), id="room-cuts"),
    pytest.param((6, 64, 0, False), (6, "length"), id="room-cuts-below-max-tokens"),
    pytest.param((100, 64, 30, False), (31, "stop"), id="min-tokens-postpones-eos"),
    pytest.param((100, 20, 20, False), (20, "length"), id="min-tokens-up-to-the-cap"),
    pytest.param((100, 64, 9, False), (10, "stop"), id="min-tokens-below-the-draw"),
    pytest.param((100, 64, 0, True), (64, "length"), id="ignore-eos-writes-max-tokens"),
    pytest.param((40, None, 0, True), (40, "length"), id="ignore-eos-without-cap-fills-the-room"),
    pytest.param((40, 64, 0, True), (40, "length"), id="ignore-eos-within-the-room"),
]


@pytest.mark.parametrize(("request_", "expected"), CASES)
def test_output_is_the_drawn_length_cut_by_max_tokens_and_room(
    request_: tuple[int, int | None, int, bool], expected: tuple[int, str]
) -> None:
    room, max_tokens, min_tokens, ignore_eos = request_
    got = output_length(
        TEN, random.Random(1), room, max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos
    )
    assert got == expected


def test_most_capped_requests_end_on_their_own_as_real_engines_do() -> None:
    params = EngineParams()  # lognormal, mean 128
    rng = random.Random(3)
    results = [output_length(params, rng, 30_000, 512) for _ in range(2000)]
    stopped = [n for n, reason in results if reason == "stop"]
    assert len(stopped) > 0.9 * len(results)
    assert all(n <= 512 for n in stopped)
    assert all(n == 512 for n, reason in results if reason == "length")
    assert 100 < sum(stopped) / len(stopped) < 160  # the distribution's mean, barely cut


def test_ignore_eos_draws_nothing() -> None:
    rng = random.Random(5)
    before = rng.getstate()
    output_length(EngineParams(), rng, 100, 8, ignore_eos=True)
    assert rng.getstate() == before
