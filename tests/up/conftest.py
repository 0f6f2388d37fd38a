"""Fixtures for `llmgw up` tests (the harness itself lives in up_harness.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from up_harness import UpProcess, write_cluster_config


@pytest.fixture
def cluster_config(tmp_path: Path) -> Path:
    """config/local.yaml rewritten onto free ports, in a temp dir."""
    return write_cluster_config(tmp_path / "cluster.yaml")


@pytest.fixture
def start_up() -> Iterator[Callable[..., UpProcess]]:
    """Factory: `start_up(config, *args)` -> UpProcess; everything it started is killed after."""
    started: list[UpProcess] = []

    def start(config: Path, *extra_args: str) -> UpProcess:
        up = UpProcess(config, *extra_args)
        started.append(up)
        return up

    yield start
    for up in started:
        up.kill_everything()
