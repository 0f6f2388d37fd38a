"""The live fleet through an admin port's API, for `llmgw endpoints --admin-url` and `llmgw
register --admin-url`: the same calls as `FleetOps`, made over HTTP with the admin token.

A tool on a host that may reach an admin port but not NATS (an engine's sidecar) changes the
fleet this way. A refused call raises `FleetError` with the API's own message, status, code
and param; an admin port that cannot be reached raises `httpx.TransportError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from llmgw.core.fleet import EndpointState
from llmgw.services.fleet.ops import FleetError

__all__ = ["AdminApi"]

_TIMEOUT = 30.0  # a removal may wait for its endpoint's requests: the caller's --wait on top


class AdminApi:
    """`FleetOps`' calls on a remote admin port (``url``, e.g. http://10.0.0.5:9090)."""

    def __init__(self, url: str, token: str | None) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(
            base_url=url.rstrip("/"), headers=headers, timeout=_TIMEOUT, trust_env=False
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        timeout: float = _TIMEOUT,
    ) -> Any:
        reply = await self._http.request(method, path, json=body, params=params, timeout=timeout)
        try:
            data = reply.json()
        except ValueError:
            data = None
        if reply.is_success:
            return data
        error = data.get("error") if isinstance(data, dict) else None
        if not isinstance(error, dict):
            raise FleetError(
                f"the admin API answered {reply.status_code}: {reply.text[:200]}",
                status=reply.status_code,
                code="admin_api_error",
            )
        raise FleetError(
            str(error.get("message")),
            status=reply.status_code,
            code=str(error.get("code")),
            param=error.get("param"),
        )

    async def list(self) -> list[dict[str, Any]]:
        listed: list[dict[str, Any]] = (await self._call("GET", "/admin/endpoints"))["data"]
        return listed

    async def show(self, endpoint_id: str) -> dict[str, Any]:
        shown: dict[str, Any] = await self._call("GET", f"/admin/endpoints/{endpoint_id}")
        return shown

    async def add(self, spec: Mapping[str, Any], *, probe: bool = True) -> dict[str, Any]:
        added: dict[str, Any] = await self._call(
            "POST", "/admin/endpoints", {**spec, "probe": probe}
        )
        return added

    async def update(
        self, endpoint_id: str, changes: Mapping[str, Any], *, probe: bool = True
    ) -> dict[str, Any]:
        changed: dict[str, Any] = await self._call(
            "PATCH", f"/admin/endpoints/{endpoint_id}", {**changes, "probe": probe}
        )
        return changed

    async def set_state(self, endpoint_id: str, state: EndpointState) -> dict[str, Any]:
        action = "drain" if state is EndpointState.DRAINING else "undrain"
        moved: dict[str, Any] = await self._call("POST", f"/admin/endpoints/{endpoint_id}/{action}")
        return moved

    async def remove(
        self, endpoint_id: str, *, force: bool = False, wait: float = 0.0
    ) -> dict[str, Any]:
        params = {"wait": f"{wait:g}", "force": "true" if force else "false"}
        removed: dict[str, Any] = await self._call(
            "DELETE", f"/admin/endpoints/{endpoint_id}", params=params, timeout=_TIMEOUT + wait
        )
        return removed

    async def register(
        self, spec: Mapping[str, Any], ttl: Any, *, probe: bool = True
    ) -> dict[str, Any]:
        body = {**spec, "heartbeat_ttl": ttl, "probe": probe}
        registered: dict[str, Any] = await self._call("POST", "/admin/register", body)
        return registered

    async def heartbeat(self, endpoint_id: str) -> dict[str, Any]:
        beat: dict[str, Any] = await self._call("POST", f"/admin/endpoints/{endpoint_id}/heartbeat")
        return beat
