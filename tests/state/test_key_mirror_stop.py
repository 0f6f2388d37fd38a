"""An edge's key mirror stops cleanly: its watch task ends (it once raised instead, leaving the
task running and the rest of the edge's shutdown undone)."""

from __future__ import annotations

import time

from llmgw.state import MemoryKV
from llmgw.state.apikeys import KeyMirror


async def test_the_key_mirror_stops_and_its_watch_ends():
    mirror = KeyMirror(MemoryKV(), time.time)
    await mirror.start(timeout=1.0)
    assert mirror.ready.is_set()
    task = mirror._task
    assert task is not None and not task.done()
    await mirror.stop()
    assert task.done() and mirror._task is None
