"""`llmgw.wire.trusted`, the hot path's constructor, builds what pydantic's model_construct
builds: equal messages, the same JSON (field order included) and the same fields set, for any
subset of a message's fields; a class it cannot build that way is refused, not built wrong."""

from __future__ import annotations

import inspect

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from llmgw import wire
from llmgw.core.ledger import LeaseKind, LeaseRecord, PinRecord, ShardState
from llmgw.wire import AdmitReply, AdmitRequest, Handover, RequestEnded, Target, trusted

TARGET = Target(
    provider="p1", provider_kind="managed", endpoint="e1", url="http://e1", upstream_model="m"
)
LEASE = LeaseRecord(
    lease_id="l1",
    provider="p1",
    model="m1",
    kind=LeaseKind.PINNED,
    unreserved=False,
    shard=3,
    edge="edge-1",
    granted_at=1.0,
    renewed_at=1.0,
    endpoint="e1",
)

# Values of the hot path's messages, every field optional so that any subset is drawn.
VALUES = {
    AdmitRequest: {
        "id": st.text(min_size=1, max_size=8),
        "edge": st.just("edge-1"),
        "model": st.sampled_from(["m1", "m2"]),
        "feature": st.sampled_from(["chat", "completions", "embeddings"]),
        "request_id": st.none() | st.text(max_size=8),
        "shard": st.integers(0, 31),
        "stream": st.booleans(),
        "session": st.none() | st.text(max_size=8),
        "parent": st.none() | st.text(max_size=8),
        "band": st.none() | st.just("gold"),
        "exclude": st.lists(st.sampled_from(["e1", "e2"]), max_size=2).map(tuple),
        "retry_of": st.none() | st.just("l0"),
    },
    RequestEnded: {
        "id": st.text(min_size=1, max_size=8),
        "edge": st.just("edge-1"),
        "lease": st.none() | st.just("l1"),
        "shard": st.none() | st.integers(0, 31),
        "ok": st.booleans(),
        "outcome": st.sampled_from(["success", "upstream_error"]),
        "model": st.just("m1"),
        "provider": st.just("p1"),
        "endpoint": st.just("e1"),
        "ended_at": st.floats(0, 2e9),
        "latency": st.floats(0, 10),
        "output_tokens": st.integers(0, 1000),
    },
    AdmitReply: {
        "id": st.text(min_size=1, max_size=8),
        "status": st.sampled_from(list(wire.ReplyStatus)),
        "target": st.none() | st.just(TARGET),
        "lease": st.none() | st.just(LEASE),
        "route": st.none() | st.just("pinned"),
        "refresh": st.booleans(),
        "owner": st.none() | st.just("a1"),
    },
    Target: {
        "provider": st.just("p1"),
        "provider_kind": st.sampled_from(["managed", "unlimited"]),
        "endpoint": st.just("e1"),
        "url": st.just("http://e1"),
        "upstream_model": st.just("m"),
        "priority": st.none() | st.integers(0, 9),
    },
}


@st.composite
def messages(draw: st.DrawFn) -> tuple[type[BaseModel], dict]:
    cls = draw(st.sampled_from(sorted(VALUES, key=lambda c: c.__name__)))
    names = draw(st.lists(st.sampled_from(sorted(VALUES[cls])), unique=True))
    return cls, {name: draw(VALUES[cls][name]) for name in draw(st.permutations(names))}


@given(messages())
def test_trusted_builds_what_model_construct_builds(drawn: tuple[type[BaseModel], dict]):
    cls, values = drawn
    fast, slow = trusted(cls, **values), cls.model_construct(**values)  # type: ignore[type-var]
    assert fast == slow
    assert fast.model_fields_set == slow.model_fields_set == set(values)
    assert fast.model_dump_json() == slow.model_dump_json()
    assert fast.model_dump_json(exclude_defaults=True) == slow.model_dump_json(
        exclude_defaults=True
    )
    assert repr(fast) == repr(slow)


def test_every_message_is_built_by_trusted_or_refused():
    """Every wire message class either builds as model_construct does, or is refused by name
    (a mutable default would be shared between messages: StateReply's dict)."""
    classes = [
        c
        for c in vars(wire).values()
        if inspect.isclass(c) and issubclass(c, wire._Message) and c is not wire._Message
    ]
    assert len(classes) > 10
    refused = set()
    for cls in classes:
        try:
            assert trusted(cls) == cls.model_construct()
        except TypeError as exc:
            assert cls.__name__ in str(exc) and "use model_construct" in str(exc)
            refused.add(cls.__name__)
    assert refused <= {"StateReply"}
    with pytest.raises(TypeError, match="mutable default"):
        trusted(wire.StateReply, instance="a1", shards=(), pairs=())


def test_a_sub_agents_parent_travels_and_peers_before_it_still_understand_each_other():
    """`AdmitRequest.parent` and a pin's `parent` in a handover are optional: a message of an
    edge or instance before them decodes with none, and theirs with it decode where it is
    ignored (receivers ignore unknown fields)."""
    asked = AdmitRequest(id="a1", edge="e", model="m1", feature="chat", shard=2, session="c")
    old = asked.model_dump_json(exclude_none=True)
    assert "parent" not in old and AdmitRequest.model_validate_json(old).parent is None
    child = asked.model_copy(update={"parent": "root"})
    assert AdmitRequest.model_validate_json(child.model_dump_json()).parent == "root"
    pin = PinRecord("pin.2.mk.c", "p1", "iris", "m1", "c", 2, 1.0, 1.0, 1.0, 1.0, parent="root")
    handover = Handover(source="a", state=ShardState(2, (pin,), ()))
    assert Handover.model_validate_json(handover.model_dump_json()).state.pins[0].parent == "root"
    before = handover.model_dump_json().replace(',"parent":"root"', "")
    assert '"parent"' not in before
    assert Handover.model_validate_json(before).state.pins[0].parent is None
