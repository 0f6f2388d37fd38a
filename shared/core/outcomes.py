"""One closed outcome per request, mapped once to the client-facing error.

The same enum value labels the request metrics, so every request ends in
exactly one of these and no other strings leak into label cardinality.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Outcome(enum.StrEnum):
    """How a request through the edge ended."""

    SUCCESS = "success"
    BAD_REQUEST = "bad_request"
    MODEL_NOT_FOUND = "model_not_found"
    NOT_FOUND = "not_found"  # a stored response that is unknown, expired or another key's
    UNSUPPORTED = "unsupported"
    # the prompt and the output it asks for fit no endpoint of its model or of its fallbacks
    # (admission's refusal), or a managed engine refused it for its length (its 400: retried
    # once where it fits, never the endpoint's failure)
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    BODY_TOO_LARGE = "body_too_large"
    ADMISSION_UNAVAILABLE = "admission_unavailable"
    NO_CAPACITY = "no_capacity"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_BROKEN_STREAM = "upstream_broken_stream"
    # A managed engine answered 404 model_not_found for a model the fleet lists there (a LoRA
    # adapter unloaded before the next read of its model list): retried on another endpoint,
    # never the endpoint's failure (no breaker counts it), and its model list is read again.
    MODEL_UNLOADED = "model_unloaded"
    CLIENT_DISCONNECTED = "client_disconnected"
    LEASE_LOST = "lease_lost"  # the lease expired under the request (e.g. the edge was paused)
    QUEUE_FULL = "queue_full"  # flow control: the band's queue was at capacity
    QUEUE_TIMEOUT = "queue_timeout"  # flow control: waited admission.queue_ttl without a grant
    INVALID_API_KEY = "invalid_api_key"  # auth.mode keys: missing, unknown, revoked, expired
    RATE_LIMITED = "rate_limited"  # the key's rpm or tpm is used up in the current window
    INSUFFICIENT_QUOTA = "insufficient_quota"  # the tenant's or key's max_spend is used up
    SHUTTING_DOWN = "shutting_down"  # the edge stopped and its drain deadline ended the request
    INTERNAL_ERROR = "internal_error"  # the gateway itself failed (a bug, logged with its trace)


class Refusal(enum.StrEnum):
    """Why admission said no: one vocabulary from the decision core to the wire to the edge.

    Placement refuses UNSUPPORTED, CONTEXT_LENGTH_EXCEEDED or NO_CAPACITY, flow control QUEUE_FULL, QUEUE_TIMEOUT or
    CANCELLED, the service UNKNOWN_MODEL, UNKNOWN_BAND or MALFORMED, and NOT_OWNER when a
    request reaches an instance that no longer owns its shard (the edge asks again).
    `REFUSAL_OUTCOMES` maps each, once, to the request's outcome.
    """

    UNSUPPORTED = "unsupported"  # no provider serves this model with this feature
    NO_CAPACITY = "no_capacity"  # every provider that serves it is degraded or full
    # its prompt and requested output fit the context window of no endpoint that serves it
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    UNKNOWN_MODEL = "unknown_model"
    UNKNOWN_BAND = "unknown_band"
    MALFORMED = "malformed"  # the request did not parse (e.g. an edge of another version)
    QUEUE_FULL = "queue_full"  # flow control: the band's queue is at capacity
    QUEUE_TIMEOUT = "queue_timeout"  # flow control: waited admission.queue_ttl
    CANCELLED = "cancelled"  # the edge said its client left while the request was queued
    NOT_OWNER = "not_owner"  # the shard moved: ask its new owner
    KEY_LIMIT = "key_limit"  # the API key has max_parallel_requests requests in flight


@dataclass(frozen=True, slots=True)
class ErrorShape:
    """Status and OpenAI error `type`/`code` of an outcome that is an error."""

    status: int
    type: str
    code: str
    retry_after: bool = False


# Outcomes that produce a client-facing error of their own. UPSTREAM_ERROR
# passes the engine's own status through, and SUCCESS/CLIENT_DISCONNECTED
# have no error body.
ERROR_SHAPES: dict[Outcome, ErrorShape] = {
    Outcome.BAD_REQUEST: ErrorShape(400, "invalid_request_error", "invalid_request"),
    Outcome.MODEL_NOT_FOUND: ErrorShape(404, "invalid_request_error", "model_not_found"),
    Outcome.NOT_FOUND: ErrorShape(404, "invalid_request_error", "not_found"),
    Outcome.UNSUPPORTED: ErrorShape(400, "invalid_request_error", "unsupported_feature"),
    # OpenAI's own code for a prompt (and max_tokens) over the model's context window.
    Outcome.CONTEXT_LENGTH_EXCEEDED: ErrorShape(
        400, "invalid_request_error", "context_length_exceeded"
    ),
    Outcome.BODY_TOO_LARGE: ErrorShape(413, "invalid_request_error", "request_too_large"),
    Outcome.ADMISSION_UNAVAILABLE: ErrorShape(
        503, "service_unavailable", "admission_unavailable", retry_after=True
    ),
    Outcome.NO_CAPACITY: ErrorShape(503, "service_unavailable", "no_capacity", retry_after=True),
    Outcome.UPSTREAM_UNREACHABLE: ErrorShape(502, "upstream_error", "upstream_unreachable"),
    Outcome.UPSTREAM_TIMEOUT: ErrorShape(504, "upstream_error", "upstream_timeout"),
    Outcome.UPSTREAM_ERROR: ErrorShape(502, "upstream_error", "upstream_error"),
    Outcome.UPSTREAM_BROKEN_STREAM: ErrorShape(502, "upstream_error", "upstream_broken_stream"),
    # The engine's own 404 is passed through when no other endpoint serves the model; this
    # shape only names the outcome's status and code.
    Outcome.MODEL_UNLOADED: ErrorShape(404, "invalid_request_error", "model_not_found"),
    Outcome.LEASE_LOST: ErrorShape(503, "service_unavailable", "lease_lost", retry_after=True),
    Outcome.SHUTTING_DOWN: ErrorShape(
        503, "service_unavailable", "shutting_down", retry_after=True
    ),
    Outcome.INTERNAL_ERROR: ErrorShape(500, "server_error", "internal_error"),
    # Flow control (docs/architecture.md, "Status codes"): a full queue is back-pressure the
    # client should slow down for (429, what OpenAI clients retry with backoff); a request that
    # waited queue_ttl found the service overloaded (503). Both carry Retry-After.
    Outcome.QUEUE_FULL: ErrorShape(429, "rate_limit_error", "queue_full", retry_after=True),
    Outcome.QUEUE_TIMEOUT: ErrorShape(
        503, "service_unavailable", "queue_timeout", retry_after=True
    ),
    # API keys (docs/keys.md): OpenAI's own status, type and code for each.
    Outcome.INVALID_API_KEY: ErrorShape(401, "invalid_request_error", "invalid_api_key"),
    Outcome.RATE_LIMITED: ErrorShape(429, "requests", "rate_limit_exceeded", retry_after=True),
    # Budgets (docs/spend.md): OpenAI's answer to an account out of credit.
    Outcome.INSUFFICIENT_QUOTA: ErrorShape(429, "insufficient_quota", "insufficient_quota"),
}


# Each refusal's outcome at the edge (NOT_OWNER never reaches a client: the edge asks again).
REFUSAL_OUTCOMES: dict[Refusal, Outcome] = {
    Refusal.UNSUPPORTED: Outcome.UNSUPPORTED,
    Refusal.NO_CAPACITY: Outcome.NO_CAPACITY,
    Refusal.CONTEXT_LENGTH_EXCEEDED: Outcome.CONTEXT_LENGTH_EXCEEDED,
    Refusal.UNKNOWN_MODEL: Outcome.MODEL_NOT_FOUND,
    Refusal.UNKNOWN_BAND: Outcome.BAD_REQUEST,
    Refusal.MALFORMED: Outcome.ADMISSION_UNAVAILABLE,
    Refusal.QUEUE_FULL: Outcome.QUEUE_FULL,
    Refusal.QUEUE_TIMEOUT: Outcome.QUEUE_TIMEOUT,
    Refusal.CANCELLED: Outcome.CLIENT_DISCONNECTED,
    Refusal.NOT_OWNER: Outcome.ADMISSION_UNAVAILABLE,
    Refusal.KEY_LIMIT: Outcome.RATE_LIMITED,
}
