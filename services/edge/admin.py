"""The edge's admin port: metrics, liveness and readiness. Do not expose it publicly.

- ``/health`` (liveness): 200 while the process runs its event loop; it says whether NATS is
  connected, but a dead NATS does not make the edge dead (restarting it would not help).
- ``/ready`` (readiness): 200 only while it can serve: NATS connected and an admission
  instance answered within the last few seconds, and not stopping (``draining`` from SIGTERM
  on: services/edge/drain.py); 503 otherwise (a load balancer should send traffic elsewhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

if TYPE_CHECKING:
    from llmgw.services.edge.app import EdgeDeps


def create_admin_app(
    deps: EdgeDeps, nc: object, more_registries: Sequence[CollectorRegistry] = ()
) -> FastAPI:
    """`more_registries`: other metrics this process exposes (a colocated admission's)."""
    app = FastAPI(title="llmgw edge admin", docs_url=None, redoc_url=None, openapi_url=None)
    registries = [deps.metrics.registry, *more_registries]

    async def metrics(request: Request) -> Response:
        body = b"".join(generate_latest(r) for r in registries)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def _status() -> dict[str, object]:
        connected = bool(getattr(nc, "is_connected", False))
        return {
            "nats": "connected" if connected else "disconnected",
            "admission": "answering" if deps.admission.ready() else "not answering",
            "leases": len(deps.leases.held),
            "edge": deps.edge_id,
        }

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", **_status()})

    async def ready(request: Request) -> Response:
        ok = deps.admission.ready() and not deps.drain.draining
        status = "draining" if deps.drain.draining else "ready" if ok else "not ready"
        return JSONResponse(
            {"status": status, **_status()},
            status_code=200 if ok else 503,
        )

    app.add_route("/metrics", metrics, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/ready", ready, methods=["GET"])
    return app
