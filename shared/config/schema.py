"""The configuration schema: pydantic models for every section of the YAML file.

Invariants every consumer may rely on once a `Config` exists:

- every model forbids unknown keys, so a typo is an error that names the field;
- durations are floats in seconds (see `durations`), addresses are validated "host:port" strings;
- provider and endpoint ids are slugs ([a-z0-9][a-z0-9_-]*) and unique, because they become parts of
  NATS subjects and KV keys;
- every cross reference resolves (see `references.config_problems`): fallbacks, routing profiles, the
  default band and profile, endpoint -> provider, endpoint models served by that provider (a
  provider model no endpoint of the file serves is a warning: engines may join the live fleet later);
- values come from the file, overridden by LLMGW_* environment variables ("__" for nesting).

The models are plain data plus read-only lookups; loading files and formatting errors live in `loader`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any

from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from llmgw.config.addresses import parse_hostport
from llmgw.config.catalog import EndpointConfig, Limits, ModelConfig, ProviderConfig, ProviderModel
from llmgw.config.common import MASK, SLUG_PATTERN, ConfigWarning, Name, fail
from llmgw.config.fleet import FleetConfig
from llmgw.config.observability import EventsConfig, LogConfig, MetricsConfig, TracingConfig
from llmgw.config.sections import (
    AdmissionConfig,
    AuthConfig,
    BalancerConfig,
    Band,
    NatsConfig,
    NatsTls,
    PinningConfig,
    PrefixConfig,
    ProfileConfig,
    ResolvedProfile,
    ResponsesConfig,
    RouterConfig,
    ScoringConfig,
    TimeoutOverrides,
    Timeouts,
    default_bands,
    default_profiles,
)
from llmgw.config.spend import SpendConfig

__all__ = [
    "MASK",
    "SLUG_PATTERN",
    "AdmissionConfig",
    "AuthConfig",
    "BalancerConfig",
    "Band",
    "Config",
    "ConfigWarning",
    "EndpointConfig",
    "EventsConfig",
    "FleetConfig",
    "Limits",
    "LogConfig",
    "MappingEnvSource",
    "MetricsConfig",
    "ModelConfig",
    "NatsConfig",
    "NatsTls",
    "PinningConfig",
    "ProfileConfig",
    "ProviderConfig",
    "ProviderModel",
    "ResolvedProfile",
    "RouterConfig",
    "ScoringConfig",
    "SpendConfig",
    "TimeoutOverrides",
    "Timeouts",
    "TracingConfig",
    "default_bands",
    "default_profiles",
    "limits_from_config",
]

ENV_PREFIX = "LLMGW_"
ENV_NESTED_DELIMITER = "__"

# The environment the settings sources read; `None` means os.environ. Set only by the loader, for the
# duration of one construction, so tests can pass an explicit mapping without touching os.environ.
environ_override: ContextVar[Mapping[str, str] | None] = ContextVar(
    "llmgw_config_environ", default=None
)


class MappingEnvSource(EnvSettingsSource):
    """The LLMGW_* environment source, reading an explicit mapping instead of os.environ."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        loaded: dict[str, str | None] = {}
        for key, value in self._environ.items():
            if self.env_ignore_empty and value == "":
                continue
            loaded[key if self.case_sensitive else key.lower()] = value
        return loaded


