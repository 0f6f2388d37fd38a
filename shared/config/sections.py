"""Settings sections of the config: NATS, router, timeouts, profiles, admission, scoring, pinning,
balancer. Each section validates itself; references between sections are checked in `references`."""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_serializer,
    field_validator,
    model_validator,
)

from llmgw.config.common import MASK, ConfigWarning, Name, StrictModel, fail
from llmgw.config.durations import Duration, PositiveDuration
from llmgw.core.sessions import SessionRule, session_rules

# --- NATS -----------------------------------------------------------------------------------------


class NatsTls(StrictModel):
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify: bool = True


# The largest embedded cluster `llmgw up` starts (JetStream keeps at most 5 replicas per stream).
MAX_EMBEDDED_CLUSTER = 7


class NatsConfig(StrictModel):
    """How services reach the NATS mesh; "embedded" means `llmgw up` starts a server itself."""

    url: str = "embedded"
    embedded_port: int = Field(4222, ge=0, le=65535)
    # Servers `llmgw up` starts when url is "embedded": 1, or a JetStream cluster of 3 or more
    # (a Raft majority must survive losing one). Node i listens on embedded_port + i.
    embedded_cluster: int = Field(1, ge=1, le=MAX_EMBEDDED_CLUSTER)
    store_dir: str | None = None
    # Replicas of every KV bucket and stream the services create: the one setting that decides
    # them (read through `Config.replicas_of`; `pinning.replicas` may override it for the routing
    # bucket). `llmgw up` with a cluster passes 3 to its services unless this is set.
    replicas: int = Field(1, ge=1, le=5)
    user: str | None = None
    password: SecretStr | None = None
    token: SecretStr | None = None
    creds_file: str | None = None
    nkeys_seed_file: str | None = None
    tls: NatsTls | None = None
    connect_timeout: PositiveDuration = 2.0
    request_timeout: PositiveDuration = 1.0

    @field_validator("embedded_cluster")
    @classmethod
    def _check_cluster_size(cls, size: int) -> int:
        if size == 2:
            raise ValueError(
                "2 servers cannot survive losing one (Raft needs a majority): use 1, or 3 or more"
            )
        return size

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        url = url.strip()
        if url == "embedded":
            return url
        for server in url.split(","):
            scheme, _, rest = server.strip().partition("://")
            if scheme not in ("nats", "tls", "ws", "wss") or not rest:
                raise ValueError(
                    f'expected "embedded" or nats://host:port (comma-separated list allowed), '
                    f"got {server.strip()!r}"
                )
        return url

    @field_serializer("password", "token", when_used="json")
    def _mask(self, secret: SecretStr | None) -> str | None:
        return None if secret is None else MASK

    @property
    def is_embedded(self) -> bool:
        return self.url == "embedded"

    @property
    def servers(self) -> list[str]:
        """The server URLs to connect to (empty when embedded: the caller knows its own port)."""
        return [] if self.is_embedded else [s.strip() for s in self.url.split(",")]


# --- router, timeouts, profiles -------------------------------------------------------------------


