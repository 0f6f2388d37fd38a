"""Small measuring helpers shared by the benchmarks: percentiles and py-spy summaries."""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

Areas = Sequence[tuple[str, Sequence[str]]]


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def reference_speed(repeat: int = 5) -> float:
    """Microseconds this machine takes now for a fixed piece of pure-Python work (build and
    encode a small request-like dict), the best of `repeat` tries. The reference machine's speed
    varies by up to ~1.5x within an hour (shared cores); printed with a benchmark's figures, it
    tells a fast moment's figures from a slow one's (lower: faster)."""
    best = float("inf")
    for _ in range(repeat):
        began = time.process_time()
        for i in range(20_000):
            json.dumps({"id": i, "model": "m", "messages": [{"role": "user", "content": "hi"}]})
        best = min(best, (time.process_time() - began) / 20_000 * 1e6)
    return best


def py_spy() -> str:
    """py-spy from this interpreter's environment if it is there, else from PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else (shutil.which("py-spy") or "py-spy")


def summarize_profile(
    path: Path, areas: Areas
) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """Share of samples by area (innermost frame matching an area) and by function (self time).

    Input: py-spy's raw (collapsed stacks) output. py-spy attributes time inside the event
    loop's C code (epoll, socket syscalls) to the frame that runs the loop: that is reported
    as "event loop and sockets".
    """
    by_area: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit():
            continue  # a line py-spy wrote torn (a frame name read mid-change)
        n = int(count)
        total += n
        area = "event loop and sockets (uvloop, asyncio, syscalls)"
        for frame in reversed(frames):
            hit = next((name for name, keys in areas if any(k in frame for k in keys)), None)
            if hit:
                area = hit
                break
            if "uvloop" in frame or "runtime.py" in frame:
                break  # the loop itself
            if "asyncio/" not in frame and "runners.py" not in frame:
                area = "other Python"
                break
        by_area[area] += n
        functions[frames[-1].rsplit(":", 1)[0] + ")"] += n
    return (
        [(name, n / total) for name, n in by_area.most_common()],
        [(name, n / total) for name, n in functions.most_common(15)],
    )


def print_profile(
    profile: tuple[list[tuple[str, float]], list[tuple[str, float]]], heading: str
) -> None:
    """Markdown tables of a summarize_profile result: by area, then top functions."""
    by_area, by_function = profile
    print(f"\n{heading}\n")
    print("| share | area |\n|---|---|")
    for name, share in by_area:
        print(f"| {share * 100:.1f}% | {name} |")
    print("\nTop functions by self time:\n")
    print("| share | function |\n|---|---|")
    for name, share in by_function:
        print(f"| {share * 100:.1f}% | `{name}` |")
