"""The live fleet's pure decisions: which endpoints take new work, when one may be removed."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.fleet import (
    EndpointState,
    FleetView,
    HeartbeatVerdict,
    RemoveVerdict,
    ServedModel,
    heard,
    heartbeat_verdict,
    match_served,
    placeable,
    remove_verdict,
    seed_missing,
    served_change,
    served_models,
    slice_endpoints,
)

ids = st.lists(st.sampled_from([f"e{i}" for i in range(8)]), unique=True)
states = st.sampled_from(list(EndpointState))


@given(st.dictionaries(st.sampled_from([f"e{i}" for i in range(8)]), states), ids)
def test_only_active_endpoints_of_the_fleet_take_new_work_in_the_given_order(table, asked):
    view = FleetView(table)
    chosen = placeable(view, asked)
    assert chosen == [e for e in asked if table.get(e) is EndpointState.ACTIVE]
    assert not set(chosen) & view.draining


@given(states, st.integers(0, 50), st.booleans())
def test_an_endpoint_is_removed_only_drained_and_empty_unless_forced(state, leases, force):
    verdict = remove_verdict(state, leases, force=force)
    if force:
        assert verdict is RemoveVerdict.REMOVE
    elif state is EndpointState.ACTIVE:
        assert verdict is RemoveVerdict.NOT_DRAINING
    else:
        assert verdict is (RemoveVerdict.REMOVE if leases == 0 else RemoveVerdict.LEASES_LEFT)


def test_an_endpoint_the_fleet_does_not_hold_cannot_be_removed():
    assert remove_verdict(None, 0, force=True) is RemoveVerdict.UNKNOWN


@given(ids, ids)
def test_seeding_writes_exactly_the_configured_endpoints_the_fleet_lacks(configured, live):
    missing = seed_missing(configured, live)
    assert missing == [e for e in configured if e not in live]


@given(
    states,
    st.floats(0, 200),
    st.floats(0.1, 30),
    st.one_of(st.none(), st.integers(0, 5)),
)
def test_a_silent_registration_is_drained_after_its_ttl_and_removed_only_drained_and_empty(
    state, silent, ttl, leases
):
    verdict = heartbeat_verdict(state, silent, ttl, leases)
    if silent <= ttl:
        assert verdict is HeartbeatVerdict.KEEP
    elif state is EndpointState.ACTIVE:
        assert verdict is HeartbeatVerdict.DRAIN
    if verdict is HeartbeatVerdict.REMOVE:
        assert state is EndpointState.DRAINING and leases == 0 and silent > 2 * ttl


endpoint_ids = st.sampled_from([f"e{i}" for i in range(6)])


@given(
    st.dictionaries(endpoint_ids, st.tuples(st.integers(0, 3), st.floats(0, 100))),
    st.dictionaries(endpoint_ids, st.integers(0, 3)),
    st.floats(100, 200),
)
def test_an_endpoint_is_heard_when_its_heartbeat_changes_or_is_first_seen(previous, tokens, now):
    """Silence counts from the caller's own reading: a token seen before keeps the time it
    was first seen, a new token or a new endpoint is heard now, a gone endpoint is forgotten."""
    got = heard(previous, tokens, now)
    assert set(got) == set(tokens)
    for endpoint, token in tokens.items():
        kept = previous.get(endpoint)
        expected = kept if kept is not None and kept[0] == token else (token, now)
        assert got[endpoint] == expected


VLLM_MODELS = {
    "object": "list",
    "data": [
        {"id": "meta-llama/Llama-3.3-70B-Instruct", "object": "model", "parent": None},
        {"id": "sql-lora", "object": "model", "parent": "meta-llama/Llama-3.3-70B-Instruct"},
        {"id": "qwen2.5-32b", "object": "model", "root": "Qwen/Qwen2.5-32B"},
        {"object": "model"},  # no id: not a served name
    ],
}
CANONICAL = {
    "llama-3.3-70b": "llama-3.3-70b",
    "meta-llama/Llama-3.3-70B-Instruct": "llama-3.3-70b",  # an alias in the config
    "qwen2.5-32b": "qwen2.5-32b",
    "sql": "sql",
    "sql-lora": "sql",
}


def test_a_vllm_model_list_with_a_lora_adapter_maps_onto_the_configs_models_and_aliases():
    served = served_models(VLLM_MODELS)
    assert ServedModel("sql-lora", "meta-llama/Llama-3.3-70B-Instruct") in served
    found = match_served(served, CANONICAL, ["llama-3.3-70b", "qwen2.5-32b", "sql"])
    assert found.models == ("llama-3.3-70b", "qwen2.5-32b", "sql")
    assert found.upstream_model == {
        "llama-3.3-70b": "meta-llama/Llama-3.3-70B-Instruct",
        "sql": "sql-lora",
    }
    only_llama = match_served(served, CANONICAL, ["llama-3.3-70b"])
    assert [s.id for s in only_llama.unmatched] == ["qwen2.5-32b", "sql-lora"]
    assert served_models({"error": "nope"}) == [] and served_models([1, 2]) == []


names = st.sampled_from(["a", "b", "c", "d", "x/a", "x/b"])


@given(
    st.lists(st.builds(ServedModel, names, st.one_of(st.none(), names))),
    st.dictionaries(names, st.sampled_from(["a", "b", "c"])),
    st.lists(st.sampled_from(["a", "b", "c"]), unique=True),
)
def test_discovered_models_are_offered_and_each_reached_by_a_name_the_engine_serves(
    served, canonical, offered
):
    found = match_served(served, canonical, offered)
    ids = {s.id for s in served}
    assert set(found.models) <= set(offered)
    for model in found.models:
        upstream = found.upstream_model.get(model, model)
        assert upstream in ids and canonical.get(upstream) == model
    assert all(canonical.get(s.id) not in found.models for s in found.unmatched)


def test_an_adapter_loaded_then_unloaded_is_followed_and_a_hand_rename_stays_while_served():
    canonical = {**CANONICAL, "llama": "llama-3.3-70b"}
    offered = ["llama-3.3-70b", "sql"]
    base = [ServedModel("llama", None)]
    lora = [*base, ServedModel("sql-lora", "llama")]
    assert (
        served_change(["llama-3.3-70b"], {"llama-3.3-70b": "llama"}, base, canonical, offered)
        is None
    )
    loaded = served_change(["llama-3.3-70b"], {"llama-3.3-70b": "llama"}, lora, canonical, offered)
    assert loaded is not None and loaded.models == ("llama-3.3-70b", "sql")
    assert loaded.upstream_model == {"llama-3.3-70b": "llama", "sql": "sql-lora"}
    unloaded = served_change(loaded.models, loaded.upstream_model, base, canonical, offered)
    assert unloaded is not None and unloaded.models == ("llama-3.3-70b",)
    assert unloaded.upstream_model == {"llama-3.3-70b": "llama"}
    # An engine listing nothing of ours (restarting, or emptied for a moment) keeps its models.
    assert served_change(["llama-3.3-70b"], {}, [], canonical, offered) is None
    assert served_change(["llama-3.3-70b"], {}, [ServedModel("gpt-9")], canonical, offered) is None
    # A rename given by hand to a name the engine serves is kept over the alias it matched by.
    both = [ServedModel("llama"), ServedModel("meta-llama/Llama-3.3-70B-Instruct")]
    hand = {"llama-3.3-70b": "meta-llama/Llama-3.3-70B-Instruct"}
    assert served_change(["llama-3.3-70b"], hand, both, canonical, offered) is None


def test_a_kept_upstream_name_that_an_applied_config_moved_to_another_model_is_not_kept():
    """The engine serves two adapters; `sql-lora` was sql's alias and `chat-lora` chat's. An
    applied config swaps the aliases: each model now goes upstream under its new alias, not
    under the name that reaches the other model."""
    served = [ServedModel("llama"), ServedModel("sql-lora", "llama"), ServedModel("chat-lora")]
    offered = ["sql", "chat"]
    record = {"sql": "sql-lora", "chat": "chat-lora"}
    before = {"sql-lora": "sql", "chat-lora": "chat", "sql": "sql", "chat": "chat"}
    assert served_change(["sql", "chat"], record, served, before, offered) is None
    swapped = {"sql-lora": "chat", "chat-lora": "sql", "sql": "sql", "chat": "chat"}
    moved = served_change(["sql", "chat"], record, served, swapped, offered)
    assert moved is not None and moved.models == ("sql", "chat")
    assert moved.upstream_model == {"sql": "chat-lora", "chat": "sql-lora"}
    # A hand rename to a name the config does not know stays (it reaches no other model).
    hand = {"sql": "sql-v2", "chat": "chat-lora"}
    listed = [*served, ServedModel("sql-v2", "llama")]
    assert served_change(["sql", "chat"], hand, listed, before, offered) is None


def test_models_served_by_adapters_unloaded_while_their_base_is_listed_are_left():
    """Only adapters of ours on a base that is none of ours: once unloaded the engine lists
    nothing of ours, and its base still listed says they left (not a restart: an empty list, or
    another base, keeps them)."""
    canonical = {"sql": "sql", "sql-lora": "sql", "chat": "chat", "llama": "llama"}
    offered = ["sql", "chat", "llama"]
    loaded = [ServedModel("base-x"), ServedModel("sql-lora", "base-x"), ServedModel("chat")]
    found = match_served(loaded, canonical, offered)
    assert found.models == ("sql", "chat") and found.adapters == {"sql": "base-x"}
    record = (["sql"], {"sql": "sql-lora"}, {"sql": "base-x"})
    gone = served_change(*record[:2], [ServedModel("base-x")], canonical, offered, record[2])
    assert gone is not None and gone.models == () and gone.adapters == {}
    for listed in ([], [ServedModel("base-y")]):
        assert served_change(*record[:2], listed, canonical, offered, record[2]) is None
    assert served_change(*record[:2], [ServedModel("base-x")], canonical, offered) is None
    # One of two gone: the other (its base renamed meanwhile) is kept as it was.
    two = (["sql", "llama"], {"sql": "sql-lora", "llama": "base-z"}, {"sql": "base-x"})
    left = served_change(*two[:2], [ServedModel("base-x")], canonical, offered, two[2])
    assert left is not None and left.models == ("llama",)
    assert left.upstream_model == {"llama": "base-z"} and left.adapters == {}


@given(
    st.lists(st.builds(ServedModel, names, st.one_of(st.none(), names))),
    st.dictionaries(names, st.sampled_from(["a", "b", "c"])),
    st.lists(st.sampled_from(["a", "b", "c"]), unique=True),
    st.lists(st.sampled_from(["a", "b", "c"]), unique=True),
    st.dictionaries(st.sampled_from(["a", "b", "c"]), names),
)
def test_following_an_engines_list_serves_what_it_lists_and_settles_after_one_change(
    served, canonical, offered, models, upstream
):
    upstream = {m: n for m, n in upstream.items() if m in models}
    change = served_change(models, upstream, served, canonical, offered)
    found = match_served(served, canonical, offered)
    if change is None:  # nothing of ours is served, or the record says what is served
        assert not found.models or list(found.models) == list(models)
        return
    ids = {s.id for s in served}
    assert change.models and set(change.models) <= set(offered)
    assert change.models == found.models
    for model in change.models:
        assert change.upstream_model.get(model, model) in ids  # reached by a served name
        # never under a name the config gives another model
        assert canonical.get(change.upstream_model.get(model, model), model) == model
    assert set(change.upstream_model) <= set(change.models)
    assert served_change(change.models, change.upstream_model, served, canonical, offered) is None


def test_an_endpoint_slices_ready_engines_become_urls_by_pod_name():
    obj = {
        "metadata": {"name": "vllm-abc"},
        "addressType": "IPv6",
        "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
        "endpoints": [
            {"addresses": ["fd00::7"], "targetRef": {"name": "vLLM.0"}},  # ready unset: ready
            {"addresses": ["fd00::8"], "conditions": {"ready": False}},
            {"addresses": ["fd00::9"], "conditions": {"ready": True, "terminating": True}},
            {"addresses": [], "conditions": {"ready": True}},
        ],
    }
    assert slice_endpoints(obj, port_name="http", id_prefix="k8s") == {
        "k8s-vllm-0": "http://[fd00::7]:8000"
    }
    assert slice_endpoints(obj, port_name=None, id_prefix="k8s") == {
        "k8s-vllm-0": "http://[fd00::7]:9000"
    }
    assert slice_endpoints(obj, port_name="grpc", id_prefix="k8s") == {}
