"""The admission decision's span (`llmgw.tracing`): ``llmgw.admission.decide``.

It starts when an AdmitRequest arrives, as a child of the context in its NATS headers (the edge's
request span), and ends when the final answer is sent: at once for a request that proceeds,
overflows or is refused; after its wait for one that queues. A QUEUED progress reply adds a
``queued`` event, and the final answer sets ``llmgw.queue_wait_s`` (from that event to the
answer) and the placement (status, route, provider, endpoint, refusal).

The span is the current span of the decision's context: the queue wait's task inherits it, so
`replied`, called where every answer is sent, finds it without any table.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from llmgw.tracing import otel_context, trace
from llmgw.wire import ReplyStatus

if TYPE_CHECKING:
    from llmgw.tracing import Tracing
    from llmgw.wire import AdmitReply, AdmitRequest


class DecisionSpans:
    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing

    def start(self, headers: dict[str, str] | None, request: AdmitRequest) -> Any:
        """Start the span and make it current; returns the token for `detach`."""
        span = self.tracing.start("llmgw.admission.decide", self.tracing.extract(headers))
        span.set_attributes(
            {
                "llmgw.request_id": request.id,
                "llmgw.model": request.model,
                "llmgw.band": request.band or "",
                "llmgw.shard": request.shard,
                "llmgw.retry": request.retry_of is not None,
            }
        )
        return otel_context.attach(trace.set_span_in_context(span))

    @staticmethod
    def detach(token: Any) -> None:
        otel_context.detach(token)

    @staticmethod
    def replied(reply: AdmitReply) -> None:
        span = trace.get_current_span()
        if not span.is_recording():
            return
        if reply.status is ReplyStatus.QUEUED:
            span.add_event("queued")
            return
        events = getattr(span, "events", ())
        if events:
            span.set_attribute("llmgw.queue_wait_s", (time.time_ns() - events[-1].timestamp) / 1e9)
        span.set_attribute("llmgw.status", reply.status.value)
        if reply.target is not None:
            span.set_attributes(
                {
                    "llmgw.provider": reply.target.provider,
                    "llmgw.endpoint": reply.target.endpoint,
                    "llmgw.route": reply.route or "",
                    "llmgw.served_model": reply.served_model or "",
                }
            )
        if reply.refusal is not None:
            span.set_attribute("llmgw.refusal", reply.refusal.value)
        span.end()
