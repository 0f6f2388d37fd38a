"""PNG plots of a results object (needs matplotlib: ``pip install 'llmgw[bench]'``).

- a run: latency of every request over the run (failures marked), and the latency and TTFT
  distributions (empirical CDFs);
- a sweep: throughput and median latency against concurrency, the knee marked.

matplotlib is imported here only, with the non-interactive Agg backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["plot_result"]


def plot_result(result: Mapping[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if result["kind"] == "sweep":
        figure = _sweep(plt, result)
    else:
        figure = _run(plt, result)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _title(result: Mapping[str, Any]) -> str:
    config = result["config"]
    return f"{config.get('model')} at {config.get('url')}"


def _run(plt: Any, result: Mapping[str, Any]) -> Any:
    figure, (timeline, cdf) = plt.subplots(1, 2, figsize=(11, 4))
    requests = result["requests"]
    ok = [r for r in requests if r["error"] is None]
    failed = [r for r in requests if r["error"] is not None]
    timeline.scatter([r["start_s"] for r in ok], [r["latency_s"] for r in ok], s=6, label="latency")
    if any(r["ttft_s"] is not None for r in ok):
        timeline.scatter(
            [r["start_s"] for r in ok if r["ttft_s"] is not None],
            [r["ttft_s"] for r in ok if r["ttft_s"] is not None],
            s=6,
            label="TTFT",
        )
    if failed:
        timeline.scatter(
            [r["start_s"] for r in failed],
            [r["latency_s"] for r in failed],
            s=14,
            marker="x",
            color="tab:red",
            label="failed",
        )
    timeline.set_xlabel("request start (s since the first)")
    timeline.set_ylabel("seconds")
    timeline.set_title(_title(result))
    timeline.legend(loc="upper left")
    for key, label in (("latency_s", "latency"), ("ttft_s", "TTFT")):
        values = sorted(r[key] for r in ok if r[key] is not None)
        if values:
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            cdf.plot(values, fractions, label=label)
    cdf.set_xlabel("seconds")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("distribution")
    cdf.legend(loc="lower right")
    return figure


def _sweep(plt: Any, result: Mapping[str, Any]) -> Any:
    figure, left = plt.subplots(figsize=(8, 4.5))
    levels = [lv for lv in result["levels"] if lv["summary"]["latency_s"]]
    xs = [lv["concurrency"] for lv in levels]
    throughput = [lv["summary"]["throughput"]["output_tokens_per_s"] for lv in levels]
    latency = [lv["summary"]["latency_s"]["p50"] for lv in levels]
    left.plot(xs, throughput, "o-", color="tab:blue", label="output tokens/s")
    left.set_xscale("log", base=2)
    left.set_xticks(xs, [str(x) for x in xs])
    left.set_xlabel("concurrency")
    left.set_ylabel("output tokens/s", color="tab:blue")
    left.set_ylim(bottom=0)
    right = left.twinx()
    right.plot(xs, latency, "s--", color="tab:red", label="median latency")
    right.set_ylabel("median latency (s)", color="tab:red")
    right.set_ylim(bottom=0)
    rec = result["recommendation"]
    if rec["knee_concurrency"] is not None:
        left.axvline(rec["knee_concurrency"], color="grey", linestyle=":")
        left.text(
            0.98,
            0.05,
            f"knee: concurrency {rec['knee_concurrency']}\n"
            f"target_waiting {rec['target_waiting']}, weight {rec['weight']}",
            transform=left.transAxes,
            ha="right",
            va="bottom",
            bbox={"facecolor": "white", "edgecolor": "grey"},
        )
    left.set_title(f"saturation sweep: {_title(result)}")
    return figure
