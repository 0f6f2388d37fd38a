"""What each endpoint's prefix cache holds, shared by every admission instance through the
prefix stream (a real nats-server): a prompt placed by one instance is known to the others, an
instance that starts later reads the recent past, and an engine that emptied its cache (its KV
events said so) is forgotten."""

from __future__ import annotations

import pytest
from rig import ENDPOINTS, MODEL, admitted, open_rig, rig_config
from timing import eventually

from llmgw.core.prefix import PromptPrefix, model_root, pack, text_chain, token_chain
from llmgw.services.admission.health import HealthBoard
from llmgw.services.admission.loadboard import LoadBoard
from llmgw.services.admission.prefixes import DISAGREEMENT, TOP_KEPT, PrefixBoard
from llmgw.wire import PrefixHeld, prefix_held_subject

TENANT_PROMPT = b"\x1esystem\x1f" + b"You answer as the support desk of Acme. " * 60


def prompt(question: str) -> bytes:
    return TENANT_PROMPT + b"\x1euser\x1f" + question.encode()


@pytest.fixture
async def rig(nats_url, unique_id):
    rig = await open_rig(nats_url, unique_id, instances=2)
    await rig.report_all(running=0, capacity=8)
    yield rig
    await rig.close()


def held_by(rig, endpoint: str, data: bytes) -> list[float]:  # type: ignore[no-untyped-def]
    """The share of `data` each instance believes `endpoint` holds."""
    return [a.prefixes.share(endpoint, _asked(rig, data), 0.0) for a in rig.admissions]


async def test_every_instance_learns_where_a_prompt_went_and_sends_the_next_there(rig):
    first, second = rig.admissions
    placed = await rig.ask(session="s-1", shard=rig.shard_of_instance(first), prompt=prompt("a"))
    assert admitted(placed)
    endpoint = placed.target.endpoint
    await eventually(
        lambda: min(held_by(rig, endpoint, prompt("b"))) > 0.9, what="both instances know"
    )
    # New sessions of the same tenant, decided by the other instance, start where it is cached,
    # though the other endpoint is as idle.
    for n in range(4):
        reply = await rig.ask(
            session=f"s-other-{n}", shard=rig.shard_of_instance(second), prompt=prompt(f"q{n}")
        )
        assert admitted(reply) and reply.target.endpoint == endpoint, reply
    other = next(e for e in ENDPOINTS if e != endpoint)
    assert max(held_by(rig, other, prompt("b"))) == 0.0
    # An instance that joins now reads what the stream kept.
    late = await rig.add_admission()
    await eventually(
        lambda: late.prefixes.share(endpoint, _asked(rig, prompt("c")), 0.0) > 0.9,
        what="the late instance caught up",
    )


def _asked(rig, data: bytes) -> PromptPrefix:  # type: ignore[no-untyped-def]
    return _chain_of(rig.config, data)


async def test_an_engine_that_emptied_its_cache_is_forgotten_by_every_instance(rig):
    placed = await rig.ask(session="s-2", prompt=prompt("a"))
    endpoint = placed.target.endpoint
    await eventually(lambda: min(held_by(rig, endpoint, prompt("a"))) > 0.9, what="known")
    held = PrefixHeld(endpoint=endpoint, seq=0, block_size=16, cleared=True, emptied=True)
    js = rig.nc.jetstream()
    await js.publish(
        prefix_held_subject(rig.config.prefix_stream, endpoint), held.model_dump_json().encode()
    )
    await eventually(lambda: max(held_by(rig, endpoint, prompt("a"))) == 0.0, what="forgotten")


def test_tokens_that_never_match_the_engines_blocks_fall_back_to_what_was_sent(nats_url, unique_id):
    """A tokenizer (or chat template) other than the engine's: its token chains never match
    what the engine says it holds, so the endpoint is matched by what was sent there, as an
    engine without events is; one match of the engine's blocks trusts the events again."""
    config = rig_config(nats_url, unique_id)
    board = PrefixBoard(config, LoadBoard(config, HealthBoard()), "i")
    engine_tokens = list(range(1000, 1400))  # what the engine computed
    ours = [t + 1 for t in engine_tokens]  # a tokenizer that disagrees
    board._apply_held(
        PrefixHeld(
            endpoint="engine-1", seq=0, block_size=16, stored=pack(token_chain(engine_tokens, 16))
        )
    )
    text = _chain_of(config, prompt("question"))
    asked = PromptPrefix(
        text.chain, text.length, text.block_bytes, tuple(token_chain(ours, 16)), 400, 16
    )
    board.placed("engine-1", MODEL, asked, 0.0)
    later = 10 * config.prefix.predicted_ttl  # the placement's events came long ago
    assert board.share("engine-1", asked, later) == 0.0  # the events say: not held
    for _ in range(DISAGREEMENT):
        board.share("engine-1", asked, later)
    assert board.share("engine-1", asked, later) > 0.9  # by what was sent
    agreeing = PromptPrefix(
        text.chain, text.length, text.block_bytes, tuple(token_chain(engine_tokens, 16)), 400, 16
    )
    assert board.share("engine-1", agreeing, later) == 1.0  # held: the events count again


