"""The live fleet over HTTP, for automation: the same checked changes as `llmgw endpoints`.

Served on the admin port of every process that runs an admission instance (the edge's with
``admission.colocated``, else ``llmgw admission --admin-listen``); like the rest of the admin
port it is for the operator's network only. JSON in and out; a refused change answers the
API's error shape (``{"error": {"message", "type", "code", "param"}}``) and writes nothing.

    GET    /admin/endpoints                   every endpoint, with its live leases
    GET    /admin/endpoints/{id}
    POST   /admin/endpoints                   an endpoint spec (+ "probe": false to skip the check)
    PATCH  /admin/endpoints/{id}              the fields to change
    POST   /admin/endpoints/{id}/drain        no new work; running requests finish
    POST   /admin/endpoints/{id}/undrain
    POST   /admin/register                    a spec + "heartbeat_ttl": seconds (required)
    POST   /admin/endpoints/{id}/heartbeat    a registered endpoint is alive
    DELETE /admin/endpoints/{id}?wait=S&force=true
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmgw.core.fleet import EndpointState
from llmgw.services.fleet.ops import FleetError

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from llmgw.services.fleet.ops import FleetOps

__all__ = ["add_fleet_routes"]


def add_fleet_routes(app: Starlette, ops: FleetOps) -> None:
    def answer(
        act: Callable[[Request], Awaitable[Any]], status: int = 200
    ) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            try:
                return JSONResponse(await act(request), status_code=status)
            except FleetError as exc:
                return JSONResponse(exc.body(), status_code=exc.status)

        return route

    async def body(request: Request) -> dict[str, Any]:
        try:
            parsed = json.loads(await request.body() or b"null")
        except ValueError:
            raise FleetError("the body is not valid JSON", code="invalid_json") from None
        if not isinstance(parsed, dict):
            raise FleetError("the body must be a JSON object", code="invalid_value")
        return parsed

    def probe_of(spec: dict[str, Any]) -> bool:
        probe = spec.pop("probe", True)
        if not isinstance(probe, bool):
            raise FleetError("probe: must be true or false", code="invalid_value", param="probe")
        return probe

    async def register(request: Request) -> Any:
        spec = await body(request)
        ttl = spec.pop("heartbeat_ttl", None)
        return await ops.register(spec, ttl, probe=probe_of(spec))

    async def heartbeat(request: Request) -> Any:
        return await ops.heartbeat(request.path_params["id"])

    async def listing(request: Request) -> Any:
        return {"object": "list", "data": await ops.list()}

    async def show(request: Request) -> Any:
        return await ops.show(request.path_params["id"])

    async def add(request: Request) -> Any:
        spec = await body(request)
        return await ops.add(spec, probe=probe_of(spec))

    async def update(request: Request) -> Any:
        spec = await body(request)
        return await ops.update(request.path_params["id"], spec, probe=probe_of(spec))

    async def drain(request: Request) -> Any:
        return await ops.set_state(request.path_params["id"], EndpointState.DRAINING)

    async def undrain(request: Request) -> Any:
        return await ops.set_state(request.path_params["id"], EndpointState.ACTIVE)

    async def remove(request: Request) -> Any:
        query = request.query_params
        try:
            wait = float(query.get("wait", "0"))
        except ValueError:
            raise FleetError("wait: seconds expected", code="invalid_value", param="wait") from None
        force = query.get("force", "false").lower() in ("1", "true", "yes")
        return await ops.remove(request.path_params["id"], force=force, wait=max(0.0, wait))

    app.add_route("/admin/endpoints", answer(listing), methods=["GET"])
    app.add_route("/admin/endpoints", answer(add, 201), methods=["POST"])
    app.add_route("/admin/endpoints/{id}", answer(show), methods=["GET"])
    app.add_route("/admin/endpoints/{id}", answer(update), methods=["PATCH"])
    app.add_route("/admin/endpoints/{id}", answer(remove), methods=["DELETE"])
    app.add_route("/admin/endpoints/{id}/drain", answer(drain), methods=["POST"])
    app.add_route("/admin/endpoints/{id}/undrain", answer(undrain), methods=["POST"])
    app.add_route("/admin/register", answer(register), methods=["POST"])
    app.add_route("/admin/endpoints/{id}/heartbeat", answer(heartbeat), methods=["POST"])
