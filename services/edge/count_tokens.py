"""``POST /v1/messages/count_tokens`` at the edge: asked of an engine that offers it.

Counting tokens runs no generation and takes no batch slot, so it is not admitted: no lease, no
session, no flow control. The request (checked as the Messages API checks it, the key's models
applying) goes to the model's endpoints that serve the Messages API (their ``apis``, else their
provider's, list ``messages``), in priority order; an endpoint that cannot be reached
is skipped for the next. A model none of whose endpoints serves the API has no token count: a
404 ``not_found_error`` saying so. Errors have Anthropic's shape (`anthropic_answer`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from llmgw.core.anthropic import parse_messages_request
from llmgw.core.outcomes import Outcome
from llmgw.core.requests import InvalidRequest
from llmgw.logs import REQUEST_ID_HEADER, accept_request_id
from llmgw.services.edge.errors import error_response, model_not_found
from llmgw.services.edge.messages import anthropic_answer, authorization
from llmgw.services.edge.request_body import (
    BodyTooLarge,
    ClientDisconnect,
    read_request_body,
    unread_answer,
)
from llmgw.services.edge.upstream import UpstreamFailure, loop_deadline, open_upstream, read_body

if TYPE_CHECKING:
    from llmgw.services.edge.app import Edge

__all__ = ["COUNT_TOKENS_PATH", "count_tokens"]

COUNT_TOKENS_PATH = "/v1/messages/count_tokens"


async def count_tokens(edge: Edge, request: Request) -> Response:
    answer = await _count(edge, request)
    reshaped = anthropic_answer(answer)
    assert isinstance(reshaped, Response)
    return reshaped


async def _count(edge: Edge, request: Request) -> Response:
    ids = {REQUEST_ID_HEADER: accept_request_id(request.headers.get(REQUEST_ID_HEADER))}
    caller = None
    if edge.auth is not None:
        checked = edge.auth.caller(authorization(request.headers), ids)
        if isinstance(checked, Response):
            return checked
        caller, ids = checked, checked.headers
    try:
        raw = await read_request_body(request, edge.max_body)
        parsed = parse_messages_request(raw, count_only=True)
    except InvalidRequest as exc:
        return error_response(Outcome.BAD_REQUEST, exc.message, param=exc.param, headers=ids)
    except (BodyTooLarge, ClientDisconnect) as exc:
        return unread_answer(exc, edge.max_body, ids)[0]
    config = edge.config
    model = edge.model_for(caller, parsed.model)
    if model is None:
        return model_not_found(parsed.model, ids)
    endpoints = [
        (provider.id, endpoint)
        for provider in config.providers_in_priority_order()
        if provider.model(model) is not None
        for endpoint in config.endpoints_for(provider.id, model)
        if edge.messages.native[endpoint.id]
    ]
    if not endpoints:
        return Response(
            json.dumps(
                {
                    "error": {
                        "message": f"Token counting is not offered for '{parsed.model}': none "
                        "of its endpoints serves the Messages API."
                    }
                }
            ),
            status_code=404,
            media_type="application/json",
            headers=ids,
        )
    timeouts = edge.timeouts_for(model)
    failure: UpstreamFailure | None = None
    for provider, endpoint in endpoints:
        body = json.dumps({**parsed.body, "model": endpoint.upstream_name(model)}).encode()
        headers = {**edge.upstream_headers[provider], REQUEST_ID_HEADER: ids[REQUEST_ID_HEADER]}
        url = endpoint.url.rstrip("/") + COUNT_TOKENS_PATH
        try:
            upstream = await open_upstream(edge.deps.upstream, url, body, headers, timeouts)
            payload = await read_body(upstream, loop_deadline(timeouts.total))
        except UpstreamFailure as exc:
            failure = exc
            continue
        return Response(
            payload,
            status_code=upstream.status,
            media_type="application/json",
            headers={**ids, "x-llmgw-provider": provider, "x-llmgw-endpoint": endpoint.id},
        )
    assert failure is not None
    return error_response(failure.outcome, failure.message, headers=ids)
