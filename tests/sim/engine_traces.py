"""Deterministic engine-model workloads and their traces, for "behaviour unchanged" tests.

A trace is a canonical JSON text of everything observable about a run: each sequence's times
(as exact float hex), state, cache hits and output, the counters, and the queue sizes after every
operation. Two runs with equal traces behaved identically, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from typing import Any

from llmgw.services.sim.engine_model import EngineModel, PromptTooLong, Sequence
from llmgw.services.sim.params import EngineParams

# Engine shapes the golden traces cover: slot-bound, KV-bound (with eviction) and zero-delay.
CONFIGS: dict[str, dict[str, Any]] = {
    "slots": dict(
        max_num_seqs=3,
        num_gpu_blocks=400,
        block_size=4,
        max_model_len=300,
        prefill_base=0.004,
        prefill_per_token=0.0002,
        itl_base=0.003,
        itl_per_running_seq=0.0005,
        output_len_mean=12,
        output_len_max=40,
    ),
    "kv": dict(
        max_num_seqs=16,
        num_gpu_blocks=40,
        block_size=4,
        max_model_len=150,
        prefill_base=0.002,
        prefill_per_token=0.0001,
        itl_base=0.002,
        itl_per_running_seq=0.0003,
        output_len_mean=10,
        output_len_max=30,
    ),
    "zero": dict(
        max_num_seqs=2,
        num_gpu_blocks=64,
        block_size=4,
        max_model_len=200,
        prefill_base=0,
        prefill_per_token=0,
        itl_base=0,
        itl_per_running_seq=0,
        output_len_mean=8,
        output_len_max=20,
    ),
}

Submit = Callable[[EngineModel, float, list[int], int | None, random.Random], Sequence]


def _plain_submit(
    model: EngineModel, now: float, prompt: list[int], max_tokens: int | None, _: random.Random
) -> Sequence:
    return model.submit(now, prompt, max_tokens)


def _fx(value: float | None) -> str | None:
    return None if value is None else float(value).hex()


def run_trace(
    config: str,
    seed: int,
    *,
    ops: int = 120,
    submit: Submit = _plain_submit,
    **param_overrides: Any,
) -> str:
    """Run a seeded workload of submissions, aborts and idle gaps; return its canonical trace.

    `submit` lets a caller pass extra arguments (e.g. a priority drawn from the rng it is given,
    a generator separate from the workload's so the workload itself stays the same).
    """
    params = EngineParams.model_validate({**CONFIGS[config], **param_overrides})
    model = EngineModel(params, random.Random(seed))
    workload = random.Random(seed * 7919 + 1)
    extra = random.Random(seed * 104729 + 3)
    families = [[workload.randrange(1 << 30) for _ in range(24)] for _ in range(4)]
    now = 0.0
    seqs: list[Sequence] = []
    queue_sizes: list[tuple[int, int]] = []
    rejected = 0
    for _ in range(ops):
        now += workload.choice((0.0, 0.0, 0.0005, 0.001, 0.004, 0.02))
        action = workload.random()
        if action < 0.12 and seqs:
            model.abort(workload.choice(seqs), now)
        else:
            family = families[workload.randrange(len(families))]
            shared = workload.randrange(0, len(family) + 1)
            own = [workload.randrange(1 << 30) for _ in range(workload.randrange(0, 40))]
            prompt = family[:shared] + own or [workload.randrange(1 << 30)]
            max_tokens = None if workload.random() < 0.4 else workload.randrange(1, 30)
            try:
                seqs.append(submit(model, now, prompt, max_tokens, extra))
            except PromptTooLong:
                rejected += 1
        model.advance(now)
        model.kv.check_invariants()
        queue_sizes.append((len(model.running), len(model.waiting)))
    for _ in range(1_000_000):
        due = model.next_due()
        if due is None:
            break
        now = max(now, due)
        model.advance(now)
    model.kv.check_invariants()
    trace = {
        "seqs": [
            [
                seq.seq_id,
                seq.prompt_tokens,
                seq.output_len,
                seq.finish_reason,
                seq.text_seed,
                seq.state.value,
                seq.cached_tokens,
                seq.emitted,
                _fx(seq.arrived_at),
                _fx(seq.admitted_at),
                _fx(seq.first_token_at),
                _fx(seq.finished_at),
            ]
            for seq in seqs
        ],
        "stats": [
            model.stats.prompt_tokens,
            model.stats.generation_tokens,
            model.stats.prefix_cache_queries,
            model.stats.prefix_cache_hits,
            sorted(model.stats.finished.items()),
            model.stats.rejected,
            rejected,
        ],
        "kv": [model.kv.free, model.kv.private, model.kv.cached_blocks, model.kv.reserved],
        "queues": queue_sizes,
        "end": _fx(now),
    }
    return json.dumps(trace, separators=(",", ":"), sort_keys=True)


def digest(trace: str) -> str:
    return hashlib.sha256(trace.encode()).hexdigest()
