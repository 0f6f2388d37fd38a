"""``llmgw bench`` options turned into `Settings`: every value checked, a `UsageError` naming
the option otherwise (the command exits 2).

Defaults not visible in the parser: ``--concurrency 8`` and ``--requests 200`` unless another
load shape or budget is given; a random ``--seed`` and ``--run-id``, recorded in the results.
"""

from __future__ import annotations

import argparse
import json
import secrets
from dataclasses import dataclass
from typing import Any

from llmgw.services.bench.distributions import (
    Distribution,
    DistributionError,
    parse_distribution,
)
from llmgw.services.bench.options import DEFAULTS
from llmgw.services.bench.protocol import ApiUrls, api_urls
from llmgw.services.bench.runner import LoadSpec
from llmgw.services.bench.sweep import doubling_levels
from llmgw.services.bench.sweep_runner import SweepSpec
from llmgw.services.bench.workload import WeightedChoice, WorkloadSpec

__all__ = ["Settings", "UsageError", "resolve"]


class UsageError(Exception):
    """A bad option value; printed without a traceback, exit status 2."""


@dataclass(frozen=True)
class Settings:
    urls: ApiUrls
    model: str | None
    api: str
    stream: bool
    workload: WorkloadSpec
    load: LoadSpec | None
    sweep: SweepSpec | None
    timeout: float
    band_header: str
    session_header: str
    extra_headers: dict[str, str]
    extra_body: dict[str, Any]
    seed: int
    json_out: str | None
    markdown_out: str | None
    plot_out: str | None
    progress: bool
    max_error_rate: float | None
    config: dict[str, Any]


def resolve(args: argparse.Namespace, *, stderr_tty: bool = False) -> Settings:
    """Settings from parsed options; UsageError naming the option for any bad value."""
    try:
        urls = api_urls(args.url)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    api = args.api or urls.api or "chat"
    prompt = _dist(args.prompt_tokens, "--prompt-tokens")
    output = _dist(args.output_tokens, "--output-tokens")
    if args.sessions is not None and args.sessions < 1:
        raise UsageError("--sessions must be >= 1")
    if args.turns is not None and args.sessions is None:
        raise UsageError("--turns needs --sessions")
    turns = _dist(args.turns or DEFAULTS["turns"], "--turns") if args.sessions else None
    run_id = args.run_id or f"bench-{secrets.token_hex(3)}"
    # A fixed seed repeats the same prompts, which an engine's prefix cache then remembers
    # from the previous run; so the default is a fresh seed, recorded to reproduce the run.
    seed = args.seed if args.seed is not None else secrets.randbits(32)
    workload = WorkloadSpec(
        prompt_tokens=prompt,
        output_tokens=output,
        sessions=args.sessions,
        turns=turns,
        bands=_bands(args.band),
        api_keys=tuple(args.api_key),
        run_id=run_id,
    )
    for name in ("timeout", "metrics_interval"):
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0")
    if args.max_error_rate is not None and not 0 <= args.max_error_rate <= 1:
        raise UsageError("--max-error-rate must be within 0..1")
    if args.duration is not None and not args.duration > 0:
        raise UsageError("--duration must be > 0")
    if args.requests is not None and args.requests < 1:
        raise UsageError("--requests must be >= 1")
    load = sweep = None
    if args.sweep:
        sweep = _sweep_spec(args, urls)
    else:
        requests = args.requests
        if requests is None and args.duration is None:
            requests = DEFAULTS["requests"]
        concurrency = args.concurrency
        if concurrency is None and args.rate is None:
            concurrency = DEFAULTS["concurrency"]
        try:
            load = LoadSpec(
                concurrency=concurrency,
                rate=args.rate,
                arrival=args.arrival,
                requests=requests,
                duration=args.duration,
            )
        except ValueError as exc:
            raise UsageError(str(exc).replace("concurrency", "--concurrency")) from None
    config = {
        "url": args.url,
        "api_url": urls.generation(api),
        "model": args.model,
        "api": api,
        "stream": args.stream,
        "concurrency": load.concurrency if load else None,
        "rate": load.rate if load else None,
        "arrival": args.arrival if load and load.rate else None,
        "requests": load.requests if load else args.requests,
        "duration_s": args.duration,
        "prompt_tokens": prompt.spec,
        "output_tokens": output.spec,
        "sessions": args.sessions,
        "turns": turns.spec if turns else None,
        "band": args.band,
        "api_keys": len(args.api_key),
        "band_header": args.band_header,
        "session_header": args.session_header,
        "run_id": run_id,
        "seed": seed,
        "timeout_s": args.timeout,
    }
    if sweep is not None:
        config["sweep"] = {
            "levels": list(sweep.levels),
            "knee_threshold": sweep.threshold,
            "latency_factor": sweep.latency_factor,
            "reference_throughput": sweep.reference_throughput,
        }
    return Settings(
        urls=urls,
        model=args.model,
        api=api,
        stream=args.stream,
        workload=workload,
        load=load,
        sweep=sweep,
        timeout=args.timeout,
        band_header=args.band_header,
        session_header=args.session_header,
        extra_headers=_headers(args.header),
        extra_body=_extra_body(args.extra_body),
        seed=seed,
        json_out=args.json,
        markdown_out=args.markdown,
        plot_out=args.plot,
        progress=stderr_tty if args.progress is None else args.progress,
        max_error_rate=args.max_error_rate,
        config=config,
    )


