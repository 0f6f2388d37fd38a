"""Helpers for simulator HTTP tests: read SSE streams, poll state, read Prometheus samples."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

Serve = Callable[[object], Awaitable[httpx.AsyncClient]]


async def read_sse(response: httpx.Response) -> tuple[list[dict[str, Any]], bool, list[float]]:
    """(chunks, saw [DONE], arrival time of each chunk) of a streamed response."""
    chunks: list[dict[str, Any]] = []
    arrivals: list[float] = []
    done = False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            done = True
            continue
        chunks.append(json.loads(data))
        arrivals.append(time.monotonic())
    return chunks, done, arrivals


def content_of(chunk: dict[str, Any]) -> str | None:
    """Generated text carried by a chat or completions chunk (None for role/usage chunks)."""
    if not chunk["choices"]:
        return None
    choice = chunk["choices"][0]
    if "delta" in choice:
        return choice["delta"].get("content") or None
    return choice.get("text") or None


def metric(text: str, name: str, **labels: str) -> float:
    """Value of one sample in a Prometheus exposition (labels must match those given)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric_name, _, label_text = head.partition("{")
        if metric_name != name:
            continue
        if all(f'{key}="{val}"' in label_text for key, val in labels.items()):
            return float(value)
    raise KeyError(f"{name} {labels} not in metrics")
