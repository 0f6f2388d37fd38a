"""Provider kinds: ours (managed: health-checked, capacity-limited) and third parties (unlimited)."""

from __future__ import annotations

import enum

__all__ = ["ProviderKind"]


class ProviderKind(enum.StrEnum):
    MANAGED = "managed"  # our engines: health checks and capacity limits
    UNLIMITED = "unlimited"  # third-party APIs: overflow, neither checks nor limits
