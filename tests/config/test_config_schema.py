"""The schema: defaults, field validation, cross-field checks (each naming its field) and lookups."""

import copy
import warnings

import pytest

from llmgw.config import Config, ConfigError, ConfigWarning, config_from_dict

NO_ENV: dict[str, str] = {}


def sample() -> dict:
    """A small valid config: one managed and one unlimited provider, two models."""
    return {
        "models": [
            {"name": "big", "aliases": ["b"], "fallbacks": ["small"], "routing_profile": "chat"},
            {"name": "small", "aliases": ["s"], "routing_profile": "batch"},
        ],
        "providers": [
            {
                "id": "third",
                "kind": "unlimited",
                "priority": 500,
                "models": [{"name": "big"}, {"name": "small"}],
            },
            {"id": "ours-b", "kind": "managed", "priority": 10, "models": [{"name": "big"}]},
            {
                "id": "ours-a",
                "kind": "managed",
                "priority": 100,
                "models": [
                    {
                        "name": "big",
                        "features": ["chat", "completions", "embeddings"],
                        "limits": {
                            "max_pinned_sessions": 10,
                            "max_global_in_flight_request_slots": 8,
                            "global_in_flight_request_slots_reserved_for_pinned_sessions": 2,
                            "max_per_session_in_flight_request_slots": 1,
                        },
                    },
                    {"name": "small"},
                ],
            },
            {"id": "fourth", "kind": "unlimited", "priority": 500, "models": [{"name": "small"}]},
        ],
        "endpoints": [
            {
                "id": "a-1",
                "url": "http://127.0.0.1:8101",
                "provider": "ours-a",
                "models": ["big", "small"],
            },
            {
                "id": "a-2",
                "url": "http://127.0.0.1:8102/",
                "provider": "ours-a",
                "models": ["big"],
                "priority": 200,
                "upstream_model": {"big": "org/Big-Instruct"},
            },
            {"id": "b-1", "url": "https://b.example", "provider": "ours-b", "models": ["big"]},
            {
                "id": "t-1",
                "url": "https://t.example:8443",
                "provider": "third",
                "models": ["big", "small"],
            },
            {"id": "f-1", "url": "http://f.example:80", "provider": "fourth", "models": ["small"]},
        ],
    }


def build(data: dict) -> Config:
    return config_from_dict(data, source="test.yaml", env=NO_ENV)


