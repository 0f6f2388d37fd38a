"""vLLM's KV cache events as vLLM puts them on the wire, for tests: the payload encoders.

Encoding (as msgspec encodes vLLM's structs): an event is a positional array tagged by its
first element (every release up to v0.25; older ones have fewer fields) or a map tagged
``"type"`` with default-valued optional fields left out (v0.26 on); the batch is
``[ts, events, dp_rank]`` (``[ts, events]`` before data parallel ranks) or a map. A block hash
is a u64 int (negative int64 from older vLLM) or a digest whose last 8 bytes are the int.
"""

from __future__ import annotations

from typing import Any, Literal

import msgpack

Encoding = Literal["array", "map"]
HashForm = Literal["u64", "i64", "bytes"]

# Fields msgspec leaves out of a map when they hold their default (None).
_OPTIONAL = {"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}


def stored(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    medium: str | None = "GPU",
    group_idx: int | None = None,
    kind: str | None = None,
) -> dict[str, Any]:
    """A BlockStored event's fields (hashes as u64 ints)."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora_name,
        "extra_keys": None,
        "group_idx": group_idx,
        "kv_cache_spec_kind": kind,
        "kv_cache_spec_sliding_window": None,
    }


# vLLM's field order (its structs'): what a positional event carries after its tag.
STORED_FIELDS = tuple(stored([], None, [], 1))[1:]


def removed(hashes: list[int], *, medium: str | None = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": None}


REMOVED_FIELDS = tuple(removed([]))[1:]


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def wire_hash(value: int, form: HashForm) -> int | bytes:
    if form == "i64":
        return value - 2**64 if value >= 2**63 else value
    if form == "bytes":  # a sha256 digest whose last 8 bytes are the hash
        return bytes(range(24)) + value.to_bytes(8, "big")
    return value


def _wire_event(event: dict[str, Any], encoding: Encoding, form: HashForm, fields: int) -> Any:
    values = dict(event)
    for name in ("block_hashes",):
        if name in values:
            values[name] = [wire_hash(h, form) for h in values[name]]
    if values.get("parent_block_hash") is not None:
        values["parent_block_hash"] = wire_hash(values["parent_block_hash"], form)
    tag = values.pop("type")
    if encoding == "map":
        return {
            "type": tag,
            **{k: v for k, v in values.items() if not (k in _OPTIONAL and v is None)},
        }
    names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(tag, ())
    return [tag, *(values[name] for name in names[:fields])]


def encode_batch(
    events: list[dict[str, Any]],
    *,
    ts: float = 1_800_000_000.0,
    dp_rank: int | None = 0,
    encoding: Encoding = "map",
    batch: Literal["array", "array2", "map"] = "array",
    hashes: HashForm = "u64",
    fields: int = len(STORED_FIELDS),
) -> bytes:
    """A batch payload as vLLM sends it (`fields`: how many positional fields an older
    version's BlockStored had)."""
    wire = [_wire_event(e, encoding, hashes, fields) for e in events]
    if batch == "map":
        outer: Any = {"ts": ts, "events": wire, "data_parallel_rank": dp_rank}
    elif batch == "array2":
        outer = [ts, wire]
    else:
        outer = [ts, wire, dp_rank]
    return msgpack.packb(outer, use_bin_type=True)
