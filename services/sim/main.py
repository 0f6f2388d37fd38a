"""``llmgw sim engine`` / ``llmgw sim provider``: run one simulator until SIGINT/SIGTERM.

Parameters come from, in increasing precedence: the kind's defaults, the ``simulate`` block of
``--endpoint`` in ``--config`` (with the endpoint url's host/port and model names, and for an
engine the endpoint's ``kv_events`` addresses unless the block sets ``kv_events_endpoint``),
then ``--set key=value``, then ``--host/--port/--model/--seed`` and (engines)
``--metrics-dialect``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import uvicorn

from llmgw.runtime import run_service
from llmgw.services.sim.apps import create_engine_app, create_provider_app
from llmgw.services.sim.engine_runtime import EngineBackend
from llmgw.services.sim.openai_app import SimApp
from llmgw.services.sim.params import EngineParams, ProviderParams, apply_overrides
from llmgw.serving import bind_socket

__all__ = [
    "SimSettings",
    "create_engine_app",
    "create_provider_app",
    "resolve_settings",
    "run_engine",
    "run_provider",
]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


class UsageError(Exception):
    """Bad command-line input or config reference; printed without a traceback."""


@dataclass
class SimSettings:
    params: EngineParams | ProviderParams
    host: str
    port: int
    models: list[str]


def run_engine(args: argparse.Namespace) -> int:
    return _run(args, "engine")


def run_provider(args: argparse.Namespace) -> int:
    return _run(args, "provider")


def resolve_settings(args: argparse.Namespace, kind: str) -> SimSettings:
    """Merge defaults, the config's endpoint and the command line (see the module docstring)."""
    params: EngineParams | ProviderParams = EngineParams() if kind == "engine" else ProviderParams()
    host, port = DEFAULT_HOST, DEFAULT_PORT
    models: list[str] = []
    config_path = getattr(args, "config", None)
    endpoint_id = getattr(args, "endpoint", None)
    if config_path is not None or endpoint_id is not None:
        if config_path is None or endpoint_id is None:
            raise UsageError("--config and --endpoint go together")
        params, host, port, models = _from_config(config_path, endpoint_id, kind, params)
    extra: dict[str, object] = {} if getattr(args, "seed", None) is None else {"seed": args.seed}
    if getattr(args, "metrics_dialect", None) is not None:
        extra["metrics_dialect"] = args.metrics_dialect
    try:
        params = apply_overrides(params, getattr(args, "set", None) or [], extra)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if getattr(args, "host", None):
        host = args.host
    if getattr(args, "port", None) is not None:
        port = args.port
    if getattr(args, "model", None):
        models = list(args.model)
    if params.served_models:
        models = list(params.served_models)
    return SimSettings(params=params, host=host, port=port, models=models)


def _from_config(
    path: str, endpoint_id: str, kind: str, params: EngineParams | ProviderParams
) -> tuple[EngineParams | ProviderParams, str, int, list[str]]:
    from llmgw.config import ConfigError, load_config  # lazy: the simulator runs without it

    try:
        config = load_config(path)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    endpoints = {endpoint.id: endpoint for endpoint in config.endpoints}
    endpoint = endpoints.get(endpoint_id)
    if endpoint is None:
        known = ", ".join(endpoints) or "none"
        raise UsageError(f"{path}: no endpoint {endpoint_id!r} (endpoints: {known})")
    simulate = endpoint.simulate
    if simulate is not None:
        if simulate.kind != kind:
            raise UsageError(
                f"{path}: endpoint {endpoint_id!r} simulates a {simulate.kind}; "
                f"run `llmgw sim {simulate.kind}`"
            )
        params = simulate
    url = urlsplit(str(endpoint.url))
    host = url.hostname or DEFAULT_HOST
    port = url.port or (443 if url.scheme == "https" else 80)
    renames = getattr(endpoint, "upstream_model", None) or {}
    # The gateway sends the upstream's name, so that is what the simulator must serve.
    models = [renames.get(name, name) for name in endpoint.models]
    source = getattr(endpoint, "kv_events", None)
    if isinstance(params, EngineParams) and source is not None and not params.kv_events_endpoint:
        # The engine publishes where the gateway subscribes, as it listens on the url's port.
        params = params.model_copy(
            update={
                "kv_events_endpoint": source.endpoint,
                "kv_events_replay_endpoint": source.replay_endpoint,
                "kv_events_topic": source.topic,
            }
        )
    return params, host, port, models


def _run(args: argparse.Namespace, kind: str) -> int:
    try:
        settings = resolve_settings(args, kind)
    except UsageError as exc:
        print(f"llmgw sim {kind}: {exc}", file=sys.stderr)
        return 2
    return run_service(lambda: _serve(settings, kind))


async def _serve(settings: SimSettings, kind: str) -> int:
    if isinstance(settings.params, EngineParams):
        try:
            app = create_engine_app(settings.params, settings.models)
        except (ValueError, ImportError) as exc:  # its tokenizer files, or their extra
            print(f"llmgw sim {kind}: tokenizer: {exc}", file=sys.stderr)
            return 2
    else:
        app = create_provider_app(settings.params, settings.models)
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        print(
            f"llmgw sim {kind}: cannot listen on {settings.host}:{settings.port}: {exc}",
            file=sys.stderr,
        )
        return 1
    if app.hooks.startup is not None:
        try:
            await app.hooks.startup()  # binds an engine's KV-event sockets before it serves
        except OSError as exc:
            sock.close()
            print(f"llmgw sim {kind}: {exc}", file=sys.stderr)
            return 1
    # Without TCP_NODELAY the body write after the header write waits for the client's delayed
    # ACK (~40 ms per response on Linux); accepted sockets inherit the option.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        loop="none",
        http="httptools",
        access_log=False,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    # uvicorn exposes no start-up event; its `started` flag flips once it accepts connections.
    while not server.started and not task.done():  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    if server.started:
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        print(
            f"llmgw sim {kind} ready on http://{host}:{port} (models: {', '.join(app.models)})"
            f"{_kv_events_note(app)}",
            flush=True,
        )
    await task
    return 0 if server.started else 1


def _kv_events_note(app: SimApp) -> str:
    """Where an engine publishes KV cache events, as bound (a ``*`` port resolved)."""
    backend = app.backend
    if not isinstance(backend, EngineBackend) or backend.kv_publisher is None:
        return ""
    publisher = backend.kv_publisher
    replay = f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else ""
    return f"; KV events on {publisher.endpoint}{replay}"


class _Server(uvicorn.Server):
    """A uvicorn server whose SIGINT/SIGTERM stop it and return normally (uvicorn re-raises)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM)
        for sig in signals:
            loop.add_signal_handler(sig, self._stop)
        try:
            yield
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    def _stop(self) -> None:
        if self.should_exit:
            self.force_exit = True  # second signal: don't wait for open streams
        self.should_exit = True