def problems_of(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        build(data)
    assert all(line.startswith("test.yaml: ") for line in caught.value.lines)
    return caught.value.problems


def test_defaults_follow_the_spec():
    config = build(sample())
    assert (config.listen_host, config.listen_port) == ("127.0.0.1", 8080)
    assert (config.admin_host, config.admin_port) == ("127.0.0.1", 9090)
    assert (
        config.nats.url == "embedded"
        and config.nats.is_embedded
        and config.nats.embedded_port == 4222
    )
    assert (config.nats.connect_timeout, config.nats.request_timeout) == (2.0, 1.0)
    router = config.router
    assert (router.scrape_interval, router.scrape_timeout, router.stale_after) == (2.0, 1.0, 10.0)
    assert (router.retries, router.cooldown, router.failure_threshold) == (2, 15.0, 3)
    assert (router.default_profile, router.session_header) == ("chat", "x-session-id")
    assert router.inject_usage is True and router.max_body_bytes == 33554432
    t = config.timeouts
    assert (t.dial, t.response_header, t.first_token, t.idle, t.total) == (5, 60, 120, 60, 1800)
    assert set(config.profiles) == {"chat", "batch", "long-context", "debug"}
    assert [(b.name, b.priority, b.saturation_ceiling) for b in config.admission.bands] == [
        ("platinum", 400, 1.0),
        ("gold", 300, 0.85),
        ("silver", 200, 0.6),
        ("bronze", 100, 0.3),
    ]
    assert config.admission.default_band == "gold" and config.admission.interval == 0.01
    assert (config.admission.queue_ttl, config.admission.queue_capacity_per_band) == (30.0, 2000)
    assert config.scoring.model_dump() == {
        "target_waiting": 4,
        "target_inflight": 8,
        "kv_ceiling": 0.9,
        "session_load_factor": 1.25,
    }
    assert config.pinning.model_dump() == {
        "pin_inactivity_timeout": 300.0,
        "lease_timeout": 30.0,
        "bucket": "llmgw_routing",
        "storage": "file",
        "replicas": None,
        "history": 1,
        "reaper_interval": 1.0,
        "min_idle_before_evict": 60.0,
        "return_home": True,
        "return_home_after": 30.0,
        "return_home_saturation": 0.5,
        "parent_weight": 1.0,
    }
    assert config.balancer.model_dump() == {
        "window": 120.0,
        "input_to_output_token_ratio": 250,
        "greediness": 0.5,
        "max_exploring": 1,
    }
    assert config.providers[0].models[0].features == ["chat", "completions"]
    assert config.endpoints[0].pool == "default" and config.endpoints[0].weight == 100


def test_profile_presets_resolve_against_router_and_timeouts():
    config = build(sample())
    chat = config.resolve_profile("chat")
    assert chat.retries == 2 and chat.timeouts == config.timeouts
    batch = config.resolve_profile("batch")
    assert (
        batch.retries,
        batch.timeouts.first_token,
        batch.timeouts.total,
        batch.timeouts.idle,
    ) == (4, 600.0, 7200.0, 60.0)
    long_context = config.resolve_profile("long-context")
    assert (
        long_context.retries,
        long_context.timeouts.first_token,
        long_context.timeouts.idle,
    ) == (2, 300.0, 120.0)
    assert config.resolve_profile("debug").retries == 0
    assert config.resolve_profile().name == "chat"
    assert config.profile_for_model("s").name == "batch"


def test_profiles_in_the_file_merge_over_presets_and_may_add_new_ones():
    data = sample()
    data["profiles"] = {"batch": {"retries": 9}, "nightly": {"timeouts": {"total": "8h"}}}
    data["timeouts"] = {"total": "45m"}
    config = build(data)
    batch = config.resolve_profile("batch")
    assert (batch.retries, batch.timeouts.first_token) == (9, 600.0)
    nightly = config.resolve_profile("nightly")
    assert (nightly.retries, nightly.timeouts.total, nightly.timeouts.dial) == (2, 28800.0, 5.0)
    assert config.resolve_profile("chat").timeouts.total == 2700.0


def test_lookups_resolve_names_aliases_priorities_and_endpoints():
    config = build(sample())
    assert config.resolve_model("b") == "big" and config.resolve_model("big") == "big"
    assert config.resolve_model("nope") is None
    assert config.public_model_ids() == ["big", "b", "small", "s"]
    assert [p.id for p in config.providers_in_priority_order()] == [
        "ours-a",
        "ours-b",
        "third",
        "fourth",
    ]
    assert [e.id for e in config.endpoints_for("ours-a", "b")] == ["a-2", "a-1"]
    assert [e.id for e in config.endpoints_for("ours-a", "small")] == ["a-1"]
    assert config.endpoints_for("third", "unknown") == []
    assert config.provider("ours-a").model("big").limits.max_global_in_flight_request_slots == 8
    assert config.provider("ours-a").model("missing") is None
    with pytest.raises(KeyError):
        config.provider("nope")
    a2 = config.endpoint("a-2")
    assert a2.url == "http://127.0.0.1:8102" and (a2.host, a2.port) == ("127.0.0.1", 8102)
    assert (
        a2.upstream_name("big") == "org/Big-Instruct"
        and config.endpoint("a-1").upstream_name("big") == "big"
    )
    assert config.endpoint("b-1").port == 443 and config.endpoint("f-1").port == 80


def mutate(**changes):
    """A sample() with `path=value` changes applied; paths use "." and integer indices."""
    data = sample()
    for dotted, value in changes.items():
        target = data
        *parents, last = [int(p) if p.isdigit() else p for p in dotted.split("__")]
        for part in parents:
            target = target[part]
        target[last] = value
    return data


BAD = [
    (
        "reserved-above-global",
        mutate(
            providers__2__models__0__limits__global_in_flight_request_slots_reserved_for_pinned_sessions=9
        ),
        "providers[2].models[0].limits.global_in_flight_request_slots_reserved_for_pinned_sessions",
        "exceed",
    ),
    ("duplicate-model", mutate(models__1__name="big"), "models[1].name", "duplicate model name"),
    (
        "alias-is-a-model-name",
        mutate(models__1__aliases=["big"]),
        "models[1].aliases[0]",
        "model name",
    ),
    ("alias-used-twice", mutate(models__1__aliases=["b"]), "models[1].aliases[0]", "already used"),
    (
        "unknown-fallback",
        mutate(models__0__fallbacks=["huge"]),
        "models[0].fallbacks[0]",
        "unknown model",
    ),
    (
        "self-fallback-by-alias",
        mutate(models__0__fallbacks=["b"]),
        "models[0].fallbacks[0]",
        "itself",
    ),
    (
        "unknown-routing-profile",
        mutate(models__0__routing_profile="fast"),
        "models[0].routing_profile",
        "unknown profile",
    ),
    (
        "unknown-default-profile",
        mutate(router={"default_profile": "fast"}),
        "router.default_profile",
        "unknown profile",
    ),
    (
        "unknown-default-band",
        mutate(admission={"default_band": "iron"}),
        "admission.default_band",
        "unknown band",
    ),
    (
        "duplicate-band-name",
        mutate(
            admission={
                "default_band": "x",
                "bands": [
                    {"name": "x", "priority": 1, "saturation_ceiling": 1},
                    {"name": "x", "priority": 2, "saturation_ceiling": 1},
                ],
            }
        ),
        "admission.bands[1].name",
        "duplicate band name",
    ),
    (
        "duplicate-band-priority",
        mutate(
            admission={
                "default_band": "x",
                "bands": [
                    {"name": "x", "priority": 1, "saturation_ceiling": 1},
                    {"name": "y", "priority": 1, "saturation_ceiling": 1},
                ],
            }
        ),
        "admission.bands[1].priority",
        "duplicate band priority",
    ),
    (
        "zero-ceiling",
        mutate(admission={"bands": [{"name": "gold", "priority": 1, "saturation_ceiling": 0}]}),
        "admission.bands[0].saturation_ceiling",
        "greater than 0",
    ),
    (
        "unknown-provider",
        mutate(endpoints__0__provider="ghost"),
        "endpoints[0].provider",
        "unknown provider",
    ),
    (
        "endpoint-model-unknown",
        mutate(endpoints__3__models=["big", "small", "tiny"]),
        "endpoints[3].models[2]",
        "unknown model",
    ),
    (
        "endpoint-model-is-alias",
        mutate(endpoints__3__models=["b", "small"]),
        "endpoints[3].models[0]",
        "alias",
    ),
    (
        "endpoint-model-not-served-by-provider",
        mutate(endpoints__2__models=["big", "small"]),
        "endpoints[2].models[1]",
        "does not serve",
    ),
    (
        "provider-model-unknown",
        mutate(providers__1__models=[{"name": "big"}, {"name": "tiny"}]),
        "providers[1].models[1].name",
        "unknown model",
    ),
    (
        "provider-model-is-alias",
        mutate(providers__1__models=[{"name": "b"}]),
        "providers[1].models[0].name",
        "alias",
    ),
    (
        "duplicate-provider-id",
        mutate(providers__3__id="third"),
        "providers[3].id",
        "duplicate provider id",
    ),
    (
        "duplicate-endpoint-id",
        mutate(endpoints__1__id="a-1"),
        "endpoints[1].id",
        "duplicate endpoint id",
    ),
    (
        "provider-id-not-a-slug",
        mutate(providers__0__id="Third Party"),
        "providers[0].id",
        "pattern",
    ),
    ("endpoint-id-not-a-slug", mutate(endpoints__0__id="a.1"), "endpoints[0].id", "pattern"),
    (
        "bad-kind",
        mutate(providers__0__kind="free"),
        "providers[0].kind",
        "'managed' or 'unlimited'",
    ),
    (
        "bad-feature",
        mutate(providers__0__models__0__features=["images"]),
        "providers[0].models[0].features[0]",
        "chat",
    ),
    ("ftp-url", mutate(endpoints__0__url="ftp://x:1"), "endpoints[0].url", "http"),
    ("zero-weight", mutate(endpoints__0__weight=0), "endpoints[0].weight", "greater than 0"),
    (
        "rename-of-unlisted-model",
        mutate(endpoints__0__upstream_model={"other": "x"}),
        "endpoints[0].upstream_model.other",
        "does not list",
    ),
    ("no-models", mutate(models=[]), "models", "at least 1"),
    (
        "negative-retries",
        mutate(router={"retries": -1}),
        "router.retries",
        "greater than or equal to 0",
    ),
    (
        "zero-failure-threshold",
        mutate(router={"failure_threshold": 0}),
        "router.failure_threshold",
        "1",
    ),
    ("tiny-body-limit", mutate(router={"max_body_bytes": 100}), "router.max_body_bytes", "1024"),
    ("zero-timeout", mutate(timeouts={"idle": "0s"}), "timeouts.idle", "greater than 0"),
    (
        "garbage-duration",
        mutate(router={"cooldown": "soon"}),
        "router.cooldown",
        "expected a duration",
    ),
    ("negative-window", mutate(balancer={"window": -1}), "balancer.window", "negative"),
    ("greediness-above-one", mutate(balancer={"greediness": 1.5}), "balancer.greediness", "1"),
    ("kv-ceiling-above-one", mutate(scoring={"kv_ceiling": 1.2}), "scoring.kv_ceiling", "1"),
    (
        "session-load-factor-below-one",
        mutate(scoring={"session_load_factor": 0.5}),
        "scoring.session_load_factor",
        "1",
    ),
    (
        "zero-shards",
        mutate(admission={"shards": 0}),
        "admission.shards",
        "1",
    ),
    ("bad-listen", mutate(listen="localhost"), "listen", "host:port"),
    ("bad-nats-url", mutate(nats={"url": "http://h:4222"}), "nats.url", "nats://"),
    ("two-node-cluster", mutate(nats={"embedded_cluster": 2}), "nats.embedded_cluster", "3"),
    ("zero-replicas", mutate(nats={"replicas": 0}), "nats.replicas", "1"),
    ("typo-at-top", mutate(rooter={}), "rooter", "did you mean 'router'"),
    ("typo-nested", mutate(router={"retires": 1}), "router.retires", "did you mean 'retries'"),
    (
        "typo-deep",
        mutate(providers__2__models__0__limits__max_pinned=1),
        "providers[2].models[0].limits",
        "unknown field",
    ),
]


@pytest.mark.parametrize(
    ("data", "path", "fragment"), [case[1:] for case in BAD], ids=[c[0] for c in BAD]
)
def test_invalid_configs_name_the_field(data, path, fragment):
    problems = problems_of(data)
    matching = [p for p in problems if p.startswith(f"{path}") and fragment in p]
    assert matching, problems


def test_a_fleet_that_starts_empty_or_leaves_a_pair_unserved_loads_with_a_warning_naming_it():
    """The file's endpoints only seed the live fleet: none at all (every engine joins at run
    time), or none for a pair, is valid; each pair nobody serves yet is named in a warning."""
    for data, where in (
        (mutate(endpoints__4__provider="third"), "providers[3].models[0].name"),
        ({k: v for k, v in sample().items() if k != "endpoints"}, "providers[0].models[0].name"),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConfigWarning)
            build(data)
        said = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
        assert any(m.startswith(f"{where}: no endpoint in this file serves") for m in said), said


def test_replicas_come_from_nats_replicas_unless_pinning_overrides_the_routing_bucket():
    config = build(mutate(nats={"replicas": 3}))
    assert config.replicas_of(config.pinning.bucket) == 3
    assert config.replicas_of(config.router.load_bucket) == 3
    config = build(mutate(nats={"replicas": 3}, pinning={"replicas": 1}))
    assert config.replicas_of(config.pinning.bucket) == 1
    assert config.replicas_of(config.router.load_bucket) == 3


def test_every_cross_reference_problem_is_reported_at_once():
    data = mutate(
        models__0__fallbacks=["huge"], endpoints__0__provider="ghost", endpoints__1__id="a-1"
    )
    problems = problems_of(data)
    assert any(p.startswith("models[0].fallbacks[0]") for p in problems)
    assert any(p.startswith("endpoints[0].provider") for p in problems)
    assert any(p.startswith("endpoints[1].id") for p in problems)


@pytest.mark.parametrize(
    ("greediness", "warns"),
    [(0.1, "round-robin"), (0.99, "local maximum"), (0.5, None), (0.2, None), (0.95, None)],
)
def test_extreme_greediness_warns(greediness, warns):
    data = mutate(balancer={"greediness": greediness})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build(data)
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    if warns is None:
        assert messages == []
    else:
        assert len(messages) == 1 and warns in messages[0]


def test_engine_and_provider_simulate_blocks_validate_against_the_simulator_params():
    params = pytest.importorskip("llmgw.services.sim.params")
    data = sample()
    data["endpoints"][0]["simulate"] = {"kind": "engine", "max_num_seqs": 4, "itl_base": "5ms"}
    data["endpoints"][3]["simulate"] = {"kind": "provider", "tokens_per_second": 30}
    config = build(data)
    engine, provider = config.endpoints[0].simulate, config.endpoints[3].simulate
    assert isinstance(engine, params.EngineParams) and engine.max_num_seqs == 4
    assert engine.itl_base == pytest.approx(0.005)
    assert isinstance(provider, params.ProviderParams) and provider.tokens_per_second == 30
    assert config.endpoints[1].simulate is None


@pytest.mark.parametrize(
    ("simulate", "path", "fragment"),
    [
        ({"max_num_seqs": 4}, "endpoints[0].simulate.kind", "kind: engine"),
        ({"kind": "gpu"}, "endpoints[0].simulate.kind", "kind: engine"),
        ({"kind": "engine", "max_num_seqz": 4}, "endpoints[0].simulate.max_num_seqz", "unknown"),
        (
            {"kind": "engine", "max_num_seqs": "many"},
            "endpoints[0].simulate.max_num_seqs",
            "'many'",
        ),
    ],
)
def test_invalid_simulate_blocks_name_the_parameter(simulate, path, fragment):
    pytest.importorskip("llmgw.services.sim.params")
    data = sample()
    data["endpoints"][0]["simulate"] = simulate
    problems = problems_of(data)
    assert any(p.startswith(path) and fragment in p for p in problems), problems


def test_simulated_endpoint_needs_an_explicit_port():
    pytest.importorskip("llmgw.services.sim.params")
    data = sample()
    data["endpoints"][2]["simulate"] = {"kind": "engine"}
    assert any(p.startswith("endpoints[2].url") and "port" in p for p in problems_of(data))


def test_building_does_not_mutate_the_input():
    data = sample()
    data["profiles"] = {"batch": {"retries": 1}}
    before = copy.deepcopy(data)
    build(data)
    assert data == before


def test_agent_session_headers_are_recognised_by_default_in_a_fixed_order():
    rules = build(sample()).router.session_rules()
    assert [(r.header, r.agent, r.parent) for r in rules] == [
        ("x-session-id", None, "x-parent-session-id"),
        ("x-claude-code-session-id", "x-claude-code-agent-id", "x-claude-code-parent-agent-id"),
        ("session-id", "thread-id", "x-codex-parent-thread-id"),
        ("session_id", None, None),
    ]
    assert build(sample()).pinning.parent_weight == 1.0


def test_session_headers_can_be_extended_reordered_or_turned_off():
    data = sample()
    data["router"] = {
        "session_header": "X-Conversation",
        "session_headers": [{"header": "X-Agent-Session", "agent": "X-Agent-Id"}],
    }
    assert [(r.header, r.agent) for r in build(data).router.session_rules()] == [
        ("x-conversation", None),
        ("x-agent-session", "x-agent-id"),
    ]
    data["router"] = {"session_headers": []}
    assert [r.header for r in build(data).router.session_rules()] == ["x-session-id"]
    env = {"LLMGW_ROUTER__SESSION_HEADERS": "[]"}
    config = config_from_dict(sample(), source="test.yaml", env=env)
    assert config.router.session_headers == []


def test_bad_session_header_rules_are_refused_naming_the_field():
    data = sample()
    data["router"] = {"session_headers": [{"header": "x-a"}, {"header": "X-A"}]}
    assert any("two rules for the session header 'x-a'" in p for p in problems_of(data))
    data["router"] = {"session_headers": [{"header": "x-a", "parent": "x-a"}]}
    assert any("names one header twice" in p for p in problems_of(data))
    data["router"] = {"session_headers": [{"header": "not a header"}]}
    assert any("router.session_headers[0].header" in p for p in problems_of(data))
    data["router"] = {"session_headers": [{"agent": "x-b"}]}
    assert any("router.session_headers[0].header" in p for p in problems_of(data))
    data["router"] = {}
    data["pinning"] = {"parent_weight": -1}
    assert any("pinning.parent_weight" in p for p in problems_of(data))
