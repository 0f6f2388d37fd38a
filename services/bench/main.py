"""``llmgw bench``: check the options, run the load or the sweep, write the results.

Exit status: 0 done; 1 the target could not be reached, no request succeeded, the error rate
exceeded ``--max-error-rate``, or an output file could not be written; 2 bad options (including
``--plot`` without matplotlib); 130 interrupted (a first Ctrl-C stops sending, lets the requests
in flight finish and still writes the results; a second one aborts).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

from llmgw.runtime import run_service
from llmgw.services.bench.client import RequestOptions, fetch_model
from llmgw.services.bench.report import markdown, run_result, sweep_result
from llmgw.services.bench.runner import Progress, open_session, run_load
from llmgw.services.bench.settings import Settings, UsageError, resolve
from llmgw.services.bench.sweep_runner import run_sweep

__all__ = ["run"]


def run(args: argparse.Namespace, *, stderr: TextIO | None = None) -> int:
    stderr = stderr or sys.stderr
    try:
        settings = resolve(args, stderr_tty=stderr.isatty())
        if settings.plot_out is not None:
            _require_matplotlib()
    except UsageError as exc:
        print(f"llmgw bench: {exc}", file=stderr)
        return 2
    return run_service(lambda: _bench(settings, stderr))


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib, which is not installed: pip install 'llmgw[bench]'"
        ) from None


# -- running ---------------------------------------------------------------------------------
async def _bench(settings: Settings, stderr: TextIO) -> int:
    stop = asyncio.Event()
    rng = random.Random(settings.seed)
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    progress = Progress(stderr) if settings.progress else None
    interrupted = False
    async with open_session(settings.timeout) as session:
        model = settings.model
        if model is None:
            headers = dict(settings.extra_headers)
            if settings.workload.api_keys:
                headers["authorization"] = f"Bearer {settings.workload.api_keys[0]}"
            try:
                model = await fetch_model(session, settings.urls.models, headers)
            except ValueError as exc:
                print(f"llmgw bench: {exc}; pass --model", file=stderr)
                return 1
        options = RequestOptions(
            url=settings.urls.generation(settings.api),
            model=model,
            api=settings.api,
            stream=settings.stream,
            band_header=settings.band_header,
            session_header=settings.session_header,
            extra_body=settings.extra_body,
            extra_headers=settings.extra_headers,
        )
        config = {**settings.config, "model": model}
        with _first_interrupt_stops(stop, stderr):
            if settings.sweep is not None:
                outcome = await run_sweep(
                    session,
                    options,
                    settings.workload,
                    settings.sweep,
                    rng=rng,
                    progress=progress,
                    stop=stop,
                )
                result = sweep_result(
                    config, outcome.levels, outcome.recommendation, started_at, outcome.metrics
                )
                total = sum(level["summary"]["requests"] for level in outcome.levels)
                failed = sum(
                    level["summary"]["requests"] - level["summary"]["ok"]
                    for level in outcome.levels
                )
            else:
                assert settings.load is not None
                records = await run_load(
                    session,
                    options,
                    settings.workload,
                    settings.load,
                    rng=rng,
                    progress=progress,
                    stop=stop,
                )
                result = run_result(config, records, started_at)
                total, failed = len(records), sum(not r.ok for r in records)
        interrupted = stop.is_set()
    if not _write_outputs(settings, result, stderr):
        return 1
    if interrupted:
        return 130
    if total == 0 or failed == total:
        print(f"llmgw bench: no request succeeded ({failed} of {total} failed)", file=stderr)
        return 1
    if settings.max_error_rate is not None and failed / total > settings.max_error_rate:
        print(
            f"llmgw bench: {failed / total:.1%} of requests failed, more than "
            f"--max-error-rate {settings.max_error_rate:g}",
            file=stderr,
        )
        return 1
    return 0


@contextlib.contextmanager
def _first_interrupt_stops(stop: asyncio.Event, stderr: TextIO) -> Iterator[None]:
    """The first SIGINT sets `stop`; the next one raises KeyboardInterrupt as usual."""
    loop = asyncio.get_running_loop()

    def on_interrupt() -> None:
        loop.remove_signal_handler(signal.SIGINT)
        stop.set()
        print(
            "\nllmgw bench: stopping, waiting for requests in flight (Ctrl-C again to abort)",
            file=stderr,
        )

    try:
        loop.add_signal_handler(signal.SIGINT, on_interrupt)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def _write_outputs(settings: Settings, result: dict[str, Any], stderr: TextIO) -> bool:
    text = markdown(result)
    try:
        if settings.json_out is not None:
            data = json.dumps(result, indent=1) + "\n"
            if settings.json_out == "-":
                sys.stdout.write(data)
            else:
                with open(settings.json_out, "w", encoding="utf-8") as handle:
                    handle.write(data)
        if settings.markdown_out is not None:
            with open(settings.markdown_out, "w", encoding="utf-8") as handle:
                handle.write(text)
        if settings.plot_out is not None:
            from llmgw.services.bench.plot import plot_result

            plot_result(result, settings.plot_out)
    except OSError as exc:
        print(f"llmgw bench: cannot write results: {exc}", file=stderr)
        return False
    if settings.json_out != "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    return True
