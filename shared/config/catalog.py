"""What is served and where: models, providers (with per-model limits) and endpoints.

An endpoint's `simulate` block is validated against the simulator's parameter models
(`EngineParams` / `ProviderParams` in `llmgw.config.simulate`, chosen by `kind`).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from llmgw.config.addresses import parse_http_url
from llmgw.config.common import Api, Feature, Name, Slug, StrictModel, fail
from llmgw.config.simulate import EngineParams, ProviderParams

# --- models, providers, endpoints -----------------------------------------------------------------

# The APIs an OpenAI-compatible vLLM serves: a provider's `apis` unless it says otherwise.
DEFAULT_APIS: tuple[Api, ...] = ("chat_completions", "completions", "embeddings", "responses")


def _default_apis() -> list[Api]:
    return list(DEFAULT_APIS)


class ModelConfig(StrictModel):
    name: Name
    aliases: list[Name] = Field(default_factory=list)
    fallbacks: list[Name] = Field(default_factory=list)
    routing_profile: str | None = None
    # How the gateway gets the engine's tokens of a prompt, to match its KV cache events:
    # a directory with the model's tokenizer.json and tokenizer_config.json (its chat
    # template; the `tokenizers` and `jinja2` packages), or "engine" (the engine's /tokenize).
    # null: endpoints with KV events are matched as those without (by what was sent there).
    tokenizer: str | None = None
    # Its engines' KV cache block, in tokens (vLLM's --block-size; 16 by default).
    kv_block_size: int = Field(16, ge=1, le=1024)
    # Its context window in tokens (prompt + output), for endpoints whose window is known
    # neither from their own `context_window` nor from their engine (a third party's API, an
    # engine that does not report one). null: unknown there (the endpoint judges).
    context_window: int | None = Field(None, ge=1)


class Limits(StrictModel):
    """Capacity of one provider/model pair; absent limits mean unlimited."""

    max_pinned_sessions: int = Field(ge=0)
    max_global_in_flight_request_slots: int = Field(ge=1)
    global_in_flight_request_slots_reserved_for_pinned_sessions: int = Field(ge=0)
    max_per_session_in_flight_request_slots: int = Field(ge=1)

    @model_validator(mode="after")
    def _reserved_within_global(self) -> Limits:
        reserved = self.global_in_flight_request_slots_reserved_for_pinned_sessions
        if reserved > self.max_global_in_flight_request_slots:
            fail(
                [
                    (
                        ("global_in_flight_request_slots_reserved_for_pinned_sessions",),
                        f"{reserved} reserved slots exceed max_global_in_flight_request_slots "
                        f"({self.max_global_in_flight_request_slots})",
                    )
                ]
            )
        return self


def _default_features() -> list[Feature]:
    return ["chat", "completions"]


class ProviderModel(StrictModel):
    name: Name
    features: list[Feature] = Field(default_factory=_default_features, min_length=1)
    limits: Limits | None = None


class ProviderConfig(StrictModel):
    id: Slug
    kind: Literal["managed", "unlimited"]
    priority: int = 100
    # The API key sent upstream (Authorization: Bearer): from this environment variable, or
    # from this file (a mounted secret; surrounding whitespace dropped). One at most; a
    # configured one that is missing or empty is an error when the edge starts.
    api_key_env: str | None = None
    api_key_file: str | None = None
    # How an endpoint of this provider is picked: "score" (least saturated, from scraped engine
    # load) or "rate" (the rate balancer, learned from every edge's request stats).
    # Default: "score" for managed providers, "rate" for unlimited ones (which expose no load).
    strategy: Literal["score", "rate"] | None = None
    # The wire APIs its endpoints serve. A request of an API the provider does not serve
    # (Responses, Messages) is translated to chat completions and back (docs/architecture.md,
    # docs/messages.md).
    apis: list[Api] = Field(default_factory=_default_apis, min_length=1)
    models: list[ProviderModel] = Field(min_length=1)

    @property
    def endpoint_strategy(self) -> str:
        if self.strategy is not None:
            return self.strategy
        return "score" if self.kind == "managed" else "rate"

    @model_validator(mode="after")
    def _one_key_source(self) -> ProviderConfig:
        if self.api_key_env is not None and self.api_key_file is not None:
            fail([(("api_key_file",), "set api_key_env or api_key_file, not both")])
        return self

    @model_validator(mode="after")
    def _unique_models(self) -> ProviderConfig:
        seen: dict[str, int] = {}
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for index, model in enumerate(self.models):
            if model.name in seen:
                problems.append(
                    (
                        ("models", index, "name"),
                        f"model {model.name!r} listed twice (also models[{seen[model.name]}])",
                    )
                )
            seen.setdefault(model.name, index)
        fail(problems)
        return self

    @property
    def is_managed(self) -> bool:
        return self.kind == "managed"

    def model(self, name: str) -> ProviderModel | None:
        return next((model for model in self.models if model.name == name), None)


@lru_cache(maxsize=1)
def _simulate_adapter() -> TypeAdapter[Any]:
    # Built on first use: a config without `simulate` blocks does not pay for the schema.
    return TypeAdapter(Annotated[EngineParams | ProviderParams, Field(discriminator="kind")])


def _validate_simulate(value: Any) -> Any:
    if value is None:
        return None
    try:
        return _simulate_adapter().validate_python(value)
    except ValidationError as exc:
        # Drop the union tag ("engine"/"provider") from locations: the YAML has no such level.
        kind = value.get("kind") if isinstance(value, Mapping) else None
        details: list[InitErrorDetails] = []
        for error in exc.errors():
            loc = tuple(error["loc"])
            if loc and loc[0] == kind:
                loc = loc[1:]
            message = error["msg"]
            if message.startswith("Value error, "):
                message = message[len("Value error, ") :]
            if error["type"] == "extra_forbidden":
                message = "unknown simulator parameter"
            elif error["type"] in ("union_tag_not_found", "union_tag_invalid"):
                message = "needs `kind: engine` or `kind: provider`"
                loc = ("kind",)
            elif error["type"] != "missing" and isinstance(error.get("input"), str | int | float):
                message += f" (got {error['input']!r})"
            details.append(
                InitErrorDetails(
                    type=PydanticCustomError("config", "{message}", {"message": message}),
                    loc=loc,
                    input=None,
                )
            )
        raise ValidationError.from_exception_data("simulate", details) from None


class KvEventsSource(StrictModel):
    """Where an engine publishes its KV cache events (vLLM's ``--kv-events-config``): its ZMQ
    PUB socket, the ROUTER socket that replays missed batches, and the topic it publishes on."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _check_zmq(cls, address: str | None) -> str | None:
        if address is not None and not address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"expected tcp://HOST:PORT or ipc://PATH, got {address!r}")
        return address


