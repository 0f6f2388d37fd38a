"""The simulators' HTTP surface: OpenAI endpoints, health, metrics, state and fault control.

One ASGI app serves both kinds; the `Backend` decides how tokens are paced. Per request the hot
path is: parse JSON, tokenize, draw faults, `backend.start`, then one body write for zero-delay
responses (streamed or not). Faults are drawn from the app's own seeded RNG so a given seed and
request order reproduce the same faults.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from pydantic import Field, TypeAdapter, ValidationError

from llmgw.services.sim.asgi import (
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    error_body,
    read_body,
    send_bytes,
    send_json,
)
from llmgw.services.sim.embeddings import embedding_item
from llmgw.services.sim.generation import Backend, Generation, OutputLimits, SimError
from llmgw.services.sim.messages_api import count_tokens, serve_messages
from llmgw.services.sim.params import FaultKnobs
from llmgw.services.sim.responses import (
    FaultPlan,
    GenerationRequest,
    stream_response,
    whole_response,
)
from llmgw.services.sim.responses_api import responses_prompt, stream_events, whole_object
from llmgw.services.sim.tokenize_api import detokenize, tokenize, vllm_error
from llmgw.services.sim.tokenizer import (
    StandInTokenizer,
    TokenizeError,
    Tokenizer,
    embedding_inputs,
    tokenize_prompt,
)

__all__ = ["AppHooks", "SimApp"]

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class AppHooks:
    """What a composition root adds to the app: more routes, work at start-up and shutdown
    (a failing `startup` fails the server's start; it may have run before, so it must be
    idempotent), and a callback given the fault knobs at start and after every change
    through ``POST /sim/faults``."""

    routes: Mapping[tuple[str, str], Handler] = field(default_factory=dict)
    startup: Callable[[], Awaitable[None]] | None = None
    shutdown: Callable[[], Awaitable[None]] | None = None
    faults_changed: Callable[[FaultKnobs], None] | None = None


# vLLM's request models declare `priority: int` within a signed 64-bit range (pydantic, lax).
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_PRIORITY: TypeAdapter[int] = TypeAdapter(Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)])
_INT: TypeAdapter[int] = TypeAdapter(int)
_BOOL: TypeAdapter[bool] = TypeAdapter(bool)


class SimApp:
    """ASGI app of one simulated server (engine or provider)."""

    def __init__(
        self,
        backend: Backend,
        *,
        kind: str,
        models: list[str],
        faults: FaultKnobs,
        embedding_dim: int,
        max_model_len: int,
        fault_rng: random.Random,
        responses_api: bool = True,
        messages_api: bool = True,
        adapters: dict[str, str] | None = None,
        hooks: AppHooks | None = None,
        tokenizer: Tokenizer | None = None,
        on_adapter_loaded: Callable[[], None] | None = None,
    ) -> None:
        """`adapters`: LoRA adapters served from the start (name -> path), on an engine; an
        engine also loads and unloads them at run time, as vLLM's runtime LoRA API does.
        `tokenizer`: how prompts become tokens (default: the stand-in). `on_adapter_loaded` is
        called after each adapter loaded at run time."""
        if not models:
            raise ValueError("a simulator needs at least one served model name")
        self.backend = backend
        self.kind = kind
        self.models = list(models)
        self.faults = faults
        self.embedding_dim = embedding_dim
        self.fault_rng = fault_rng
        self.max_model_len = max_model_len
        self.adapters = dict(adapters or {})  # LoRA adapter name -> path
        self.hooks = hooks or AppHooks()
        if self.hooks.faults_changed is not None:
            self.hooks.faults_changed(self.faults)
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else StandInTokenizer()
        self._on_adapter_loaded = on_adapter_loaded
        self._ids = itertools.count(1)
        self._id_prefix = os.urandom(3).hex()
        self._created = int(time.time())
        self._list_served()
        self._routes: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/embeddings"): self._embeddings,
            **({("POST", "/v1/responses"): self._responses} if responses_api else {}),
            **(
                {
                    ("POST", "/v1/messages"): self._messages,
                    ("POST", "/v1/messages/count_tokens"): self._count_tokens,
                }
                if messages_api
                else {}
            ),
            ("GET", "/v1/models"): self._list_models,
            **(
                {
                    ("POST", "/v1/load_lora_adapter"): self._load_adapter,
                    ("POST", "/v1/unload_lora_adapter"): self._unload_adapter,
                    ("POST", "/tokenize"): self._tokenize,
                    ("POST", "/detokenize"): self._detokenize,
                }
                if kind == "engine"
                else {}
            ),
            ("GET", "/health"): self._health,
            ("GET", "/ready"): self._health,  # an engine that is up can serve
            ("GET", "/metrics"): self._metrics,
            ("GET", "/sim/state"): self._state,
            ("GET", "/sim/usage"): self._usage,
            ("GET", "/sim/faults"): self._get_faults,
            ("POST", "/sim/faults"): self._set_faults,
            **self.hooks.routes,
        }
        self._paths = {path for _, path in self._routes}
        self.bill = Bill()

    # -- ASGI ------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            handler = self._routes.get((scope["method"], scope["path"]))
            if self.faults.api_keys and scope["path"].startswith("/v1/"):
                if _presented_key(scope) not in self.faults.api_keys:
                    await _send_error(send, _BAD_KEY)
                    return
            if handler is not None:
                await handler(scope, receive, send)
            elif scope["path"] in self._paths:
                await _send_error(
                    send, SimError(405, "method not allowed", code="method_not_allowed")
                )
            else:
                await _send_error(
                    send, SimError(404, f"no route {scope['path']}", code="not_found")
                )
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    if self.hooks.startup is not None:
                        await self.hooks.startup()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.backend.shutdown()
                if self.hooks.shutdown is not None:
                    await self.hooks.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- generation ------------------------------------------------------------------------
    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(receive, send, chat=True)

    async def _messages(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_messages(receive, send, lambda r, s: self._generate(r, s, chat=True))

    async def _count_tokens(self, scope: Scope, receive: Receive, send: Send) -> None:
        await count_tokens(receive, send, self._check_model, self.tokenizer)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(receive, send, chat=False)

    async def _generate(self, receive: Receive, send: Send, *, chat: bool) -> None:
        try:
            body = await _json_object(receive)
            request = self._parse_generation(body, chat)
            faults, generation = await self._start(
                request.model, request.prompt, request.limits, request.priority
            )
        except SimError as exc:
            await _send_error(send, exc)
            return
        except ClientGone:
            return
        delivered = [0]
        try:
            request_id = self._new_id("chatcmpl" if chat else "cmpl")
            if request.stream:
                await stream_response(
                    receive, send, request, request_id, generation, faults, chat, delivered
                )
            else:
                delivered[0] = await whole_response(
                    receive, send, request, request_id, generation, faults, chat
                )
        finally:
            generation.close()
            self.bill.add(request.model, generation, delivered[0])

    async def _start(
        self, model: str, prompt: list[int], limits: OutputLimits, priority: int
    ) -> tuple[FaultPlan, Generation]:
        """The request's faults drawn (a slow head waited for), then its generation started
        (with its LoRA adapter when `model` names one)."""
        faults = self._draw_faults()
        if faults.slow_headers > 0:
            await asyncio.sleep(faults.slow_headers)
        lora = model if model in self.adapters else None
        return faults, self.backend.start(prompt, limits, priority, lora)

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await _json_object(receive)
            model = self._check_model(body)
            prompt = responses_prompt(body, self.tokenizer)
            limits = OutputLimits(_max_tokens(body, "max_output_tokens"))
            _, generation = await self._start(model, prompt, limits, _priority_of(body))
        except SimError as exc:
            await _send_error(send, exc)
            return
        except ClientGone:
            return
        delivered = 0
        try:
            response_id = self._new_id("resp")
            writer = stream_events if body.get("stream") is True else whole_object
            delivered = await writer(receive, send, body, response_id, model, generation)
        finally:
            generation.close()
            self.bill.add(model, generation, delivered)

    def _parse_generation(self, body: dict[str, Any], chat: bool) -> GenerationRequest:
        model = self._check_model(body)
        try:
            if chat:
                prompt = self.tokenizer.chat(body.get("messages"), tools=body.get("tools"))
            else:
                prompt = tokenize_prompt(body.get("prompt"), self._encode_prompt)
        except TokenizeError as exc:
            raise SimError(400, str(exc), param="messages" if chat else "prompt") from None
        limits = _output_limits(body)
        n = body.get("n")
        if n is not None and n != 1:
            raise SimError(400, "n: only n=1 is supported by the simulator", param="n")
        priority = _priority_of(body)
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        return GenerationRequest(
            model, prompt, limits, bool(body.get("stream")), include_usage, priority
        )

    def _encode_prompt(self, text: str) -> list[int]:
        """A prompt given as text, with the tokenizer's special tokens (as vLLM encodes one)."""
        return self.tokenizer.encode(text, add_special_tokens=True)

    def _check_model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        if not isinstance(model, str):
            raise SimError(400, "model: a string is required", param="model")
        if model not in self._model_set:
            raise SimError(
                404, f"The model `{model}` does not exist.", code="model_not_found", param="model"
            )
        return model

    def _draw_faults(self) -> FaultPlan:
        knobs = self.faults
        rng = self.fault_rng
        if _hit(knobs.error_rate, rng):
            raise SimError(
                500,
                "The server had an error while processing your request (simulated).",
                type="server_error",
                code="internal_error",
            )
        if _hit(knobs.rate_limit_rate, rng):
            raise SimError(
                429,
                "Rate limit reached (simulated).",
                type="requests",
                code="rate_limit_exceeded",
                headers=[(b"retry-after", str(knobs.retry_after).encode())],
            )
        faults = FaultPlan()
        if knobs.slow_headers > 0 and _hit(knobs.slow_headers_rate, rng):
            faults.slow_headers = knobs.slow_headers
        if knobs.stall_after_headers > 0 and _hit(knobs.stall_rate, rng):
            faults.stall = knobs.stall_after_headers
        if knobs.die_at_token is not None and _hit(knobs.die_rate, rng):
            faults.die_at = knobs.die_at_token
        return faults

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{self._id_prefix}{next(self._ids):x}"

    # -- embeddings ------------------------------------------------------------------------
    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await _json_object(receive)
            model = self._check_model(body)
            try:
                inputs = embedding_inputs(body.get("input"), self._encode_prompt)
            except TokenizeError as exc:
                raise SimError(400, str(exc), param="input") from None
            encoding = body.get("encoding_format") or "float"
            if encoding not in ("float", "base64"):
                raise SimError(
                    400, "encoding_format must be 'float' or 'base64'", param="encoding_format"
                )
            dim = body.get("dimensions") or self.embedding_dim
            if not isinstance(dim, int) or isinstance(dim, bool) or not 1 <= dim <= 65536:
                raise SimError(400, "dimensions must be an integer in 1..65536", param="dimensions")
            faults = self._draw_faults()
            tokens = sum(len(item) for item in inputs)
            delay = faults.slow_headers + self.backend.embedding_delay(tokens)
        except SimError as exc:
            await _send_error(send, exc)
            return
        except ClientGone:
            return
        if delay > 0:
            await asyncio.sleep(delay)
        data = [embedding_item(index, ids, dim, encoding) for index, ids in enumerate(inputs)]
        await send_json(
            send,
            200,
            {
                "object": "list",
                "data": data,
                "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
        )

    # -- misc routes -----------------------------------------------------------------------
    async def _list_models(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_bytes(send, 200, self._models_body, b"application/json")

    def _list_served(self) -> None:
        """The names requests may use and the `GET /v1/models` body, after a change: the served
        models, then the adapters with their base (the first served model) as `parent`, as
        vLLM lists them."""
        self._model_set = frozenset(self.models) | frozenset(self.adapters)
        entry = {"object": "model", "created": self._created, "owned_by": f"llmgw-sim-{self.kind}"}
        data = [
            {"id": name, **entry, "root": name, "parent": None, "max_model_len": self.max_model_len}
            for name in self.models
        ] + [
            {"id": name, **entry, "root": path, "parent": self.models[0], "max_model_len": None}
            for name, path in self.adapters.items()
        ]
        self._models_body = json.dumps({"object": "list", "data": data}).encode()

    async def _load_adapter(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's ``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``)."""
        try:
            body = await _json_object(receive)
            name, path = body.get("lora_name"), body.get("lora_path")
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise SimError(400, "Both 'lora_name' and 'lora_path' must be provided.")
            if name in self._model_set:
                raise SimError(400, f"The lora adapter '{name}' has already been loaded.")
        except SimError as exc:
            await _send_error(send, exc)
            return
        self.adapters[name] = path
        self._list_served()
        if self._on_adapter_loaded is not None:
            self._on_adapter_loaded()
        message = f"Success: LoRA adapter '{name}' added successfully."
        await send_bytes(send, 200, message.encode(), b"text/plain; charset=utf-8")

    async def _unload_adapter(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's ``POST /v1/unload_lora_adapter`` (``{"lora_name"}``)."""
        try:
            body = await _json_object(receive)
            name = body.get("lora_name")
            if not isinstance(name, str) or not name:
                raise SimError(400, "'lora_name' must be provided.", param="lora_name")
            if name not in self.adapters:
                raise SimError(404, f"The lora adapter '{name}' cannot be found.")
        except SimError as exc:
            await _send_error(send, exc)
            return
        del self.adapters[name]
        self._list_served()
        message = f"Success: LoRA adapter '{name}' removed successfully."
        await send_bytes(send, 200, message.encode(), b"text/plain; charset=utf-8")

    # -- vLLM's tokenizer API ----------------------------------------------------------------
    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._tokens_route(
            receive, send, lambda body: tokenize(body, self.tokenizer, self.max_model_len)
        )

    async def _detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._tokens_route(receive, send, lambda body: detokenize(body, self.tokenizer))

    async def _tokens_route(
        self, receive: Receive, send: Send, answer: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> None:
        """``/tokenize`` and ``/detokenize``: `model` is optional there; errors in vLLM's shape."""
        try:
            body = await _json_object(receive)
            if body.get("model") is not None:
                self._check_model(body)
            result = answer(body)
        except SimError as exc:
            await _send_error(send, vllm_error(exc))
            return
        except ClientGone:
            return
        await send_json(send, 200, result)

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.faults.unhealthy:
            await send_bytes(send, 503, b"unhealthy", b"text/plain; charset=utf-8")
        else:
            await send_bytes(send, 200, b"ok", b"text/plain; charset=utf-8")

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        exposition = self.backend.metrics()
        if exposition is None:
            await _send_error(
                send, SimError(404, "this simulator exposes no metrics", code="not_found")
            )
            return
        body, content_type = exposition
        await send_bytes(send, 200, body, content_type.encode())

    async def _state(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = dict(self.backend.state())
        state["models"] = self.models
        state["adapters"] = self.adapters
        state["faults"] = self.faults.model_dump()
        await send_json(send, 200, state)

    async def _usage(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.bill.as_json())

    async def _get_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.faults.model_dump())

    async def _set_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Merge the posted knobs into the current ones; ``{"reset": true}`` restores none-faults."""
        try:
            body = await _json_object(receive)
            base = {} if body.pop("reset", False) is True else self.faults.model_dump()
            try:
                self.faults = FaultKnobs.model_validate({**base, **body})
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
                )
                raise SimError(400, problems) from None
        except SimError as exc:
            await _send_error(send, exc)
            return
        except ClientGone:
            return
        if self.hooks.faults_changed is not None:
            self.hooks.faults_changed(self.faults)
        await send_json(send, 200, self.faults.model_dump())


_BAD_KEY = SimError(401, "Incorrect API key provided.", code="invalid_api_key")


def _presented_key(scope: Scope) -> str | None:
    """The key a request presents: ``Authorization: Bearer <key>``, else ``x-api-key``."""
    for name, value in scope["headers"]:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return bytes(value[7:]).decode("latin-1").strip()
    for name, value in scope["headers"]:
        if name == b"x-api-key":
            return bytes(value).decode("latin-1").strip()
    return None


def _max_tokens(body: dict[str, Any], param: str) -> int | None:
    value = body.get(param)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise SimError(400, f"{param} must be an integer >= 1", param=param)
    return value


def _output_limits(body: dict[str, Any]) -> OutputLimits:
    """``max_completion_tokens`` (else ``max_tokens``), and vLLM's ``min_tokens`` and
    ``ignore_eos``, validated as vLLM's sampling parameters are."""
    max_tokens = _max_tokens(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _max_tokens(body, "max_tokens")
    min_tokens = _lax(_INT, body.get("min_tokens", 0), "min_tokens")
    if min_tokens < 0:
        raise SimError(
            400,
            f"min_tokens must be greater than or equal to 0, got {min_tokens}.",
            param="min_tokens",
        )
    if max_tokens is not None and min_tokens > max_tokens:
        raise SimError(
            400,
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            param="min_tokens",
        )
    ignore_eos = _lax(_BOOL, body.get("ignore_eos", False), "ignore_eos")
    return OutputLimits(max_tokens, min_tokens, ignore_eos)


def _lax(adapter: TypeAdapter[_T], value: object, param: str) -> _T:
    """`value` validated as vLLM's pydantic request model reads it (lax mode)."""
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        raise SimError(400, f"{param}: {exc.errors()[0]['msg']}", param=param) from None


def _priority_of(body: dict[str, Any]) -> int:
    priority = body.get("priority", 0)
    if type(priority) is not int or not _INT64_MIN <= priority <= _INT64_MAX:
        # As vLLM's pydantic model reads it: "3" and 3.0 are 3; 1.5 and null are errors.
        priority = _lax(_PRIORITY, priority, "priority")
    return priority


def _hit(rate: float, rng: random.Random) -> bool:
    """A Bernoulli draw that consumes no randomness for rates 0 and 1."""
    if rate <= 0.0:
        return False
    return rate >= 1.0 or rng.random() < rate


async def _json_object(receive: Receive) -> dict[str, Any]:
    try:
        raw = await read_body(receive)
    except BodyTooLarge:
        raise SimError(413, "request body too large", code="body_too_large") from None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise SimError(400, "request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise SimError(400, "request body must be a JSON object", code="invalid_json")
    return body


async def _send_error(send: Send, exc: SimError) -> None:
    await send_json(
        send, exc.status, error_body(exc.message, exc.type, exc.code, exc.param), exc.headers
    )


class Bill:
    """What this server would bill, per served model name, as a third party does: every
    response that delivered output tokens counts its prompt (cached part apart) and the output
    tokens it delivered, also when the client left mid-stream or the stream broke; a response
    that delivered nothing (an error, a refusal) costs nothing. `GET /sim/usage`."""

    def __init__(self) -> None:
        self.models: dict[str, list[int]] = {}  # requests, prompt, cached, completion

    def add(self, model: str, generation: Any, delivered: int) -> None:
        if delivered <= 0:
            return
        row = self.models.setdefault(model, [0, 0, 0, 0])
        row[0] += 1
        row[1] += generation.prompt_tokens
        row[2] += min(getattr(generation, "cached_tokens", 0), generation.prompt_tokens)
        row[3] += delivered

    def as_json(self) -> dict[str, Any]:
        return {
            "models": {
                model: dict(
                    zip(
                        ("requests", "prompt_tokens", "cached_tokens", "completion_tokens"),
                        row,
                        strict=True,
                    )
                )
                for model, row in sorted(self.models.items())
            }
        }