def _chain_of(config, data: bytes) -> PromptPrefix:  # type: ignore[no-untyped-def]
    block = config.prefix.block_bytes
    chain = text_chain(data, block, config.prefix.max_blocks, model_root(MODEL))
    return PromptPrefix(chain, len(data), block)


async def test_an_engines_kv_cache_bounds_what_is_remembered_of_it(rig):
    """`vllm:cache_config_info` (block size x blocks, in the scraper's report) bounds the
    endpoint's index: 64 blocks of 16 tokens hold 4 KiB of prompt, 16 of our 256-byte blocks
    (128 blocks: 32)."""
    await rig.report("engine-1", running=0, capacity=8, kv_blocks=(16, 64))
    await rig.report("engine-2", running=0, capacity=8, kv_blocks=(16, 128))
    first, _ = rig.admissions
    long = prompt("a") * 5  # 12 KiB: more than either holds
    placed = await rig.ask(session="s-3", shard=rig.shard_of_instance(first), prompt=long)
    assert admitted(placed)
    endpoint = placed.target.endpoint
    expected = {"engine-1": 16, "engine-2": 32}[endpoint]
    assert first.prefixes.sent.capacity(endpoint) == expected
    assert first.prefixes.sent.size(endpoint) == expected  # the prompt has more blocks


async def test_a_lora_adapters_requests_go_where_it_is_loaded(nats_url, unique_id):
    """vllm:lora_requests_info (in the scraper's report) says engine-2 has the adapter loaded:
    requests for it start there while it has room, not on the engine that would load it."""
    adapter = {"upstream_model": {MODEL: "sql-lora"}}
    rig = await open_rig(nats_url, unique_id, endpoints={"engine-1": adapter, "engine-2": adapter})
    try:
        await rig.report("engine-1", running=0, capacity=8, lora_adapters=())
        await rig.report("engine-2", running=1, capacity=8, lora_adapters=("sql-lora",))
        for n in range(2):  # engine-2's cost: 1/8, then 2/8, - 0.25 < engine-1's 0.11
            reply = await rig.ask(session=f"lora-{n}")
            assert admitted(reply) and reply.target.endpoint == "engine-2", reply
            assert reply.target.upstream_model == "sql-lora"
        # With 3 of 8 slots busy (3/8 - 0.25 > 0.11) engine-1 is cheaper, adapter or not.
        third = await rig.ask(session="lora-2")
        assert admitted(third) and third.target.endpoint == "engine-1", third
    finally:
        await rig.close()


def test_llmgw_state_shows_each_endpoints_most_placed_prefixes(nats_url, unique_id):
    """The summary `llmgw state` prints: per endpoint, its prompts' first blocks by placements.
    A board that placed more distinct prompts than it counts (`TOP_KEPT`) keeps the most
    placed ones."""
    config = rig_config(nats_url, unique_id)
    board = PrefixBoard(config, LoadBoard(config, HealthBoard()), "i")
    tenants = [_chain_of(config, f"You are tenant {t}'s agent. ".encode() * 100) for t in range(3)]
    for placements, asked in zip((5, 3, 1), tenants, strict=True):
        for n in range(placements):
            board.placed("engine-1", MODEL, asked, float(n))
    for n in range(TOP_KEPT + 50):  # one-shots of prompts never seen before
        board.placed("engine-1", MODEL, _chain_of(config, f"one-shot {n}".encode() * 200), 9.0)
    (row,) = [r for r in board.summary(top=3) if r.endpoint == "engine-1"]
    most = [f"{asked.chain[0]:016x}" for asked in tenants[:2]]
    assert [t.prefix for t in row.top[:2]] == most
    assert [t.placements for t in row.top] == [5, 3, 1]  # the third: a one-shot
    assert row.top[0].blocks == len(tenants[0].chain) and row.top[0].last_at == 4.0
