"""`/health` and `/ready` for the admin port of every service but the edge (which has its own).

- ``GET /health`` (liveness): 200 while the process answers at all, with the same details as
  /ready. A lost NATS connection or a stalled loop does not fail it: restarting the process
  would not mend either (the NATS client reconnects by itself), and a liveness failure restarts.
- ``GET /ready`` (readiness): 200 when the service can do its work now, else 503 with
  ``reason`` (every problem, joined by "; "). Load balancers and compose's `depends_on` use it.

`check()` returns the problems (empty: ready) and the details to show; it must be cheap and
must not block (it runs on the event loop on every probe).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

Check = Callable[[], tuple[list[str], dict[str, object]]]

__all__ = ["Check", "health_routes"]


def health_routes(check: Check) -> list[Route]:
    def answer(live: bool) -> Response:
        problems, details = check()
        body: dict[str, object] = {"status": "degraded" if problems else "ok", **details}
        if problems:
            body["reason"] = "; ".join(problems)
        return JSONResponse(body, status_code=200 if live or not problems else 503)

    async def health(request: Request) -> Response:
        return answer(live=True)

    async def ready(request: Request) -> Response:
        return answer(live=False)

    return [Route("/health", health, methods=["GET"]), Route("/ready", ready, methods=["GET"])]
