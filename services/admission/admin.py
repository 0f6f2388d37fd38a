"""The admission service's optional admin port (`--admin-listen`): metrics and health.

Keep it private. /ready is 200 while it can decide: connected to NATS (without it no request can
arrive) and its membership renewed (a fenced instance refuses); /health is 200 while the process
answers (`llmgw.health`). Both show the queue depth and how many endpoint reports it received.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llmgw.health import health_routes

if TYPE_CHECKING:
    from llmgw.services.admission.service import AdmissionService


def create_admin_app(service: AdmissionService, nc_connected: object) -> Starlette:
    async def metrics_endpoint(request: Request) -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def check() -> tuple[list[str], dict[str, object]]:
        connected = bool(getattr(nc_connected, "is_connected", False))
        problems = [] if connected else ["not connected to NATS"]
        if not service.membership.can_serve():
            problems.append("membership not renewed recently: not deciding")
        return problems, {
            "instance": service.instance,
            "nats": "connected" if connected else "disconnected",
            "flow_control": service.flow is not None,
            "queued": len(service.flow.queues) if service.flow is not None else 0,
            "load_reports": service.load.reports,
        }

    return Starlette(
        routes=[
            Route("/metrics", metrics_endpoint, methods=["GET"]),
            *health_routes(check),
        ]
    )
