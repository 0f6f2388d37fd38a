"""The live fleet over HTTP, for automation: the same checked changes as `llmgw endpoints`.

Served on the admin port of every process that runs an admission instance (the edge's with
``admission.colocated``, else ``llmgw admission --admin-listen``). Every route needs the admin
token (``auth.admin_token`` / ``admin_token_file``) as ``Authorization: Bearer TOKEN``, compared
in constant time: without it 401 ``missing_admin_token``, with another 403
``invalid_admin_token``, and with no token configured 403 ``admin_api_disabled``; a refused
call reads and writes nothing. JSON in and out; a refused change answers the API's error shape
(``{"error": {"message", "type", "code", "param"}}``) and writes nothing.

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

import hashlib
import hmac
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmgw.config.credentials import CredentialsError, admin_token
from llmgw.core.fleet import EndpointState
from llmgw.services.fleet.ops import FleetError

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from llmgw.config import Config
    from llmgw.services.fleet.ops import FleetOps

__all__ = ["AdminGuard", "add_fleet_routes", "admin_guard"]

log = logging.getLogger("llmgw.fleet.admin")


class AdminGuard:
    """Who may call the admin API: the holder of its token. Only digests of the token are
    kept and compared (`hmac.compare_digest`), so the time a refusal takes does not depend on
    how much of the token a caller got right, nor on its length."""

    def __init__(self, token: str | None) -> None:
        self._digest = None if token is None else _digest(token)

    def refusal(self, request: Request) -> FleetError | None:
        """Why `request` may not call the admin API, or None when it may."""
        if self._digest is None:
            return FleetError(
                "The admin API is off: no admin token is configured (auth.admin_token, "
                "auth.admin_token_file or LLMGW_AUTH__ADMIN_TOKEN).",
                status=403,
                code="admin_api_disabled",
            )
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return FleetError(
                "The admin API needs the admin token: Authorization: Bearer TOKEN.",
                status=401,
                code="missing_admin_token",
            )
        if not hmac.compare_digest(_digest(given.strip()), self._digest):
            return FleetError(
                "The admin token is not valid.", status=403, code="invalid_admin_token"
            )
        return None


def admin_guard(config: Config, service: str) -> AdminGuard:
    """The guard of `service`'s admin API, from its config's token, read once at its start; a
    token file that cannot be read stops the service (exit 2), naming the field."""
    try:
        token = admin_token(config)
    except CredentialsError as exc:
        print(f"llmgw {service}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if token is None:
        log.warning(
            "no admin token is configured: the admin API (/admin/...) refuses every call "
            "(set auth.admin_token_file or LLMGW_AUTH__ADMIN_TOKEN; docs/security.md)"
        )
    return AdminGuard(token)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def add_fleet_routes(app: Starlette, ops: FleetOps, guard: AdminGuard) -> None:
    def answer(
        act: Callable[[Request], Awaitable[Any]], status: int = 200
    ) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            refused = guard.refusal(request)
            if refused is not None:
                headers = {"www-authenticate": "Bearer"} if refused.status == 401 else None
                return JSONResponse(refused.body(), status_code=refused.status, headers=headers)
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