# An HTTP header name (RFC 9110 token), compared in lower case.
HeaderName = Annotated[str, Field(pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$", max_length=128)]


class SessionHeaderRule(StrictModel):
    """A session header an agent client sends (docs/config.md, "Session headers"): `header`
    names the session; `agent`, the sub-agent within it that sent the request; `parent`, the
    agent that started that one (with `agent`), or the parent session's own `header` value
    (without it)."""

    header: HeaderName
    agent: HeaderName | None = None
    parent: HeaderName | None = None

    @field_validator("header", "agent", "parent")
    @classmethod
    def _lower(cls, name: str | None) -> str | None:
        return None if name is None else name.lower()

    @model_validator(mode="after")
    def _distinct(self) -> SessionHeaderRule:
        names = [n for n in (self.header, self.agent, self.parent) if n is not None]
        if len(set(names)) != len(names):
            raise ValueError(f"a rule names one header twice: {', '.join(names)}")
        return self

    def rule(self) -> SessionRule:
        return SessionRule(self.header, self.agent, self.parent)


def default_session_headers() -> list[SessionHeaderRule]:
    """The headers today's agent clients send (where each was verified: docs/config.md)."""
    return [
        SessionHeaderRule(header="x-session-id", parent="x-parent-session-id"),  # opencode
        SessionHeaderRule(  # Claude Code
            header="x-claude-code-session-id",
            agent="x-claude-code-agent-id",
            parent="x-claude-code-parent-agent-id",
        ),
        SessionHeaderRule(  # Codex
            header="session-id", agent="thread-id", parent="x-codex-parent-thread-id"
        ),
        SessionHeaderRule(header="session_id"),  # Codex, earlier releases
    ]


class RouterConfig(StrictModel):
    scrape_interval: PositiveDuration = 2.0
    scrape_timeout: PositiveDuration = 1.0
    stale_after: PositiveDuration = 10.0
    retries: int = Field(2, ge=0)
    cooldown: Duration = 15.0
    failure_threshold: int = Field(3, ge=1)
    default_profile: str = "chat"
    session_header: Name = "x-session-id"
    # The session headers agent clients send, tried in this order after `session_header`
    # (`llmgw.core.sessions.session_rules`); empty: `session_header` alone.
    session_headers: list[SessionHeaderRule] = Field(default_factory=default_session_headers)
    inject_usage: bool = True
    max_body_bytes: int = Field(33_554_432, ge=1024)
    # Request headers the edge accepts: how many, and their total size (names + values); more
    # is a 431 (OpenAI-shaped), before anything else is looked at.
    max_header_count: int = Field(100, ge=8)
    max_header_bytes: int = Field(32_768, ge=1024)
    # An edge's stop (SIGTERM): /ready is false but requests are still served for drain_delay
    # (a load balancer notices), then running requests get up to drain_timeout to end before
    # the edge ends them (services/edge/drain.py).
    drain_delay: Duration = 2.0
    drain_timeout: PositiveDuration = 20.0
    # The JetStream KV bucket (memory storage) where the scraper keeps each endpoint's latest
    # load report (llmgw.load).
    load_bucket: str = Field("llmgw_load", pattern=r"^[A-Za-z0-9_-]+$")

    @field_validator("session_headers")
    @classmethod
    def _one_rule_per_header(cls, rules: list[SessionHeaderRule]) -> list[SessionHeaderRule]:
        seen: set[str] = set()
        for rule in rules:
            if rule.header in seen:
                raise ValueError(f"two rules for the session header {rule.header!r}")
            seen.add(rule.header)
        return rules

    def session_rules(self) -> tuple[SessionRule, ...]:
        """Every session header rule in the order the edge tries them."""
        return session_rules(self.session_header, (r.rule() for r in self.session_headers))


class Timeouts(StrictModel):
    """Per-phase bounds on one upstream request; all strictly positive."""

    dial: PositiveDuration = 5.0
    response_header: PositiveDuration = 60.0
    first_token: PositiveDuration = 120.0
    idle: PositiveDuration = 60.0
    total: PositiveDuration = 1800.0


class TimeoutOverrides(StrictModel):
    """A partial `Timeouts`: fields left unset fall back to the top-level `timeouts`."""

    dial: PositiveDuration | None = None
    response_header: PositiveDuration | None = None
    first_token: PositiveDuration | None = None
    idle: PositiveDuration | None = None
    total: PositiveDuration | None = None


class ProfileConfig(StrictModel):
    """A routing profile: a named preset of overrides of `router.retries` and `timeouts`."""

    retries: int | None = Field(None, ge=0)
    timeouts: TimeoutOverrides = Field(default_factory=TimeoutOverrides)


class ResolvedProfile(BaseModel):
    """A profile with every value filled in from the top-level defaults."""

    model_config = ConfigDict(frozen=True)

    name: str
    retries: int
    timeouts: Timeouts


def default_profiles() -> dict[str, dict[str, Any]]:
    """The built-in presets; a config's `profiles` entries are merged over these field by field."""
    return {
        "chat": {},
        "batch": {"retries": 4, "timeouts": {"first_token": "600s", "total": "2h"}},
        "long-context": {"timeouts": {"first_token": "300s", "idle": "120s"}},
        "debug": {"retries": 0},
    }


# --- admission, scoring, pinning, balancer --------------------------------------------------------


class Band(StrictModel):
    """A priority band. `overflow`: when the managed pool is above this band's ceiling, run the
    request on an unlimited (third-party) provider at once instead of waiting in the queue.
    `interactive`: a person waits for it, so it never queues at an engine without a free batch
    slot while another endpoint of the provider has one (it may leave its session's replica for
    that); batch bands keep their replica's prefix cache instead."""

    name: Name
    priority: int
    saturation_ceiling: float = Field(gt=0)
    overflow: bool = False
    interactive: bool = False
    # Batch slots per managed endpoint this band leaves free for the bands above it: it waits
    # while the pool has no more free slots than that (engines do not preempt for urgency).
    batch_headroom: int = Field(0, ge=0)


def default_bands() -> list[Band]:
    return [
        Band(
            name="platinum", priority=400, saturation_ceiling=1.00, overflow=True, interactive=True
        ),
        Band(name="gold", priority=300, saturation_ceiling=0.85, overflow=True, interactive=True),
        Band(name="silver", priority=200, saturation_ceiling=0.60, batch_headroom=1),
        Band(name="bronze", priority=100, saturation_ceiling=0.30, batch_headroom=1),
    ]


class AdmissionConfig(StrictModel):
    enabled: bool = True
    band_header: Name = "x-llmgw-band"
    default_band: str = "gold"
    bands: list[Band] = Field(default_factory=default_bands, min_length=1)
    queue_ttl: PositiveDuration = 30.0
    queue_capacity_per_band: int = Field(2000, ge=1)
    interval: PositiveDuration = 0.01
    # Session shards: a session's requests are decided by the one instance that owns its shard
    # (docs/adr/0002-admission-at-memory-speed.md). The same value in every service of a
    # gateway; changing it needs a new routing bucket.
    shards: int = Field(32, ge=1, le=4096)
    # Admission instances renew their member key this often; one not renewed for member_ttl is
    # dead (its shards and quota move to the others: a crashed instance's sessions wait about
    # this long). It stops deciding max(2 s, 20%) before member_ttl without a renewal, so hosts'
    # clocks must agree to well within that margin. Longer than a NATS leader election (4-9 s),
    # so losing a NATS node does not stop admission.
    heartbeat: PositiveDuration = 1.0
    member_ttl: PositiveDuration = 15.0
    # A new owner of a shard asks the edges for their leases there and waits this long for
    # answers (a crash takeover; a handover carries the leases itself).
    rollcall_window: PositiveDuration = 0.3
    # How often an instance re-checks its quotas against the fair split (and at once on change).
    quota_interval: PositiveDuration = 0.25
    # Seconds a request of a band that overflows waits for a lease to end, when only a
    # provider/model's limits (and no loan) keep it off our engines, before it runs on a third
    # party; 0: at once. Covers the moment a lease's end is on its way to its owner (bands that
    # do not overflow wait in their queue instead, up to queue_ttl). docs/architecture.md,
    # "Held for quota".
    limit_grace: Duration = Field(0.05, ge=0, le=0.5)
    # What an edge does while it cannot reach NATS: `reject` answers 503 with Retry-After at
    # once; `local` serves with conservative local limits (docs/architecture.md, "NATS outage").
    on_nats_outage: Literal["reject", "local"] = "reject"
    # Each edge also runs an admission instance in its own process: the requests for the shards
    # that instance owns are decided there, without a NATS round trip (the others go to their
    # owners over NATS as before). docs/architecture.md, "Colocated admission". On by default
    # (the faster path); off where the edge's NATS user may not write the routing bucket (one
    # NATS user per role: `llmgw up --secure`, compose, Kubernetes), where `llmgw admission`
    # processes decide instead. An edge whose user lacks the grants refuses to start.
    colocated: bool = True
    # The stable name of this admission process, given by the deployment (a StatefulSet pod's
    # name, a single-replica compose service's), usually from the environment
    # (LLMGW_ADMISSION__INSTANCE_NAME): a process restarted under it takes its earlier
    # incarnation's shards and quota over within seconds instead of after member_ttl; one that
    # finds the name in use by a running process refuses to start. None: a new id per start.
    instance_name: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]+$", max_length=100)

    @model_validator(mode="after")
    def _check_bands(self) -> AdmissionConfig:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        names: dict[str, int] = {}
        priorities: dict[int, int] = {}
        for index, band in enumerate(self.bands):
            if band.name in names:
                problems.append(
                    (
                        ("bands", index, "name"),
                        f"duplicate band name {band.name!r} (also bands[{names[band.name]}])",
                    )
                )
            names.setdefault(band.name, index)
            if band.priority in priorities:
                problems.append(
                    (
                        ("bands", index, "priority"),
                        f"duplicate band priority {band.priority} "
                        f"(also bands[{priorities[band.priority]}])",
                    )
                )
            priorities.setdefault(band.priority, index)
        if self.default_band not in names:
            problems.append(
                (
                    ("default_band",),
                    f"unknown band {self.default_band!r}; known bands: {', '.join(names)}",
                )
            )
        fail(problems)
        return self

    def band(self, name: str) -> Band | None:
        return next((band for band in self.bands if band.name == name), None)


class ScoringConfig(StrictModel):
    target_waiting: float = Field(4, gt=0)
    target_inflight: float = Field(8, gt=0)
    kv_ceiling: float = Field(0.9, gt=0, le=1)
    session_load_factor: float = Field(1.25, ge=1)


class PinningConfig(StrictModel):
    pin_inactivity_timeout: PositiveDuration = 300.0
    lease_timeout: PositiveDuration = 30.0
    # The JetStream KV bucket that holds pins and leases (docs/adr/0001-routing-state.md).
    bucket: str = Field("llmgw_routing", pattern=r"^[A-Za-z0-9_-]+$")
    storage: Literal["file", "memory"] = "file"
    # Deprecated: an override of `nats.replicas` for this bucket alone (None: nats.replicas).
    replicas: int | None = Field(None, ge=1, le=5)
    # Revisions kept per key: 1 in production; tests raise it so a recorder never misses one.
    history: int = Field(1, ge=1, le=64)
    # How often each admission instance expires its shards' unrenewed leases and idle pins
    # (its housekeeping round), and how often the reaper sweeps dead members' keys and quota
    # and silent registered endpoints.
    reaper_interval: PositiveDuration = 1.0
    # A full pin table evicts its least recently used pin that has no running request and has
    # been idle at least this long (so one-shot conversations cannot lock our engines out).
    min_idle_before_evict: Duration = 60.0
    # A session pinned to a lower-priority provider (a third party, after an outage or a full
    # pin table) moves back to a higher-priority managed provider that is healthy, has pin and
    # request room and whose pool saturation is at most return_home_saturation, once the pin has
    # stayed where it is for return_home_after.
    return_home: bool = True
    return_home_after: Duration = 30.0
    return_home_saturation: float = Field(0.5, ge=0)
    # A sub-agent's session (its client named its parent: router.session_headers) starts on
    # its parent's endpoint while that has room: placement's cost there is lower by this. 0:
    # parents are ignored.
    parent_weight: float = Field(1.0, ge=0)


class BalancerConfig(StrictModel):
    """Rate balancer among unlimited providers' endpoints; window 0 means plain round robin."""

    window: Duration = 120.0
    input_to_output_token_ratio: float = Field(250, gt=0)
    greediness: float = Field(0.5, ge=0, le=1)
    # Requests at a time (per admission instance) that may explore a deployment without samples
    # in the window, until its first sample returns.
    max_exploring: int = Field(1, ge=1)

    @field_validator("greediness")
    @classmethod
    def _warn_extreme_greediness(cls, value: float) -> float:
        if value < 0.2:
            warnings.warn(
                f"balancer.greediness {value} is below 0.2: the balancer behaves as unordered "
                "round-robin",
                ConfigWarning,
                stacklevel=2,
            )
        elif value > 0.95:
            warnings.warn(
                f"balancer.greediness {value} is above 0.95: the balancer may stick to a local "
                "maximum",
                ConfigWarning,
                stacklevel=2,
            )
        return value


# --- auth -----------------------------------------------------------------------------------------


class AuthConfig(StrictModel):
    """Who may call the edge (docs/keys.md).

    `none`: every caller is accepted (the bearer token, if any, only names a fairness tenant)
    and the band header is trusted; services log a warning at start. `keys`: every request needs
    an API key from the key bucket; the key decides its tenant, models, bands and limits.
    """

    mode: Literal["none", "keys"] = "none"
    # The JetStream KV bucket holding API keys (by hash; only `llmgw keys` writes it).
    bucket: str = Field("llmgw_keys", pattern=r"^[A-Za-z0-9_-]+$")
    # Edges publish their per-key request and token counts this often; the rpm/tpm tolerance
    # is what the other edges admit within one interval (docs/keys.md, "Limits").
    usage_interval: PositiveDuration = 0.1
    # The admin API's bearer token (`/admin/...` on an admin port: the live fleet's writes and
    # reads; docs/security.md): here, in LLMGW_AUTH__ADMIN_TOKEN, or in a file read at start
    # (`admin_token_file`, e.g. a mounted secret). With neither the admin API refuses every
    # call (403); /metrics, /health and /ready need no token. `llmgw up` makes one.
    admin_token: SecretStr | None = None
    admin_token_file: str | None = None

    @field_validator("admin_token")
    @classmethod
    def _check_admin_token(cls, token: SecretStr | None) -> SecretStr | None:
        if token is not None and len(token.get_secret_value().strip()) < MIN_ADMIN_TOKEN:
            raise ValueError(f"at least {MIN_ADMIN_TOKEN} characters (a random token)")
        return token

    @model_validator(mode="after")
    def _one_admin_token_source(self) -> AuthConfig:
        if self.admin_token is not None and self.admin_token_file is not None:
            fail([(("admin_token_file",), "set admin_token or admin_token_file, not both")])
        return self

    @field_serializer("admin_token", when_used="json")
    def _mask(self, secret: SecretStr | None) -> str | None:
        return None if secret is None else MASK


# The shortest admin token accepted (`auth.admin_token`, or its file's content).
MIN_ADMIN_TOKEN = 16


# --- cache-aware placement -----------------------------------------------------------------------


class PrefixConfig(StrictModel):
    """Cache-aware placement (docs/architecture.md, "Cache-aware placement"): each request's
    prompt as a chain of blocks, what each endpoint's prefix cache holds, and how placement
    trades a cached prefix against load."""

    enabled: bool = True
    # The canonical prompt is cut into blocks of this many bytes (about a quarter as many
    # tokens), at most `max_blocks` of them (the rest of a longer prompt is not matched).
    block_bytes: int = Field(256, ge=16, le=65536)
    max_blocks: int = Field(512, ge=1, le=65536)
    # Placement's cost of an endpoint: its load minus `weight` times the share of the prompt it
    # holds (0..1). 0: cache-blind.
    weight: float = Field(2.0, ge=0)
    # An endpoint holding at least half the prompt has room for it up to this many requests
    # past its batch slots (a short wait for a slot beats a cold prefill elsewhere). 0: never.
    queue_slots: int = Field(1, ge=0, le=64)
    # Also minus this when the request's LoRA adapter is loaded on the endpoint's engine (in
    # its running or waiting requests, by vllm:lora_requests_info). 0: ignored.
    adapter_weight: float = Field(0.25, ge=0)
    # What an endpoint holds, for every admission instance (placements, and the engines' KV
    # cache events): a JetStream stream kept this long and at most this large. null: named
    # after the routing bucket (`pinning.bucket` + "_prefix"), so each gateway has its own.
    stream: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]+$")
    max_age: PositiveDuration = 600.0
    max_bytes: int = Field(256 * 1024 * 1024, ge=1024 * 1024)
    # An engine's KV cache in tokens when its metrics do not say (vllm:cache_config_info).
    default_kv_tokens: int = Field(262_144, ge=1)
    # With KV cache events, a placement still counts for this long: the engine's events about
    # a prompt arrive after its prefill.
    predicted_ttl: PositiveDuration = 30.0


# --- the Responses API ----------------------------------------------------------------------------


class ResponsesConfig(StrictModel):
    # JetStream KV bucket of the responses the edge served with `store: true` (one entry per
    # response: owner, input items, output, usage), and how long an entry is kept (the bucket's
    # max age, set when the bucket is created).
    bucket: str = Field("llmgw_responses", pattern=r"^[A-Za-z0-9_-]+$")
    retention: PositiveDuration = 30 * 24 * 3600.0
    # Each edge keeps the records it wrote and read lately, up to this many bytes (their
    # encoded sizes): a chain continued on the same edge is read from memory. 0: none kept.
    cache_bytes: int = Field(64 * 1024 * 1024, ge=0)
