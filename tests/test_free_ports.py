"""`llmgw.serving.free_port` draws below the kernel's ephemeral range, or from the range
`LLMGW_FREE_PORTS` names (each parallel test worker takes its own: tests/conftest.py)."""

from __future__ import annotations

import pytest

from llmgw import serving


def test_a_named_range_bounds_every_port_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_FREE_PORTS", "20000-22000")
    drawn = {serving.free_port() for _ in range(50)}
    assert len(drawn) == 50  # never the same port twice per process
    assert all(20_000 <= port < 22_000 for port in drawn), sorted(drawn)


@pytest.mark.parametrize("named", ["", "junk", "20000", "30000-20000", "80-90", "1024-70000"])
def test_a_missing_or_malformed_range_is_the_default(
    monkeypatch: pytest.MonkeyPatch, named: str
) -> None:
    monkeypatch.setenv("LLMGW_FREE_PORTS", named)
    assert serving._drawn_from() == (serving._LOWEST_PORT, serving._ephemeral_low())
