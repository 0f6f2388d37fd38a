"""The reaper's optional admin port (`--admin-listen`): metrics and health. Keep it private."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmgw.services.reaper.metrics import ReaperMetrics


class _Connection(Protocol):
    @property
    def is_connected(self) -> bool: ...


def create_admin_app(metrics: ReaperMetrics, nc: _Connection) -> Starlette:
    async def metrics_endpoint(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def health(request: Request) -> Response:
        """Alive and connected to NATS (without it nothing can be reaped)."""
        connected = nc.is_connected
        return JSONResponse(
            {
                "status": "ok" if connected else "degraded",
                "nats": "connected" if connected else "disconnected",
            },
            status_code=200 if connected else 503,
        )

    return Starlette(
        routes=[
            Route("/metrics", metrics_endpoint, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ]
    )
