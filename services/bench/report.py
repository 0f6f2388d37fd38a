"""Results as JSON and markdown, and the live progress line (pure).

The results JSON (schema ``llmgw.bench/1``, documented in docs/bench.md) is the source of truth;
`markdown` renders a results object, so a saved JSON file can be rendered again. Times in the
per-request list are seconds since the run's first request started.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from llmgw.services.bench.stats import PERCENTILES, RequestRecord, percentile, summarize
from llmgw.services.bench.sweep import Recommendation

__all__ = [
    "SCHEMA",
    "markdown",
    "progress_line",
    "recommendation_yaml",
    "run_result",
    "sweep_result",
]

SCHEMA = "llmgw.bench/1"
RECENT = 200
"""The progress line's latency percentile covers this many most recent requests."""


def record_json(record: RequestRecord, origin: float) -> dict[str, Any]:
    return {
        "index": record.index,
        "start_s": record.start - origin,
        "latency_s": record.latency,
        "ttft_s": record.ttft,
        "tpot_s": record.tpot,
        "status": record.status,
        "error": record.error_key,
        "output_tokens": record.output_tokens,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "band": record.band,
        "session": record.session_id,
        "turn": record.turn,
    }


def _by_band(records: Sequence[RequestRecord]) -> dict[str, Any]:
    bands = sorted({r.band for r in records if r.band is not None})
    if len(bands) < 2:
        return {}
    return {band: summarize([r for r in records if r.band == band]) for band in bands}


def run_result(
    config: Mapping[str, Any], records: Sequence[RequestRecord], started_at: str
) -> dict[str, Any]:
    """The results object of a plain run: config, summary, per-band summaries, every request."""
    ordered = sorted(records, key=lambda r: r.index)
    origin = min((r.start for r in records), default=0.0)
    return {
        "schema": SCHEMA,
        "kind": "run",
        "started_at": started_at,
        "config": dict(config),
        "summary": summarize(records),
        "bands": _by_band(records),
        "requests": [record_json(r, origin) for r in ordered],
    }


def sweep_result(
    config: Mapping[str, Any],
    levels: Sequence[Mapping[str, Any]],
    recommendation: Recommendation,
    started_at: str,
    metrics: Mapping[str, Any],
) -> dict[str, Any]:
    """The results object of a sweep; each level is ``{concurrency, summary, engine}``."""
    return {
        "schema": SCHEMA,
        "kind": "sweep",
        "started_at": started_at,
        "config": dict(config),
        "metrics": dict(metrics),
        "levels": [dict(level) for level in levels],
        "recommendation": asdict(recommendation),
    }


# -- formatting -------------------------------------------------------------------------------
def _seconds(values: Sequence[float | None]) -> str:
    """Values in one unit chosen by the largest: ms below 1 s, else s."""
    present = [v for v in values if v is not None]
    if not present:
        return "n/a"
    if max(present) < 1:
        return " / ".join(f"{v * 1e3:.1f}" if v is not None else "-" for v in values) + " ms"
    return " / ".join(f"{v:.2f}" if v is not None else "-" for v in values) + " s"


def _percentiles(dist: Mapping[str, float] | None) -> str:
    if not dist:
        return "n/a"
    return _seconds([dist.get(f"p{q}") for q in PERCENTILES])


def _errors(errors: Mapping[str, int]) -> str:
    return ", ".join(f"{key}: {count}" for key, count in errors.items()) or "none"


_RUN_HEADER = (
    "| | requests | ok | errors by status | req/s | output tok/s | latency p50 / p90 / p99 "
    "| TTFT p50 / p90 / p99 | TPOT p50 / p90 / p99 |\n|---|---|---|---|---|---|---|---|---|"
)


def _run_row(name: str, summary: Mapping[str, Any]) -> str:
    throughput = summary["throughput"]
    return (
        f"| {name} | {summary['requests']} | {summary['ok']} | {_errors(summary['errors'])} "
        f"| {throughput['requests_per_s']:.2f} | {throughput['output_tokens_per_s']:.1f} "
        f"| {_percentiles(summary['latency_s'])} | {_percentiles(summary['ttft_s'])} "
        f"| {_percentiles(summary['tpot_s'])} |"
    )


