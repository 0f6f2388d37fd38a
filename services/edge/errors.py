"""OpenAI-shaped error responses: {"error": {"message", "type", "code", "param"}}."""

from __future__ import annotations

import json
import math

from starlette.responses import Response

from llmgw.core.outcomes import ERROR_SHAPES, Outcome


def error_body(message: str, type_: str, code: str, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": type_, "code": code, "param": param}}
    ).encode()


INTERNAL_ERROR_MESSAGE = "The gateway failed unexpectedly."


def error_response(
    outcome: Outcome,
    message: str,
    *,
    param: str | None = None,
    retry_after_s: float | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """The client-facing error of `outcome` (its status comes from ERROR_SHAPES)."""
    shape = ERROR_SHAPES[outcome]
    all_headers = dict(headers or {})
    if shape.retry_after:
        all_headers["retry-after"] = str(max(1, math.ceil(retry_after_s or 1)))
    return Response(
        error_body(message, shape.type, shape.code, param),
        status_code=shape.status,
        media_type="application/json",
        headers=all_headers,
    )


def model_not_found(asked: str, headers: dict[str, str]) -> Response:
    """The 404 for a model that does not exist or that the caller may not use."""
    return error_response(
        Outcome.MODEL_NOT_FOUND,
        f"The model '{asked}' does not exist or you do not have access to it.",
        param="model",
        headers=headers,
    )


def sse_error_event(message: str, code: str) -> bytes:
    """The event that ends a stream that had already begun when something failed."""
    payload = error_body(message, "upstream_error", code).decode()
    return f"data: {payload}\n\n".encode()
