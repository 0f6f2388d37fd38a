"""What each endpoint's prefix cache holds, shared by every admission instance through the
prefix stream (a real nats-server): a prompt placed by one instance is known to the others, an
instance that starts later reads the recent past, and an engine that emptied its cache (its KV
events said so) is forgotten."""

from __future__ import annotations

import pytest
from rig import ENDPOINTS, MODEL, admitted, open_rig, until

from llmgw.core.prefix import PromptPrefix, model_root, text_chain
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
    await until(lambda: min(held_by(rig, endpoint, prompt("b"))) > 0.9, what="both instances know")
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
    await until(
        lambda: late.prefixes.share(endpoint, _asked(rig, prompt("c")), 0.0) > 0.9,
        what="the late instance caught up",
    )


def _asked(rig, data: bytes) -> PromptPrefix:  # type: ignore[no-untyped-def]
    block = rig.config.prefix.block_bytes
    chain = text_chain(data, block, rig.config.prefix.max_blocks, model_root(MODEL))
    return PromptPrefix(chain, len(data), block)


async def test_an_engine_that_emptied_its_cache_is_forgotten_by_every_instance(rig):
    placed = await rig.ask(session="s-2", prompt=prompt("a"))
    endpoint = placed.target.endpoint
    await until(lambda: min(held_by(rig, endpoint, prompt("a"))) > 0.9, what="known")
    held = PrefixHeld(endpoint=endpoint, seq=0, block_size=16, cleared=True, emptied=True)
    js = rig.nc.jetstream()
    await js.publish(
        prefix_held_subject(rig.config.prefix_stream, endpoint), held.model_dump_json().encode()
    )
    await until(lambda: max(held_by(rig, endpoint, prompt("a"))) == 0.0, what="forgotten")
