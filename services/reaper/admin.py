"""The reaper's optional admin port (`--admin-listen`): metrics, /health and /ready (`llmgw.health`).
Keep it private."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llmgw.health import health_routes
from llmgw.services.reaper.metrics import ReaperMetrics


class _Connection(Protocol):
    @property
    def is_connected(self) -> bool: ...


def create_admin_app(metrics: ReaperMetrics, nc: _Connection) -> Starlette:
    async def metrics_endpoint(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def check() -> tuple[list[str], dict[str, object]]:
        """Ready when connected to NATS (without it nothing can be reaped)."""
        connected = nc.is_connected
        problems = [] if connected else ["not connected to NATS"]
        return problems, {"nats": "connected" if connected else "disconnected"}

    return Starlette(
        routes=[
            Route("/metrics", metrics_endpoint, methods=["GET"]),
            *health_routes(check),
        ]
    )