def markdown(result: Mapping[str, Any]) -> str:
    """A results object as markdown: the summary table, or the sweep's levels and advice."""
    config = result["config"]
    title = (
        f"llmgw bench: {config.get('url')} model {config.get('model')} "
        f"({config.get('api')}, {'streamed' if config.get('stream') else 'not streamed'})"
    )
    if result["kind"] == "run":
        lines = [f"**{title}**, {_load_text(config)}", "", _RUN_HEADER]
        lines.append(_run_row("all", result["summary"]))
        for band, summary in result["bands"].items():
            lines.append(_run_row(band, summary))
        examples = result["summary"].get("error_examples") or {}
        if examples:
            lines += ["", "Errors, first message of each:", ""]
            lines += [f"- {key}: {message}" for key, message in examples.items()]
        hit_rate = result["summary"].get("prefix_cache_hit_rate")
        if hit_rate is not None:
            lines += [
                "",
                f"Prefix cache hits (from usage): {hit_rate * 100:.1f}% of prompt tokens.",
            ]
        return "\n".join(lines) + "\n"
    return _sweep_markdown(result, title)


def _load_text(config: Mapping[str, Any]) -> str:
    if config.get("rate") is not None:
        shape = f"{config['rate']:g} req/s ({config.get('arrival')})"
    else:
        shape = f"concurrency {config.get('concurrency')}"
    if config.get("sessions"):
        shape += f", {config['sessions']} sessions of {config.get('turns')} turns"
    return shape


def _sweep_markdown(result: Mapping[str, Any], title: str) -> str:
    rec = result["recommendation"]
    lines = [
        f"**{title}**, saturation sweep",
        "",
        "| concurrency | requests | errors | req/s | output tok/s | latency p50 | TTFT p50 "
        "| engine running max | engine waiting max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for index, level in enumerate(result["levels"]):
        summary, engine = level["summary"], level.get("engine")
        marker = " (knee)" if index == rec["knee_index"] else ""
        latency = summary["latency_s"]["p50"] if summary["latency_s"] else None
        ttft = summary["ttft_s"]["p50"] if summary["ttft_s"] else None
        lines.append(
            f"| {level['concurrency']}{marker} | {summary['requests']} "
            f"| {_errors(summary['errors'])} | {summary['throughput']['requests_per_s']:.2f} "
            f"| {summary['throughput']['output_tokens_per_s']:.1f} | {_seconds([latency])} "
            f"| {_seconds([ttft])} | {engine['running_max'] if engine else 'n/a'} "
            f"| {engine['waiting_max'] if engine else 'n/a'} |"
        )
    lines.append("")
    metrics = result.get("metrics") or {}
    if metrics.get("available"):
        lines.append(f"Engine metrics: {metrics.get('url')}.")
    else:
        lines.append(f"No engine metrics ({metrics.get('reason')}); client-side measurements only.")
    if rec["knee_index"] is None:
        lines += ["", *(f"- {note}" for note in rec["notes"])]
        return "\n".join(lines) + "\n"
    capacity = rec["batch_capacity"]
    lines += [
        "",
        f"Knee at concurrency {rec['knee_concurrency']} ({rec['knee_throughput']:.1f} output "
        f"tok/s); running at the knee: {rec['knee_running']} ({rec['capacity_source']})"
        + (f"; engine's observed batch capacity: {capacity}." if capacity is not None else "."),
        "",
        f"Recommended (latency within {rec['latency_factor']:g}x the knee's):",
        "",
        "```yaml",
        recommendation_yaml(rec).rstrip("\n"),
        "```",
    ]
    lines += ["", *(f"- {note}" for note in rec["notes"])] if rec["notes"] else []
    return "\n".join(lines) + "\n"


def recommendation_yaml(rec: Mapping[str, Any]) -> str:
    """The config fragment a sweep recommends (``scoring.target_waiting``, an endpoint weight)."""
    reference = rec.get("reference_throughput")
    basis = (
        f"relative to {reference:g} output tok/s"
        if reference is not None
        else "this endpoint is the reference"
    )
    return (
        "scoring:\n"
        f"  target_waiting: {rec['target_waiting']}\n"
        "endpoints:\n"
        f"  - weight: {rec['weight']}   # {basis}\n"
    )


def progress_line(
    label: str,
    records: Sequence[RequestRecord],
    in_flight: int,
    total: int | None,
    elapsed: float,
) -> str:
    """``label: 120/500 done, 16 in flight, 2 errors, 40.1 req/s, p50 0.41 s, 3.0 s``."""
    done = f"{len(records)}/{total}" if total is not None else str(len(records))
    ok = [r for r in records if r.ok]
    errors = len(records) - len(ok)
    rate = len(ok) / elapsed if elapsed > 0 else 0.0
    recent = [r.latency for r in ok[-RECENT:]]
    p50 = _seconds([percentile(recent, 50)]) if recent else "n/a"
    return (
        f"{label}: {done} done, {in_flight} in flight, {errors} errors, {rate:.1f} req/s, "
        f"p50 {p50}, {elapsed:.1f} s"
    )
