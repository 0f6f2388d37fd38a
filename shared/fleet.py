"""The live fleet's records and the config a service runs on once the fleet is applied.

The fleet bucket (``fleet.bucket``) holds one `FleetRecord` per endpoint under
``endpoint.<id>``: the endpoint's config (the same fields as in the file's `endpoints`), its
state (`llmgw.core.fleet.EndpointState`) and where it came from. Every service follows the
bucket (`llmgw.state.fleet.FleetMirror`) and runs on `live_config(base, fleet)`: the file's
config with its endpoints replaced by the fleet's. A record whose references do not resolve
against the config (a provider or model it does not have) is left out and logged, never
half-applied.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmgw.config.catalog import EndpointConfig
from llmgw.core.fleet import EndpointState, FleetView

if TYPE_CHECKING:
    from llmgw.config.schema import Config

__all__ = [
    "APPLIED_KEY",
    "ENDPOINT_PREFIX",
    "SEED_PREFIX",
    "AppliedConfig",
    "Fleet",
    "FleetRecord",
    "endpoint_key",
    "endpoint_problems",
    "live_config",
    "restart_only_changes",
    "seed_key",
    "take_live",
    "with_fleet_endpoints",
]

log = logging.getLogger("llmgw.fleet")

ENDPOINT_PREFIX = "endpoint."
SEED_PREFIX = "seed."
APPLIED_KEY = "config.applied"  # the config document `llmgw config apply` stored
Source = Literal["config", "api", "register", "kubernetes"]


class FleetRecord(BaseModel):
    """One endpoint of the live fleet, as stored (JSON) under `endpoint_key`."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    v: Literal[1] = 1
    endpoint: EndpointConfig
    state: EndpointState = EndpointState.ACTIVE
    source: Source = "api"
    changed_at: float = 0.0
    # An endpoint that registered itself: drained once it has not heartbeaten for `ttl`
    # seconds, removed after as long again (`llmgw register`). None: kept until removed.
    heartbeat_ttl: float | None = Field(None, gt=0)
    # Its last heartbeat, by its registrant's clock (unix seconds): shown, and each new
    # value is a heartbeat; the reaper measures silence on its own clock, from when it saw
    # this change (`HeartbeatJanitor`), never against another host's time.
    heartbeat_at: float | None = None
    # Its models came from its engine's `GET /v1/models` (none were given): the reaper reads
    # that list again every `fleet.models_refresh` and follows it (a LoRA adapter loaded or
    # unloaded at run time). False: the models given are kept until changed by hand.
    models_from_engine: bool = False
    # Of its models (followed from its engine), those served through a LoRA adapter, by the
    # adapter's base (its `parent` in the engine's list): an adapter gone while its base is
    # still listed was unloaded (`llmgw.core.fleet.served_change`).
    adapters: dict[str, str] = Field(default_factory=dict)
    # Drained by the model follower: its engine serves none of its models any more (every
    # adapter of ours unloaded); made active again by it once the engine serves one. A change
    # of state by hand, or registering again, ends it.
    unserved: bool = False

    @property
    def id(self) -> str:
        return self.endpoint.id

    def to_bytes(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()


def endpoint_key(endpoint_id: str) -> str:
    return ENDPOINT_PREFIX + endpoint_id


def seed_key(config: Config) -> str:
    """The mark a seeding with this config's endpoint list leaves (a digest of the list)."""
    listed = [e.model_dump(mode="json") for e in config.endpoints]
    digest = hashlib.sha256(json.dumps(listed, sort_keys=True).encode()).hexdigest()[:16]
    return SEED_PREFIX + digest


class AppliedConfig(BaseModel):
    """The config document `llmgw config apply` stored under `APPLIED_KEY`: the file's values
    (each service puts its own LLMGW_* environment on top, as when it loaded its file)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    v: Literal[1] = 1
    config: dict[str, Any]
    source: str = ""
    applied_at: float = 0.0

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


@dataclass(frozen=True, slots=True)
class Fleet:
    """An immutable snapshot of the fleet bucket: records by endpoint id, in revision order,
    and the applied config document with its revision (0: none applied)."""

    records: Mapping[str, FleetRecord] = field(default_factory=dict)
    revision: int = 0
    applied: AppliedConfig | None = None
    config_revision: int = 0

    def view(self) -> FleetView:
        return FleetView({i: r.state for i, r in self.records.items()}, self.revision)

    def shape(self) -> object:
        """What a follower runs on from this snapshot, heartbeats aside: the endpoints, their
        states and the applied config's revision (a registered engine's heartbeat is a write
        that changes none of them)."""
        return (
            {i: (r.state, r.endpoint) for i, r in self.records.items()},
            self.config_revision,
        )


def endpoint_problems(config: Config, endpoint: EndpointConfig) -> list[str]:
    """Why `endpoint` cannot join a fleet running `config` (empty: it can). The same checks
    the config file's endpoints pass (docs/config.md, "endpoints")."""
    try:
        provider = config.provider(endpoint.provider)
    except KeyError:
        known = ", ".join(p.id for p in config.providers)
        return [f"provider: unknown provider {endpoint.provider!r}; known providers: {known}"]
    problems = []
    for index, name in enumerate(endpoint.models):
        canonical = config.resolve_model(name)
        if canonical is None:
            problems.append(f"models.{index}: unknown model {name!r}")
        elif canonical != name:
            problems.append(f"models.{index}: {name!r} is an alias; use {canonical!r}")
        elif provider.model(name) is None:
            problems.append(f"models.{index}: provider {provider.id!r} does not serve {name!r}")
    return problems


