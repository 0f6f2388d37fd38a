"""Process plumbing shared by the service entry points: event loop, signals, logging."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from llmgw import logs
from llmgw.config import ConfigError, load_config
from llmgw.config.schema import Config


def service_instance(service: str) -> str:
    """This process's name in events and lease records: service, host and pid."""
    return f"{service}-{socket.gethostname()}-{os.getpid()}"


def setup_logging(service: str, config: Config | None = None) -> None:
    """The service's log: text or JSON on stderr, levels from ``config.log`` (`llmgw.logs`)."""
    logs.setup_logging(service, config.log if config is not None else None)


def load_or_exit(path: str) -> Config:
    """The config, or the errors on stderr and exit code 2."""
    try:
        return load_config(path)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        raise SystemExit(2) from None


def load_tool_config(args: argparse.Namespace) -> Config:
    """The config of a command-line tool that dials the cluster (`llmgw state`, `keys`,
    `events`), or exit 2. With ``--port-offset N`` an embedded config's NATS port moves by N, as
    `llmgw up --port-offset N` moved it for the cluster it started (the same rule as
    `llmgw.services.up.offset.shift_ports`: only `nats.url: embedded` on a fixed port moves; an
    explicit `nats.url` is used as it is)."""
    config = load_or_exit(args.config)
    offset = int(getattr(args, "port_offset", None) or 0)
    nats = config.nats
    if offset and nats.is_embedded and nats.embedded_port != 0:
        moved = nats.model_copy(update={"embedded_port": nats.embedded_port + offset})
        config = config.model_copy(update={"nats": moved})
    return config


def require_nats_server(config: Config, service: str) -> None:
    """Exit 2 with a clear message when the config names no NATS server to connect to."""
    if config.nats.is_embedded:
        print(
            f"llmgw {service}: nats.url is 'embedded', which only `llmgw up` can start; set "
            "LLMGW_NATS__URL=nats://HOST:PORT (the URL `llmgw up` prints) or nats.url in the config",
            file=sys.stderr,
        )
        raise SystemExit(2)


async def wait_for_stop_signal() -> None:
    """Return on SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


# Generation-0 collections after this many net allocations (CPython's default, 700, is more
# than one collection per request on the edge), and fewer full ones (docs/benchmarks.md,
# "Per-request trims", its history, measures the difference).
_GC_THRESHOLDS = (20_000, 20, 1_000)


def tune_gc() -> None:
    """Called once a service serves: freeze what startup allocated (modules, config, schemas: never garbage, and no longer
    scanned by every full collection) and collect less often. Cyclic garbage is still
    collected; a service's heap grows by at most a few young generations' worth."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*_GC_THRESHOLDS)


def run_service(main: Callable[[], Coroutine[Any, Any, int | None]]) -> int:
    """Run `main` on uvloop (when available) and return a process exit code: the one `main`
    returns (None: 0), or 130 when interrupted (Ctrl-C)."""
    runner: Callable[[Coroutine[Any, Any, int | None]], int | None]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        runner = asyncio.run
    try:
        return runner(main()) or 0
    except KeyboardInterrupt:
        return 130
