"""The simulator's parameters: `EngineParams` (a vLLM-like engine) and `ProviderParams` (a
third-party API), the schema of an endpoint's ``simulate`` block.

They live in the config package because the config validates that block with them (the config
never imports a service); the simulator (`llmgw.services.sim`) runs on them. Both are pydantic
models with ``extra="forbid"`` so a typo in a config's ``endpoints[].simulate`` block fails with
the field's name. The ``kind`` field is the discriminator the config schema uses. Durations are
seconds inside Python and accept strings such as ``"5ms"``, ``"2s"``, ``"1h30m"``. Fault knobs
are shared by both kinds (`FaultKnobs`) and can be changed at runtime through ``POST
/sim/faults``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmgw.config.durations import Duration

__all__ = [
    "METRICS_DIALECTS",
    "DriftPoint",
    "EngineParams",
    "FaultKnobs",
    "KvEventEncoding",
    "MetricsDialect",
    "ProviderParams",
]

# How an engine encodes its KV cache events: msgpack maps tagged "type" (vLLM 0.26 and later)
# or positional arrays with the tag first (older vLLM).
KvEventEncoding = Literal["map", "positional"]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


class FaultKnobs(BaseModel):
    """Fault injection shared by engines and providers; every draw uses the simulator's seeded RNG."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    error_rate: Fraction = 0.0
    """Fraction of generation requests answered with a 500 OpenAI error."""
    rate_limit_rate: Fraction = 0.0
    """Fraction of generation requests answered with 429 and ``Retry-After``."""
    retry_after: int = Field(default=1, ge=0)
    """Seconds sent in ``Retry-After`` with simulated (and real) 429s."""
    slow_headers: Duration = 0.0
    """Delay before the response headers of affected requests."""
    slow_headers_rate: Fraction = 1.0
    """Fraction of requests `slow_headers` applies to."""
    stall_after_headers: Duration = 0.0
    """After sending the headers (and the first SSE bytes), stall this long before continuing."""
    stall_rate: Fraction = 1.0
    """Fraction of requests `stall_after_headers` applies to."""
    die_at_token: int | None = Field(default=None, ge=0)
    """Cut the connection after this many generated tokens (no ``[DONE]``, no complete body)."""
    die_rate: Fraction = 1.0
    """Fraction of requests `die_at_token` applies to."""
    unhealthy: bool = False
    """``GET /health`` answers 503 while set."""
    api_keys: list[str] = Field(default_factory=list)
    """Keys the ``/v1/`` routes accept (``Authorization: Bearer <key>`` or ``x-api-key``), as a
    third party checks them: any other gets 401 ``invalid_api_key``. Empty: no key needed.
    Changed at run time, it revokes a key (a provider's key rotation)."""
    kv_events_skip: int = Field(default=0, ge=0)
    """An engine publishing KV cache events does not send its next this many batches: their
    sequence numbers are used up (subscribers see a gap) but replay still has them. Counts
    down as batches are skipped."""
    kv_events_lose: int = Field(default=0, ge=0)
    """Like `kv_events_skip`, but the batches are not kept for replay either: a gap nobody can
    fill. Counts down; taken before `kv_events_skip` when both are set."""
    kv_events_restart: bool = False
    """An action: set true, the engine's prefix cache and KV-event stream restart as when the
    engine restarts (the cache empties without an event, sequence numbers start again at 0,
    the replay ring empties, block hashes change); it reads back false once done."""

    def faults(self) -> FaultKnobs:
        """The fault knobs alone (a copy), e.g. to seed the runtime-mutable fault state."""
        return FaultKnobs.model_validate(self.model_dump(include=set(FaultKnobs.model_fields)))


