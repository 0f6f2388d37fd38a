"""API keys at the edge (`auth.mode: keys`): who the caller is, before the body is read.

`KeyAuth.caller` runs first on every request: the bearer token's digest is looked up in the
edge's `KeyMirror` (a dict fed by a KV watch: no round trip), and a missing, unknown, revoked,
disabled or expired key ends the request with 401 ``invalid_api_key``; then the key's rpm/tpm
(`KeyLimiter`) may end it with 429 ``rate_limit_exceeded``. Only then is the body read.

After the body is parsed, `Caller` decides what the key may do with it:

- a model the key may not use is answered exactly like an unknown one (404 ``model_not_found``,
  "does not exist or you do not have access to it"), as OpenAI does: a key cannot probe which
  models exist;
- the band is the key's (`ApiKey.band_for`): the band header is read only for a key allowed to
  choose, and a band it may not use is replaced by the key's default band (not an error, so
  clients that always send the header keep working);
- the fairness tenant is the key's tenant.

Errors never repeat the token: a 401 names no part of it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

from starlette.responses import Response

from llmgw.clock import SYSTEM, Clock, TimeSource, wall_of
from llmgw.core.apikeys import ApiKey, Denial, authenticate, bearer_token, digest_of
from llmgw.core.outcomes import Outcome
from llmgw.services.edge.errors import error_response
from llmgw.services.edge.limits import KeyLimiter
from llmgw.state.apikeys import KeyMirror, open_key_bucket

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from llmgw.config.schema import Config
    from llmgw.contracts import RequestReporter
    from llmgw.wire import RequestEnded

log = logging.getLogger("llmgw.edge.auth")

_MESSAGES = {
    Denial.MISSING: "You didn't provide an API key. Provide it in the Authorization header "
    "(Authorization: Bearer YOUR_KEY) or the x-api-key header.",
    Denial.UNKNOWN: "Incorrect API key provided.",
    Denial.DISABLED: "The API key provided is disabled.",
    Denial.EXPIRED: "The API key provided has expired.",
}


_MAX_MODEL_DECISIONS = 4096


class Caller(NamedTuple):
    """An authenticated request's key, and the headers every answer to it carries."""

    key: ApiKey
    headers: dict[str, str]


class KeyAuth:
    def __init__(
        self,
        mirror: KeyMirror,
        limiter: KeyLimiter,
        *,
        default_band: str,
        clock: Clock | TimeSource,
    ) -> None:
        self.mirror = mirror
        self.limiter = limiter
        self.default_band = default_band
        self._clock = wall_of(clock)
        self._model_decisions: dict[tuple[tuple[str, ...], str, str], bool] = {}

    def identify(self, authorization: str | None, headers: dict[str, str]) -> ApiKey | Response:
        """The request's valid key, or the 401 to answer (carrying `headers`)."""
        token = bearer_token(authorization)
        key = self.mirror.get(digest_of(token)) if token is not None else None
        denial = authenticate(key, token, self._clock())
        if denial is not None or key is None:
            return error_response(
                Outcome.INVALID_API_KEY, _MESSAGES[denial or Denial.UNKNOWN], headers=headers
            )
        return key

    def caller(self, authorization: str | None, headers: dict[str, str]) -> Caller | Response:
        """The request's caller, or the 401/429 to answer (carrying `headers`); counts the
        request against the key's rpm."""
        key = self.identify(authorization, headers)
        if isinstance(key, Response):
            return key
        verdict = self.limiter.admit(key)
        if verdict.headers:
            headers = {**headers, **verdict.headers}
        if not verdict.allowed:
            limit = key.rpm if verdict.exhausted == "requests" else key.tpm
            return error_response(
                Outcome.RATE_LIMITED,
                f"Rate limit reached for this API key on {verdict.exhausted} per minute: "
                f"limit {limit}. Please try again in {verdict.retry_after:.0f}s.",
                retry_after_s=verdict.retry_after,
                headers=headers,
            )
        return Caller(key, headers)

    def model_denied(self, caller: Caller, asked: str, canonical: str) -> bool:
        """`not allows_model`, remembered per (patterns, asked, canonical): globs cost
        microseconds. A pure function of that triple, so sharing it between keys is safe."""
        cache_key = (caller.key.models, asked, canonical)
        allowed = self._model_decisions.get(cache_key)
        if allowed is None:
            allowed = caller.key.allows_model(asked, canonical)
            if len(self._model_decisions) >= _MAX_MODEL_DECISIONS:
                self._model_decisions.clear()
            self._model_decisions[cache_key] = allowed
        return not allowed

    def band(self, caller: Caller, header: str | None) -> str:
        return caller.key.band_for(header, self.default_band)

    def ended(self, key_id: str | None, tokens: int) -> None:
        if key_id is not None:
            self.limiter.add_tokens(key_id, tokens)


class TokenCountingReporter:
    """A `RequestReporter` that also counts each keyed request's tokens for its key's tpm (and
    `llmgw keys usage`). Usage by tenant in metrics is `llmgw_edge_tenant_requests_total` (with
    `metrics.tenant_label`), whose tenant is the key's tenant."""

    def __init__(self, inner: RequestReporter, auth: KeyAuth) -> None:
        self.inner = inner
        self.auth = auth

    def report(self, message: RequestEnded) -> None:
        if message.key is not None:
            self.auth.ended(message.key, message.input_tokens + message.output_tokens)
        self.inner.report(message)

    async def drain(self, timeout: float = 5.0) -> None:
        await self.inner.drain(timeout)


async def open_key_auth(
    nc: NATS, config: Config, edge_id: str, *, clock: Clock = SYSTEM
) -> KeyAuth | None:
    """The edge's key checks, started (its mirror holds every key), or None for mode none."""
    if config.auth.mode != "keys":
        return None
    try:
        bucket = await open_key_bucket(nc, config)
    except TimeoutError as exc:  # nats' TimeoutError is one too
        raise RuntimeError(
            f"cannot open the key bucket {config.auth.bucket!r}: no answer. With a NATS user per "
            "role (docs/keys.md, NATS permissions) the edge may read it but not create it: seed "
            "the keys first (`llmgw keys seed`, as the keys role)"
        ) from exc
    mirror = KeyMirror(bucket.kv, clock)
    await mirror.start()
    limiter = KeyLimiter(nc, edge_id, interval=config.auth.usage_interval, clock=clock)
    await limiter.start()
    return KeyAuth(mirror, limiter, default_band=config.admission.default_band, clock=clock)


async def close_key_auth(auth: KeyAuth) -> None:
    await auth.limiter.stop()
    await auth.mirror.stop()
