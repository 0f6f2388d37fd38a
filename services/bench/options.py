"""The command-line options of ``llmgw bench`` (argparse only: the ``llmgw`` parser imports this
module to build itself, so it must stay free of aiohttp and the rest of the bench).

Values are checked in `llmgw.services.bench.main.resolve`; a bad value exits with status 2.
"""

from __future__ import annotations

import argparse
from typing import TypedDict

__all__ = ["DEFAULTS", "add_bench_arguments"]


class _Defaults(TypedDict):
    concurrency: int
    requests: int
    prompt_tokens: str
    output_tokens: str
    turns: str
    band_header: str
    session_header: str
    timeout: float
    max_concurrency: int
    knee_threshold: float
    latency_factor: float
    metrics_interval: float


DEFAULTS: _Defaults = {
    "concurrency": 8,
    "requests": 200,
    "prompt_tokens": "fixed:256",
    "output_tokens": "fixed:128",
    "turns": "uniform:2-6",
    "band_header": "x-llmgw-band",
    "session_header": "x-session-id",
    "timeout": 300.0,
    "max_concurrency": 256,
    "knee_threshold": 0.1,
    "latency_factor": 1.5,
    "metrics_interval": 0.2,
}

EPILOG = """\
distributions (DIST): fixed:N (or N), uniform:A-B (or A-B),
  lognormal:mean=M,sigma=S[,min=A][,max=B]; prompt text is about 4.3 characters per token.
exit status: 0 done; 1 target unreachable, no request succeeded, error rate above
  --max-error-rate, or an output file could not be written; 2 bad options; 130 interrupted.
See docs/bench.md."""


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every ``llmgw bench`` option on `parser`."""
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    d = DEFAULTS
    parser.add_argument(
        "url", help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8080 or .../v1"
    )
    parser.add_argument("--model", "-m", help="model name (default: the first of GET /v1/models)")
    parser.add_argument(
        "--api",
        choices=["chat", "completions"],
        default=None,
        help="/v1/chat/completions (default) or /v1/completions",
    )

    load = parser.add_argument_group("load shape")
    shape = load.add_mutually_exclusive_group()
    shape.add_argument(
        "--concurrency",
        "-c",
        type=int,
        metavar="N",
        default=None,
        help=f"requests in flight at once, closed loop (default {d['concurrency']})",
    )
    shape.add_argument(
        "--rate", "-r", type=float, default=None, metavar="R", help="requests per second, open loop"
    )
    load.add_argument(
        "--arrival",
        choices=["poisson", "fixed"],
        default="poisson",
        help="arrival process with --rate (default poisson)",
    )
    load.add_argument(
        "--requests",
        "-n",
        type=int,
        metavar="N",
        default=None,
        help=f"requests to send (default {d['requests']}; with --sweep: per level, "
        "8 x concurrency, at least 16)",
    )
    load.add_argument(
        "--duration",
        "-d",
        type=float,
        metavar="S",
        default=None,
        help="stop sending after this many seconds (with --sweep: per level)",
    )
    load.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream responses (default: yes; TTFT and TPOT need it)",
    )
    load.add_argument(
        "--timeout", type=float, default=d["timeout"], metavar="S", help="seconds per request"
    )

    work = parser.add_argument_group("requests")
    work.add_argument(
        "--prompt-tokens",
        default=d["prompt_tokens"],
        metavar="DIST",
        help=f"tokens of each new user message (default {d['prompt_tokens']})",
    )
    work.add_argument(
        "--output-tokens",
        default=d["output_tokens"],
        metavar="DIST",
        help=f"max_tokens of each request (default {d['output_tokens']})",
    )
    work.add_argument(
        "--sessions",
        type=int,
        default=None,
        metavar="N",
        help="run this many multi-turn conversations",
    )
    work.add_argument(
        "--turns",
        default=None,
        metavar="DIST",
        help=f"turns per conversation, with --sessions (default {d['turns']})",
    )
    work.add_argument(
        "--band",
        default=None,
        metavar="BAND",
        help="band header value, or a weighted mix such as platinum:1,bronze:9",
    )
    work.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        default=[],
        help="send Authorization: Bearer KEY; repeat for several tenants (round robin)",
    )
    work.add_argument(
        "--band-header", default=d["band_header"], metavar="NAME", help="default %(default)s"
    )
    work.add_argument(
        "--session-header", default=d["session_header"], metavar="NAME", help="default %(default)s"
    )
    work.add_argument(
        "--header", action="append", default=[], metavar="NAME:VALUE", help="extra header"
    )
    work.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help="merged into each body, e.g. '{\"ignore_eos\": true}'",
    )
    work.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="S",
        help="seed of the workload (default: random, recorded in the results)",
    )
    work.add_argument(
        "--run-id", default=None, metavar="ID", help="prefix of session ids (default: random)"
    )

    out = parser.add_argument_group("output")
    out.add_argument("--json", default=None, metavar="FILE", help="write results JSON (- stdout)")
    out.add_argument("--markdown", default=None, metavar="FILE", help="write the markdown table")
    out.add_argument("--plot", default=None, metavar="FILE.png", help="write a PNG (matplotlib)")
    out.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live progress line on stderr (default: when stderr is a terminal)",
    )
    out.add_argument(
        "--max-error-rate",
        type=float,
        default=None,
        metavar="F",
        help="exit 1 when more than this fraction of requests failed",
    )

    sweep = parser.add_argument_group("saturation sweep")
    sweep.add_argument(
        "--sweep", action="store_true", help="find the engine's knee; recommend config values"
    )
    sweep.add_argument(
        "--levels",
        default=None,
        metavar="C1,C2,...",
        help="concurrency levels, e.g. 1,2,4,8 (default: doubling)",
    )
    sweep.add_argument(
        "--max-concurrency",
        type=int,
        metavar="N",
        default=d["max_concurrency"],
        help="last doubling level (default %(default)s)",
    )
    sweep.add_argument(
        "--knee-threshold",
        type=float,
        metavar="F",
        default=d["knee_threshold"],
        help="throughput growth per doubling below which the curve is flat (default %(default)s)",
    )
    sweep.add_argument(
        "--latency-factor",
        type=float,
        metavar="F",
        default=d["latency_factor"],
        help="target_waiting: queue depth where latency reaches this x the knee's "
        "(default %(default)s)",
    )
    sweep.add_argument(
        "--reference-throughput",
        type=float,
        default=None,
        metavar="TOK_S",
        help="output tokens/s that weigh 100 (default: this engine's knee)",
    )
    sweep.add_argument(
        "--metrics-url",
        default=None,
        metavar="URL",
        help="engine metrics (default: URL without /v1 + /metrics)",
    )
    sweep.add_argument("--no-metrics", action="store_true", help="client-side measurements only")
    sweep.add_argument(
        "--metrics-interval",
        type=float,
        metavar="S",
        default=d["metrics_interval"],
        help="seconds between metrics scrapes (default %(default)s)",
    )
