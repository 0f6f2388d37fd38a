"""Deterministic embedding vectors: the same token ids always give the same unit vector."""

from __future__ import annotations

import base64
import math
import random
import struct
import zlib
from collections.abc import Sequence
from typing import Any

__all__ = ["embedding_item", "embedding_vector"]


def embedding_vector(ids: Sequence[int], dim: int) -> list[float]:
    """A unit-length vector of `dim` floats seeded by the CRC-32 of the token ids."""
    seed = zlib.crc32(",".join(map(str, ids)).encode())
    rng = random.Random(seed)
    values = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


def embedding_item(index: int, ids: Sequence[int], dim: int, encoding: str) -> dict[str, Any]:
    """One ``data[]`` entry of an embeddings response (``float`` list or ``base64`` float32 LE)."""
    vector = embedding_vector(ids, dim)
    embedding: list[float] | str
    if encoding == "base64":
        embedding = base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode()
    else:
        embedding = vector
    return {"object": "embedding", "index": index, "embedding": embedding}
