"""Endpoint health as the admission service sees it.

`HealthBoard` is the in-memory view the decision reads. The scraper's load
reports keep it current (`loadboard.LoadBoard.apply`); tests flip it directly.
"""

from __future__ import annotations

from collections.abc import Callable


class HealthBoard:
    """Which endpoints are healthy. Unknown endpoints count as healthy.

    `version` increases on every change so readers can cache derived views.
    """

    def __init__(self) -> None:
        self._unhealthy: set[str] = set()
        self.version = 0
        self._listeners: list[Callable[[], None]] = []

    def is_healthy(self, endpoint_id: str) -> bool:
        return endpoint_id not in self._unhealthy

    def set_healthy(self, endpoint_id: str, healthy: bool) -> None:
        changed = (endpoint_id in self._unhealthy) == healthy
        if not changed:
            return
        if healthy:
            self._unhealthy.discard(endpoint_id)
        else:
            self._unhealthy.add(endpoint_id)
        self.version += 1
        for listener in self._listeners:
            listener()

    def on_change(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)
