"""The admission service's optional admin port (`--admin-listen`): metrics and health.

Keep it private. /health is 200 while connected to NATS (without it no request can arrive),
with the queue depth and how many endpoint reports this instance has received.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

if TYPE_CHECKING:
    from llmgw.services.admission.service import AdmissionService


def create_admin_app(service: AdmissionService, nc_connected: object) -> Starlette:
    async def metrics_endpoint(request: Request) -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def health(request: Request) -> Response:
        connected = bool(getattr(nc_connected, "is_connected", False))
        queued = len(service.flow.queues) if service.flow is not None else 0
        return JSONResponse(
            {
                "status": "ok" if connected else "degraded",
                "instance": service.instance,
                "nats": "connected" if connected else "disconnected",
                "flow_control": service.flow is not None,
                "queued": queued,
                "load_reports": service.load.reports,
            },
            status_code=200 if connected else 503,
        )

    return Starlette(
        routes=[
            Route("/metrics", metrics_endpoint, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ]
    )
