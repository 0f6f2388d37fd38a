"""The key-value port the routing state is built on: single-key compare-and-swap, nothing more.

Contract shared by every implementation (checked by tests/state/test_kv_conformance.py):

- A revision is the position of a write in one bucket-wide order (the JetStream stream sequence);
  revisions only grow, and every successful write returns the revision it got.
- `create` succeeds only when the key is missing or its last write was a delete (a tombstone);
  `update` and `delete` succeed only when the key's last revision equals `revision` (a
  tombstone's revision counts: updating at it re-creates the key, as a stream's
  last-subject-sequence check does). Any other state raises `CasConflict` and changes nothing;
  a revision below 1 is a ValueError (use `create`). These are the only product-path writes.
- `put` is unconditional: for tooling and for deliberately broken test variants, never for the
  product path (it would defeat every invariant the routing state relies on).
- Reads (`get`, `list`, `watch`) may be stale; callers treat them as hints and let CAS decide.
- `watch` yields the current value of every matching key, then live changes including deletes
  (`deleted=True`, empty value), in revision order, until the iterator is closed. It starts
  (takes its snapshot) when first iterated. `list` returns live entries in revision order.
- Keys are dot-separated tokens of [-/_=a-zA-Z0-9]; anything else is a ValueError.

Error tree: `CasConflict` is the one expected failure of a conditional write; transport failures
surface as the adapter's own exceptions (timeouts, connection errors).

`watch` returns an async generator: close it (`contextlib.aclosing`) to release the server-side
consumer promptly.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["CasConflict", "KVEntry", "KVStore", "validate_key", "validate_prefix"]

# The characters a JetStream KV key may hold; dots separate subject tokens.
_KEY = re.compile(r"[-/_=a-zA-Z0-9]+(\.[-/_=a-zA-Z0-9]+)*")
_PREFIX = re.compile(r"[-/_=.a-zA-Z0-9]*")


@dataclass(frozen=True, slots=True)
class KVEntry:
    """One write to one key, as a read or a watch sees it."""

    key: str
    value: bytes  # b"" for deletes
    revision: int  # bucket-wide sequence number of this write
    deleted: bool = False
    timestamp: float = 0.0  # server time of the write (unix seconds), 0.0 if unknown


class CasConflict(Exception):
    """The key's revision was not the expected one (or it exists on create).

    Raised only when the store is reachable and refused the write; nothing was written.
    """

    def __init__(self, key: str = "", expected: int | None = None, detail: str = "") -> None:
        self.key = key
        self.expected = expected  # the revision the caller expected; None for create
        self.detail = detail
        what = "create" if expected is None else f"expected revision {expected}"
        message = f"CAS conflict on {key!r} ({what})"
        super().__init__(f"{message}: {detail}" if detail else message)


@runtime_checkable
class KVStore(Protocol):
    """A bucket of keys with per-key compare-and-swap (see the module docstring)."""

    async def get(self, key: str) -> KVEntry | None:
        """The key's live entry; None if it is missing or deleted."""
        ...

    async def create(self, key: str, value: bytes) -> int:
        """Write only if the key is missing or deleted; else CasConflict. Returns the revision."""
        ...

    async def update(self, key: str, value: bytes, revision: int) -> int:
        """Write only if the key's last revision is `revision`; else CasConflict."""
        ...

    async def delete(self, key: str, revision: int) -> int:
        """Tombstone the key only if its last revision is `revision`; else CasConflict."""
        ...

    async def put(self, key: str, value: bytes) -> int:
        """Unconditional write: tooling and deliberately broken test variants only."""
        ...

    async def list(self, prefix: str) -> list[KVEntry]:
        """Live entries whose key starts with `prefix` (dotted form, e.g. "lease.iris.")."""
        ...

    def watch(self, prefix: str) -> AsyncGenerator[KVEntry, None]:
        """Current entries under `prefix`, then live changes (deletes too), by revision."""
        ...


def validate_key(key: str) -> str:
    """`key` itself if it is a valid key (dotted tokens of [-/_=a-zA-Z0-9]); else ValueError."""
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        raise ValueError(f"invalid key {key!r}: expected dot-separated tokens of [-/_=a-zA-Z0-9]")
    return key


def validate_prefix(prefix: str) -> str:
    """`prefix` itself if keys can start with it (no wildcards, no empty token); else ValueError."""
    if (
        not isinstance(prefix, str)
        or _PREFIX.fullmatch(prefix) is None
        or prefix.startswith(".")
        or ".." in prefix
    ):
        raise ValueError(f"invalid key prefix {prefix!r}: expected the start of a dotted key")
    return prefix
