"""The edge's admin port: metrics and health. Do not expose it publicly."""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmgw.services.edge.app import EdgeDeps


def create_admin_app(deps: EdgeDeps) -> FastAPI:
    app = FastAPI(title="llmgw edge admin", docs_url=None, redoc_url=None, openapi_url=None)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(deps.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def health(request: Request) -> Response:
        """Alive and connected to NATS (without NATS no request can be admitted)."""
        connected = deps.nc.is_connected
        return JSONResponse(
            {
                "status": "ok" if connected else "degraded",
                "nats": "connected" if connected else "disconnected",
            },
            status_code=200 if connected else 503,
        )

    app.add_route("/metrics", metrics, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    return app