class EndpointConfig(StrictModel):
    id: Slug
    url: str
    provider: str
    models: list[Name] = Field(min_length=1)
    pool: Name = "default"
    weight: int = Field(100, gt=0)
    priority: int = 100
    # Batch slots: how many requests the engine runs at once (vLLM's max_num_seqs). Admission
    # counts requests beyond it as queued; the scraper's learned high-water mark only raises it.
    # Unset: a simulated engine's max_num_seqs, else scoring.target_inflight scaled by weight.
    capacity: int | None = Field(None, ge=1)
    # The engine runs vLLM's priority scheduling (--scheduling-policy priority): send each
    # request's band as the `priority` field (lower runs first). Off by default: other engines
    # reject a non-zero priority.
    priority_scheduling: bool = False
    # The wire APIs this endpoint serves, when they differ from its provider's `apis` (an
    # engine of another version); null: the provider's.
    apis: list[Api] | None = Field(None, min_length=1)
    upstream_model: dict[str, str] = Field(default_factory=dict)
    # Its context window in tokens (prompt + output): wins over what its engine reports (the
    # scraper reads vLLM's max_model_len, llama.cpp's n_ctx, ...) and its model's. null: the
    # engine's, else the model's `context_window`.
    context_window: int | None = Field(None, ge=1)
    # The engine's KV cache events (vLLM): what its prefix cache holds, exactly. Without them
    # placement goes by what was sent there (docs/architecture.md, "Cache-aware placement").
    kv_events: KvEventsSource | None = None
    # EngineParams | ProviderParams, chosen by its `kind`; validated by `_validate_simulate`.
    simulate: Any = None

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        parse_http_url(url)
        return url.strip().rstrip("/")

    @field_validator("simulate")
    @classmethod
    def _check_simulate(cls, value: Any) -> Any:
        return _validate_simulate(value)

    @model_validator(mode="after")
    def _check_local_references(self) -> EndpointConfig:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for name in self.upstream_model:
            if name not in self.models:
                problems.append(
                    (
                        ("upstream_model", name),
                        f"renames {name!r}, which this endpoint does not list in models",
                    )
                )
        if self.simulate is not None and parse_http_url(self.url)[2] is None:
            problems.append(
                (("url",), "an endpoint with `simulate` needs an explicit port in its url")
            )
        fail(problems)
        return self

    @property
    def host(self) -> str:
        return parse_http_url(self.url)[1]

    @property
    def port(self) -> int:
        scheme, _, port = parse_http_url(self.url)
        return port if port is not None else (443 if scheme == "https" else 80)

    def upstream_name(self, model: str) -> str:
        """The model name to send upstream (our name unless `upstream_model` renames it)."""
        return self.upstream_model.get(model, model)