def live_config(base: Config, fleet: Fleet) -> Config:
    """`base` with the fleet applied: the applied config's live fields (`applied_config`),
    then the fleet's endpoints (`with_fleet_endpoints`)."""
    if fleet.applied is not None:
        base = applied_config(base, fleet.applied)
    return with_fleet_endpoints(base, fleet)


def with_fleet_endpoints(config: Config, fleet: Fleet) -> Config:
    """`config` with its endpoints replaced by the fleet's (active and draining alike;
    placement leaves draining ones out). Records that do not fit `config` are left out, with a
    warning. A service that applied the applied config's live fields once per revision calls
    this alone at each endpoint change (no document to validate again)."""
    endpoints = []
    providers = {p.id for p in config.providers}
    for record in fleet.records.values():
        problems = endpoint_problems(config, record.endpoint)
        if problems:
            # A provider an applied config removed: expected, said at each change at debug
            # level (`llmgw endpoints list` shows the record; drain and remove it to delete it).
            removed = fleet.applied is not None and record.endpoint.provider not in providers
            log.log(
                logging.DEBUG if removed else logging.WARNING,
                "fleet endpoint %s left out: %s",
                record.id,
                "; ".join(problems),
            )
            continue
        endpoints.append(record.endpoint)
    # No re-validation of the whole: each endpoint was checked above, and a fleet may have
    # drained a provider's last endpoint (its pairs are then degraded, as with a dead engine).
    return config.model_copy(update={"endpoints": endpoints})


# Sections an applied config may hold; what of them `take_live` does not take is read only at
# start (`endpoints` are the live fleet's, `fleet` is not compared here).
_RESTART_FIELDS = (
    "listen",
    "admin_listen",
    "nats",
    "router",
    "timeouts",
    "profiles",
    "admission",
    "scoring",
    "pinning",
    "balancer",
    "spend",
    "auth",
    "log",
    "metrics",
    "events",
    "tracing",
    "providers",  # a provider's kind (`_PROVIDER_RESTART_FIELDS`)
)


# What of a provider the running config has is read at start: whether admission counts it as
# managed (its leases, pins and quota books are kept as one kind or the other).
_PROVIDER_RESTART_FIELDS = ("kind",)

# The fields of a section that change live (docs/config.md, "What changes without a
# restart"); the section's other fields stay the running config's.
_LIVE_FIELDS = {
    "admission": ("bands", "default_band", "queue_ttl", "queue_capacity_per_band", "limit_grace"),
    "pinning": (
        "pin_inactivity_timeout",
        "min_idle_before_evict",
        "return_home",
        "return_home_after",
        "return_home_saturation",
        "parent_weight",
    ),
    "spend": (
        "prices",
        "budgets",
        "cost_header",
        "default_output_tokens",
        "cheaper_overflow_min_speed",
    ),
    "router": ("retries",),
}


def _parsed(applied: AppliedConfig) -> Config:
    from llmgw.config import config_from_dict

    return config_from_dict(applied.config, applied.source or "<applied config>")


def restart_only_changes(base: Config, applied: AppliedConfig) -> list[str]:
    """The sections an applied config changes beyond what `take_live` takes (docs/config.md,
    "What changes without a restart"): in force after the next restart."""
    from llmgw.config import ConfigError

    try:
        new = _parsed(applied)
    except ConfigError:
        return []
    live = take_live(base, new)
    return [field for field in _RESTART_FIELDS if getattr(new, field) != getattr(live, field)]


def applied_config(base: Config, applied: AppliedConfig) -> Config:
    """`base` with what changes live taken from an applied config (`take_live`). A document
    that does not validate here (another service's environment) changes nothing."""
    from llmgw.config import ConfigError

    try:
        new = _parsed(applied)
    except ConfigError as exc:
        log.error("the applied config does not validate here; keeping the running one: %s", exc)
        return base
    return take_live(base, new)


def take_live(base: Config, new: Config) -> Config:
    """`base` with the fields that change live taken from `new` (docs/config.md, "What changes
    without a restart"): `scoring`, `balancer`, `timeouts`; the `_LIVE_FIELDS` of `admission`
    (bands, default band, queue sizes and TTL, `limit_grace`), `pinning` (pin expiry, eviction,
    return home), `spend` (prices, budgets, the cost header) and `router` (retries); the models
    (names, aliases, fallbacks, routing profiles); `profiles` when they hold every profile the
    models and `router.default_profile` name; the providers as `new` lists them (added,
    removed, their pairs added, removed or with other limits, their priority, strategy, key and
    APIs), except that a provider `base` has too keeps its kind. `new` was validated as a
    whole, so what it references exists in it."""
    providers = []
    for provider in new.providers:
        try:
            running = base.provider(provider.id)
        except KeyError:
            providers.append(provider)
            continue
        kept = {f: getattr(running, f) for f in _PROVIDER_RESTART_FIELDS}
        providers.append(provider.model_copy(update=kept))
    sections = {
        name: getattr(base, name).model_copy(
            update={f: getattr(getattr(new, name), f) for f in fields}
        )
        for name, fields in _LIVE_FIELDS.items()
    }
    named = {m.routing_profile for m in new.models if m.routing_profile is not None}
    named.add(base.router.default_profile)
    live = base.model_copy(
        update={
            **sections,
            "providers": providers,
            "models": new.models,
            "scoring": new.scoring,
            "balancer": new.balancer,
            "timeouts": new.timeouts,
            # the running default profile when `new` lacks it (`router` is read at start)
            "profiles": new.profiles
            if named <= set(new.profiles)
            else {**base.profiles, **new.profiles},
        }
    )
    live._canonical_models = dict(new._canonical_models)  # built when `new` was validated
    return live
