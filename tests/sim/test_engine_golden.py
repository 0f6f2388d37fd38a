"""Pins the engine model's observable behaviour on seeded workloads (digests of full traces).

The digests were recorded from the FIFO-only model, before scheduling policies existed; the
default ``fcfs`` policy must keep reproducing them byte for byte. A change that alters FCFS
scheduling on purpose must say so and re-record them (print `run_trace` digests).

They were recorded when a request with ``max_tokens`` always generated exactly that many tokens
(and drew no length); such requests are now sent with ``ignore_eos``, which still does, so the
recorded traces still pin the scheduler.
"""

from __future__ import annotations

import random

import pytest
from engine_traces import digest, run_trace

from llmgw.services.sim.engine_model import EngineModel, Sequence


def exact_lengths(
    model: EngineModel, now: float, prompt: list[int], max_tokens: int | None, _: random.Random
) -> Sequence:
    return model.submit(now, prompt, max_tokens, ignore_eos=max_tokens is not None)


GOLDEN = {
    ("slots", 1): "81c550277ba27bd308f4cd36302dd4de2b038265b805f8d332280a8a8e062085",
    ("slots", 2): "e157cd053c9bfdf1c31ae77b74ee7fac5ab6bda352ec02598751d3528c30bd83",
    ("slots", 3): "6bb02168eeaef06c3bf73dc5bf1a14bad755ec04cba97ab8a26765926e7aadab",
    ("kv", 1): "437d4b35fe373248d54ece241d1316b7229323ac5e31de3093401c6ba38b407f",
    ("kv", 2): "edbbad4533f630784cd81564a27ecb7866f16bb9175e3f9c84d0f7cedd0a2138",
    ("kv", 3): "447d0e2b9a9c92c8efa67d4948158a862b749af35b03663322dc0bb19890ccc6",
    ("zero", 1): "1f223a6b81220629434ffedea972904dc2775f1cf8f699bd781a13bd6abaffc4",
    ("zero", 2): "77a700e375e45e16b2bbb71dc5521fbfdf2b49ffe9476f9b9ae8ec3ecb7520a1",
    ("zero", 3): "dfa9be8e56c67bcb2297abf9183ab53c2527a68ce7872281b8a6568ff9dd5d90",
}


@pytest.mark.parametrize(("config", "seed"), sorted(GOLDEN), ids=lambda v: str(v))
def test_default_scheduling_reproduces_the_recorded_trace(config: str, seed: int) -> None:
    assert digest(run_trace(config, seed, submit=exact_lengths)) == GOLDEN[config, seed]