class Config(BaseSettings):
    """The whole configuration. Build it with `load_config` / `config_from_dict`, not directly."""

    model_config = SettingsConfigDict(
        extra="forbid",
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        case_sensitive=False,
        env_ignore_empty=False,
    )

    listen: str = "127.0.0.1:8080"
    admin_listen: str = "127.0.0.1:9090"
    nats: NatsConfig = Field(default_factory=NatsConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    # Empty, then the built-in presets: the settings validate defaults, so _merge_default_profiles
    # merges them in.
    profiles: dict[Name, ProfileConfig] = Field(default_factory=dict)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    pinning: PinningConfig = Field(default_factory=PinningConfig)
    balancer: BalancerConfig = Field(default_factory=BalancerConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    spend: SpendConfig = Field(default_factory=SpendConfig)
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)
    prefix: PrefixConfig = Field(default_factory=PrefixConfig)
    models: list[ModelConfig] = Field(min_length=1)
    providers: list[ProviderConfig] = Field(min_length=1)
    # The live fleet's seed: empty when every engine joins at run time (discovered, registered
    # or added; a provider model no endpoint here serves is a warning, `unserved_pairs`).
    endpoints: list[EndpointConfig] = Field(default_factory=list)

    _canonical_models: dict[str, str] = PrivateAttr(default_factory=dict)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment first: it wins over the file (init kwargs), as deployments expect.
        environ = environ_override.get()
        env_source = env_settings if environ is None else MappingEnvSource(settings_cls, environ)
        return (env_source, init_settings)

    @field_validator("listen", "admin_listen")
    @classmethod
    def _check_address(cls, address: str) -> str:
        parse_hostport(address)
        return address.strip()

    @field_validator("profiles", mode="before")
    @classmethod
    def _merge_default_profiles(cls, given: Any) -> Any:
        if not isinstance(given, Mapping):
            return given
        merged: dict[Any, Any] = default_profiles()
        for name, overrides in given.items():
            base = merged.get(name)
            if isinstance(base, dict) and isinstance(overrides, Mapping):
                merged[name] = _deep_merge(base, overrides)
            else:
                merged[name] = overrides
        return merged

    @model_validator(mode="after")
    def _check_references(self) -> Config:
        from llmgw.config.references import config_problems, unserved_pairs

        fail(config_problems(self))
        for message in unserved_pairs(self):
            warnings.warn(message, ConfigWarning, stacklevel=2)
        self._canonical_models = {}
        for model in self.models:
            self._canonical_models[model.name] = model.name
            for alias in model.aliases:
                self._canonical_models[alias] = model.name
        return self

    # -- addresses --
    @property
    def listen_host(self) -> str:
        return parse_hostport(self.listen)[0]

    @property
    def listen_port(self) -> int:
        return parse_hostport(self.listen)[1]

    @property
    def admin_host(self) -> str:
        return parse_hostport(self.admin_listen)[0]

    @property
    def admin_port(self) -> int:
        return parse_hostport(self.admin_listen)[1]

    # -- JetStream placement --
    @property
    def prefix_stream(self) -> str:
        """The prefix stream's name: `prefix.stream`, else the routing bucket's + "_prefix"."""
        return self.prefix.stream or f"{self.pinning.bucket}_prefix"

    def replicas_of(self, bucket: str) -> int:
        """Replicas of the KV bucket (or stream) `bucket`: the one place that decides them.

        `nats.replicas` for every bucket and stream a service creates; `pinning.replicas`, when
        set (deprecated), overrides it for the routing bucket `pinning.bucket`.
        """
        if bucket == self.pinning.bucket and self.pinning.replicas is not None:
            return self.pinning.replicas
        return self.nats.replicas

    # -- lookups --
    def resolve_model(self, name_or_alias: str) -> str | None:
        """The canonical model name for a name or alias, or None when unknown."""
        return self._canonical_models.get(name_or_alias)

    def model_names(self) -> Mapping[str, str]:
        """Every model name and alias -> its model name (read only)."""
        return MappingProxyType(self._canonical_models)

    def model(self, name_or_alias: str) -> ModelConfig | None:
        canonical = self.resolve_model(name_or_alias)
        return next((m for m in self.models if m.name == canonical), None)

    def public_model_ids(self) -> list[str]:
        """Every name and alias a client may ask for, in file order (for GET /v1/models)."""
        return [ident for model in self.models for ident in (model.name, *model.aliases)]

    def provider(self, provider_id: str) -> ProviderConfig:
        """The provider with this id; KeyError when there is none."""
        for provider in self.providers:
            if provider.id == provider_id:
                return provider
        raise KeyError(provider_id)

    def providers_in_priority_order(self) -> list[ProviderConfig]:
        """Managed providers by priority (highest first), then unlimited ones; ties keep file order."""
        return sorted(self.providers, key=lambda p: (not p.is_managed, -p.priority))

    def endpoints_for(self, provider_id: str, model: str) -> list[EndpointConfig]:
        """Endpoints of a provider serving a model (name or alias), highest priority first."""
        canonical = self.resolve_model(model) or model
        matching = [
            e for e in self.endpoints if e.provider == provider_id and canonical in e.models
        ]
        return sorted(matching, key=lambda e: -e.priority)

    def endpoint(self, endpoint_id: str) -> EndpointConfig:
        """The endpoint with this id; KeyError when there is none."""
        for endpoint in self.endpoints:
            if endpoint.id == endpoint_id:
                return endpoint
        raise KeyError(endpoint_id)

    def resolve_profile(self, name: str | None = None) -> ResolvedProfile:
        """A routing profile (default: router.default_profile) with every value filled in."""
        profile_name = name or self.router.default_profile
        profile = self.profiles[profile_name]
        base = self.timeouts.model_dump()
        base.update(profile.timeouts.model_dump(exclude_none=True))
        retries = self.router.retries if profile.retries is None else profile.retries
        return ResolvedProfile(name=profile_name, retries=retries, timeouts=Timeouts(**base))

    def profile_for_model(self, name_or_alias: str) -> ResolvedProfile:
        model = self.model(name_or_alias)
        return self.resolve_profile(model.routing_profile if model else None)


def limits_from_config(config: Config) -> dict[tuple[str, str], Any]:
    """(provider, model) -> its limits, or None for a pair without configured limits."""
    return {(p.id, m.name): m.limits for p in config.providers for m in p.models}


def _deep_merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(merged.get(key), dict) and isinstance(value, Mapping):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