class _GenerationParams(FaultKnobs):
    served_models: list[str] = Field(default_factory=list)
    """Model names served; empty means the endpoint's models (filled in by the caller)."""
    max_model_len: int = Field(default=32768, ge=2)
    """Context length: prompt + output tokens. Longer prompts get 400; outputs are capped."""
    output_len_distribution: Literal["lognormal", "uniform", "fixed"] = "lognormal"
    """How the length at which the model ends its answer is drawn; ``max_tokens`` (or the room
    left in ``max_model_len``) cuts longer ones (`sampling.output_length`)."""
    output_len_mean: int = Field(default=128, ge=1)
    output_len_max: int = Field(default=1024, ge=1)
    output_len_sigma: float = Field(default=0.6, gt=0)
    """Shape of the lognormal distribution (sigma of the underlying normal)."""
    embedding_dim: int = Field(default=64, ge=1, le=65536)
    seed: int = 0
    responses_api: bool = True
    """Whether it serves the Responses API (``/v1/responses``); false: a 404 there, as from a
    server that speaks only chat completions (what the gateway then translates to)."""
    messages_api: bool = True
    """Whether it serves Anthropic's Messages API (``/v1/messages``); false: a 404 there, as from
    a server that speaks only chat completions (what the gateway then translates to)."""

    @model_validator(mode="after")
    def _mean_within_max(self) -> Self:
        if self.output_len_mean > self.output_len_max:
            raise ValueError(
                f"output_len_mean ({self.output_len_mean}) must be <= output_len_max "
                f"({self.output_len_max})"
            )
        return self


MetricsDialect = Literal["vllm", "vllm-legacy", "sglang", "llamacpp", "tgi", "partial"]
METRICS_DIALECTS: tuple[str, ...] = get_args(MetricsDialect)


class EngineParams(_GenerationParams):
    """A vLLM-like engine: continuous batching, a paged KV cache with prefix caching, and the
    Prometheus metrics of the engine named by `metrics_dialect` (vLLM's by default).

    Timing: TTFT = queue wait + prefill_base + prefill_per_token * uncached prompt tokens;
    inter-token latency = itl_base + itl_per_running_seq * running sequences.
    """

    kind: Literal["engine"] = "engine"
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """vLLM's ``--scheduling-policy``: the order of the waiting queue. ``fcfs``: arrival order, and
    a request with a non-zero ``priority`` is refused with 400; ``priority``: by the request's
    ``priority`` (lower first, default 0), then arrival."""
    metrics_dialect: MetricsDialect = "vllm"
    """Whose metric names ``GET /metrics`` speaks: ``vllm`` (current vLLM), ``vllm-legacy``
    (vLLM's V0 engine: ``gpu_cache_usage_perc``, ``num_requests_swapped``), ``sglang``,
    ``llamacpp`` (llama-server with ``--metrics``: no KV gauge), ``tgi`` (no KV gauge), or
    ``partial`` (vLLM's running and waiting only). The values always come from the model's
    own batch, queue and KV cache."""
    lora_modules: list[str] = Field(default_factory=list)
    """LoRA adapters served from the start, as vLLM's ``--lora-modules`` writes them
    (``NAME=PATH``, or ``NAME``): listed at ``GET /v1/models`` with the first served model as
    their ``parent``, and served like it. More are loaded and unloaded at run time with
    ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (vLLM's runtime LoRA API)."""
    tokenizer: str | None = None
    """A directory with the served model's Hugging Face tokenizer files (``tokenizer.json``,
    ``tokenizer_config.json`` with its chat template): prompts, chats, the prefix cache and
    ``/tokenize`` are then in that model's real tokens (the ``tokenizer`` extra). None: the
    built-in stand-in tokenizer."""
    max_loras: int = Field(default=1, ge=1)
    """vLLM's ``--max-loras`` (adapters in one batch), reported as the ``max_lora`` label of
    ``vllm:lora_requests_info``; the simulated batch is not limited by it."""
    max_num_seqs: int = Field(default=64, ge=1)
    num_gpu_blocks: int = Field(default=4096, ge=1)
    block_size: int = Field(default=16, ge=1)
    prefill_base: Duration = 0.002
    prefill_per_token: Duration = 0.0001
    itl_base: Duration = 0.005
    itl_per_running_seq: Duration = 0.0002
    kv_events_endpoint: str | None = None
    """Publish vLLM's KV cache events on a ZMQ PUB socket bound here: ``tcp://HOST:PORT``
    (``tcp://HOST:*``: any free port, see ``GET /sim/state``) or ``ipc://PATH``. None: no events.
    vLLM's ``--kv-events-config`` ``endpoint``."""
    kv_events_replay_endpoint: str | None = None
    """A ZMQ ROUTER socket bound here replays missed batches (vLLM's ``replay_endpoint``)."""
    kv_events_topic: str = ""
    """First frame of every message; subscribers filter on it (vLLM's ``topic``)."""
    kv_events_encoding: KvEventEncoding = "map"
    """``map``: events are msgpack maps tagged ``"type"`` (vLLM 0.26 and later); ``positional``:
    arrays with the tag first (older vLLM)."""
    kv_events_buffer_steps: int = Field(default=10_000, ge=1)
    """How many batches the replay ring keeps (vLLM's ``buffer_steps``)."""

    @model_validator(mode="after")
    def _kv_events_addresses(self) -> Self:
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            address = getattr(self, name)
            if address is not None and not address.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{name}: expected tcp://HOST:PORT or ipc://PATH, got {address!r}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        return self

    @classmethod
    def zero_delay(cls, **overrides: Any) -> EngineParams:
        """A preset with every timing 0: requests are answered as fast as the HTTP layer allows."""
        timings = {
            "prefill_base": 0,
            "prefill_per_token": 0,
            "itl_base": 0,
            "itl_per_running_seq": 0,
        }
        return cls.model_validate({**timings, **overrides})


