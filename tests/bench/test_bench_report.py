"""Results objects and their markdown: per-band rows, units, the sweep's advice, progress."""

from __future__ import annotations

import json

from llmgw.services.bench.report import markdown, progress_line, run_result, sweep_result
from llmgw.services.bench.stats import RequestRecord, summarize
from llmgw.services.bench.sweep import LevelPoint, recommend

CONFIG = {"url": "http://h:1", "model": "m", "api": "chat", "stream": True, "concurrency": 2}


def record(index: int, band: str, latency: float, error: str | None = None) -> RequestRecord:
    return RequestRecord(
        index,
        start=float(index),
        end=index + latency,
        status=500 if error else 200,
        error=error,
        stream=True,
        first_token=index + latency / 4,
        output_tokens=5,
        band=band,
    )


def test_a_run_has_a_row_per_band_and_serialises_to_json():
    records = [record(0, "platinum", 0.05), record(1, "bronze", 2.0), record(2, "bronze", 1.0)]
    records.append(record(3, "bronze", 0.5, error="http"))
    result = run_result(CONFIG, records, "2026-01-01T00:00:00+0000")
    assert json.loads(json.dumps(result)) == result
    assert [r["index"] for r in result["requests"]] == [0, 1, 2, 3]
    assert result["requests"][3]["error"] == "500" and result["requests"][0]["start_s"] == 0.0
    text = markdown(result)
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| all", "| bronze", "| platinum"]
    assert "| bronze | 3 | 2 | 500: 1 |" in text
    assert "50.0 / 50.0 / 50.0 ms" in text  # platinum's latency, below a second: ms
    assert "| 1.50 / 1.90 / 1.99 s |" in text  # bronze: one second or more, seconds


def test_a_single_band_gets_no_extra_rows():
    result = run_result(CONFIG, [record(0, "gold", 0.1)], "t")
    assert result["bands"] == {}


def test_sweep_markdown_marks_the_knee_and_prints_the_config_fragment():
    points = [
        LevelPoint(c, 100.0 * min(c, 4), 0.2 * max(1, c / 4), min(c, 4)) for c in (1, 2, 4, 8)
    ]
    levels = [
        {
            "concurrency": p.concurrency,
            "summary": summarize([record(0, "x", p.latency)]),
            "engine": {"running_max": p.running_max, "waiting_max": 0},
        }
        for p in points
    ]
    result = sweep_result(CONFIG, levels, recommend(points), "t", {"available": True, "url": "u"})
    text = markdown(result)
    assert "| 4 (knee) |" in text
    assert "scoring:\n  target_waiting: 2\nendpoints:\n  - weight: 100" in text
    assert "Engine metrics: u." in text


def test_sweep_markdown_without_a_knee_says_so():
    points = [LevelPoint(c, 100.0 * c, 0.2) for c in (1, 2)]
    levels = [{"concurrency": 1, "summary": summarize([record(0, "x", 0.2)]), "engine": None}]
    metrics = {"available": False, "url": "u", "reason": "u answered 404"}
    text = markdown(sweep_result(CONFIG, levels, recommend(points), "t", metrics))
    assert "No engine metrics (u answered 404)" in text
    assert "- no knee: throughput still grew" in text and "target_waiting" not in text


def test_progress_line():
    records = [record(i, "x", 0.2) for i in range(10)] + [record(10, "x", 0.1, error="http")]
    line = progress_line("bench", records, 3, 50, 2.0)
    assert line == "bench: 11/50 done, 3 in flight, 1 errors, 5.0 req/s, p50 200.0 ms, 2.0 s"
