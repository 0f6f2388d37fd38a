"""The scraper's optional admin port (`--admin-listen`): metrics and health. Keep it private."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmgw.services.scraper.metrics import ScraperMetrics


class _Connection(Protocol):
    @property
    def is_connected(self) -> bool: ...


class _Loop(Protocol):
    def health_problem(self) -> str | None: ...


def create_admin_app(metrics: ScraperMetrics, nc: _Connection, loop: _Loop) -> Starlette:
    async def metrics_endpoint(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def health(request: Request) -> Response:
        """200 when connected to NATS and the loop keeps its pace, else 503 saying why.

        Unhealthy *endpoints* do not make the scraper unhealthy: reporting them is its job.
        """
        problems = []
        if not nc.is_connected:
            problems.append("not connected to NATS")
        loop_problem = loop.health_problem()
        if loop_problem is not None:
            problems.append(loop_problem)
        body: dict[str, object] = {
            "status": "degraded" if problems else "ok",
            "nats": "connected" if nc.is_connected else "disconnected",
        }
        if problems:
            body["reason"] = "; ".join(problems)
        return JSONResponse(body, status_code=503 if problems else 200)

    return Starlette(
        routes=[
            Route("/metrics", metrics_endpoint, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ]
    )