def _sweep_spec(args: argparse.Namespace, urls: ApiUrls) -> SweepSpec:
    if args.concurrency is not None or args.rate is not None:
        raise UsageError("--sweep chooses the concurrency itself: drop --concurrency / --rate")
    if args.levels:
        try:
            levels = [int(part) for part in args.levels.split(",") if part.strip()]
        except ValueError:
            raise UsageError(f"--levels {args.levels!r}: comma-separated integers") from None
        if not levels or levels != sorted(set(levels)) or levels[0] < 1:
            raise UsageError("--levels must be increasing integers >= 1")
    else:
        if args.max_concurrency < 1:
            raise UsageError("--max-concurrency must be >= 1")
        levels = doubling_levels(1, args.max_concurrency)
    if not args.knee_threshold > 0:
        raise UsageError("--knee-threshold must be > 0")
    if not args.latency_factor > 1:
        raise UsageError("--latency-factor must be > 1")
    if args.reference_throughput is not None and not args.reference_throughput > 0:
        raise UsageError("--reference-throughput must be > 0")
    return SweepSpec(
        levels=levels,
        requests=args.requests,
        duration=args.duration,
        threshold=args.knee_threshold,
        latency_factor=args.latency_factor,
        reference_throughput=args.reference_throughput,
        metrics_url=None if args.no_metrics else (args.metrics_url or urls.metrics),
        metrics_interval=args.metrics_interval,
    )


def _dist(text: str, option: str) -> Distribution:
    try:
        return parse_distribution(text)
    except DistributionError as exc:
        raise UsageError(f"{option}: {exc}") from None


def _bands(text: str | None) -> WeightedChoice | None:
    if not text:
        return None
    names, weights = [], []
    for item in text.split(","):
        name, colon, weight = item.strip().partition(":")
        try:
            value = float(weight) if colon else 1.0
        except ValueError:
            raise UsageError(f"--band {text!r}: weight {weight!r} is not a number") from None
        if not name or not value > 0 or name in names:
            raise UsageError(f"--band {text!r}: expected NAME or NAME:WEIGHT,... (weights > 0)")
        names.append(name)
        weights.append(value)
    return WeightedChoice(tuple(names), tuple(weights))


def _headers(items: list[str]) -> dict[str, str]:
    headers = {}
    for item in items:
        name, colon, value = item.partition(":")
        if not colon or not name.strip():
            raise UsageError(f"--header {item!r}: expected NAME:VALUE")
        headers[name.strip().lower()] = value.strip()
    return headers


def _extra_body(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--extra-body: not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise UsageError("--extra-body must be a JSON object")
    return body
