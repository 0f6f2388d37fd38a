"""The scraper's optional admin port (`--admin-listen`): metrics, /health and /ready (`llmgw.health`).
Keep it private."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llmgw.health import health_routes
from llmgw.services.scraper.metrics import ScraperMetrics


class _Connection(Protocol):
    @property
    def is_connected(self) -> bool: ...


class _Loop(Protocol):
    def health_problem(self) -> str | None: ...


def create_admin_app(metrics: ScraperMetrics, nc: _Connection, loop: _Loop) -> Starlette:
    async def metrics_endpoint(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def check() -> tuple[list[str], dict[str, object]]:
        """Ready when connected to NATS and the loop keeps its pace. Unhealthy *endpoints* do
        not make the scraper unready: reporting them is its job."""
        problems = []
        if not nc.is_connected:
            problems.append("not connected to NATS")
        loop_problem = loop.health_problem()
        if loop_problem is not None:
            problems.append(loop_problem)
        return problems, {"nats": "connected" if nc.is_connected else "disconnected"}

    return Starlette(
        routes=[
            Route("/metrics", metrics_endpoint, methods=["GET"]),
            *health_routes(check),
        ]
    )
