"""Decoding the versioned JSON values the buckets hold: one object, with a known ``v``."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["decode_versioned"]


def decode_versioned(raw: bytes, version: int, what: str, error: type[Exception]) -> dict[str, Any]:
    """`raw` as a JSON object of version `version`; else `error` naming `what` and why."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{what} is not JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("v") != version:
        found = body.get("v") if isinstance(body, dict) else body
        raise error(f"{what} of unknown version {found!r}")
    return body
