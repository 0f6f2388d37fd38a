"""llmgw configuration: one YAML file, overridable by LLMGW_* environment variables.

Public API (everything else is internal):

- `load_config(path, env=None) -> Config` and `config_from_dict(data, source, env=None) -> Config`;
- `ConfigError` (its str() lists one "FILE: field.path: problem" line per problem);
- `Config` and its section models (see `schema`);
- `parse_duration` / `format_duration`, `parse_hostport`;
- `limits_from_config`: each provider/model pair's `Limits` (None: unlimited).
"""

from llmgw.config.addresses import parse_hostport
from llmgw.config.durations import Duration, PositiveDuration, format_duration, parse_duration
from llmgw.config.loader import ConfigError, config_from_dict, load_config
from llmgw.config.schema import (
    AdmissionConfig,
    AuthConfig,
    BalancerConfig,
    Band,
    Config,
    ConfigWarning,
    EndpointConfig,
    Limits,
    ModelConfig,
    NatsConfig,
    NatsTls,
    PinningConfig,
    ProfileConfig,
    ProviderConfig,
    ProviderModel,
    ResolvedProfile,
    RouterConfig,
    ScoringConfig,
    SpendConfig,
    TimeoutOverrides,
    Timeouts,
    limits_from_config,
)

__all__ = [
    "AdmissionConfig",
    "AuthConfig",
    "BalancerConfig",
    "Band",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "Duration",
    "EndpointConfig",
    "Limits",
    "ModelConfig",
    "NatsConfig",
    "NatsTls",
    "PinningConfig",
    "PositiveDuration",
    "ProfileConfig",
    "ProviderConfig",
    "ProviderModel",
    "ResolvedProfile",
    "RouterConfig",
    "ScoringConfig",
    "SpendConfig",
    "TimeoutOverrides",
    "Timeouts",
    "config_from_dict",
    "format_duration",
    "limits_from_config",
    "load_config",
    "parse_duration",
    "parse_hostport",
]
