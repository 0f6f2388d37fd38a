"""Routing state storage: the KV port, its implementations, history recording and checking.

- `kv`: the port (`KVStore`, `KVEntry`, `CasConflict`) every routing operation is written against.
- `memory_kv.MemoryKV`: in-process implementation with a deterministic interleaving hook.
- `nats_kv.NatsKV` / `open_routing_bucket`: the JetStream KV adapter.
- `store.RoutingStore`: the routing bucket, typed (members, shards, quota books, pins).
- `history`: recorders of every write of a bucket, in order (for the checker).
- `checker`: replays a history and an audit trail and reports invariant breaches.

Key names and value codecs are pure and live in `llmgw.core.keys` and `llmgw.core.quota`.
"""

from llmgw.state.checker import AuditLog, Violation, check_audit, check_history
from llmgw.state.history import HistoryIncomplete, HistoryRecorder, KVHistory, MemoryHistory
from llmgw.state.kv import CasConflict, KVEntry, KVStore
from llmgw.state.memory_kv import MemoryKV
from llmgw.state.nats_kv import BucketConfigMismatch, NatsKV, open_routing_bucket

__all__ = [
    "AuditLog",
    "BucketConfigMismatch",
    "CasConflict",
    "HistoryIncomplete",
    "HistoryRecorder",
    "KVEntry",
    "KVHistory",
    "KVStore",
    "MemoryHistory",
    "MemoryKV",
    "NatsKV",
    "Violation",
    "check_audit",
    "check_history",
    "open_routing_bucket",
]