class DriftPoint(BaseModel):
    """From ``at`` seconds after start, the provider's output rate is ``tokens_per_second``."""

    model_config = ConfigDict(extra="forbid")

    at: Duration
    tokens_per_second: float = Field(ge=0)


class ProviderParams(_GenerationParams):
    """A third-party-API-like server: per-request pacing, drifting output rate, rate limits.

    TTFT = base_latency + prompt_tokens / input_tokens_per_second; then tokens at the current
    output rate (``tokens_per_second``, replaced by the `drift` schedule once it starts).
    A rate of 0 means "no pacing" (tokens are sent at once).
    """

    kind: Literal["provider"] = "provider"
    max_model_len: int = Field(default=131072, ge=2)
    tokens_per_second: float = Field(default=60.0, ge=0)
    input_tokens_per_second: float = Field(default=20000.0, ge=0)
    base_latency: Duration = 0.2
    drift: list[DriftPoint] = Field(default_factory=list)
    """Rate schedule; before the first point the rate is `tokens_per_second`."""
    drift_mode: Literal["step", "linear"] = "step"
    """``step``: piecewise constant; ``linear``: interpolate between consecutive points."""
    drift_period: Duration | None = None
    """Repeat the schedule every this many seconds (None: hold the last point's rate)."""
    requests_per_second: float | None = Field(default=None, gt=0)
    """Token-bucket rate limit on generation requests (None: unlimited)."""
    burst: int | None = Field(default=None, ge=1)
    """Bucket size; default max(1, requests_per_second)."""
    max_concurrent: int | None = Field(default=None, ge=1)
    """At most this many requests in flight; beyond it 429."""

    @model_validator(mode="after")
    def _drift_sorted(self) -> Self:
        times = [point.at for point in self.drift]
        if times != sorted(times):
            raise ValueError("drift points must be sorted by `at`")
        if self.drift_period is not None and self.drift_period <= 0:
            raise ValueError("drift_period must be > 0")
        return self

    @classmethod
    def zero_delay(cls, **overrides: Any) -> ProviderParams:
        """A preset without pacing or latency."""
        timings = {"tokens_per_second": 0, "input_tokens_per_second": 0, "base_latency": 0}
        return cls.model_validate({**timings, **overrides})
