"""Services as real processes (edge, admission, reaper) for crash and pause tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

import yaml

from llmgw.serving import free_port

MODEL = "chat-model"


def write_config(
    path: Path, nats_url: str, engine_url: str, bucket: str, limits: dict, **pinning
) -> Path:
    """The shipped defaults (flow control on, a scraper), one managed provider, one engine; but
    admission in a process of its own (`colocated: false`): an edge that crashes must not take
    the shards' owner with it, which is what these tests separate."""
    data = {
        "listen": f"127.0.0.1:{free_port()}",
        "admin_listen": f"127.0.0.1:{free_port()}",
        "nats": {"url": nats_url, "request_timeout": "2s"},
        "router": {"scrape_interval": "250ms", "load_bucket": f"load_{bucket}"},
        "timeouts": {"first_token": "30s", "idle": "30s", "total": "60s"},
        "pinning": {"bucket": bucket, "history": 64, **pinning},
        "admission": {"colocated": False},
        "models": [{"name": MODEL}],
        "providers": [
            {"id": "iris", "kind": "managed", "models": [{"name": MODEL, "limits": limits}]},
        ],
        "endpoints": [{"id": "engine-1", "url": engine_url, "provider": "iris", "models": [MODEL]}],
    }
    path.write_text(yaml.safe_dump(data))
    return path


class Service:
    """`python -m llmgw <command> [--config F] [args]`, its output collected line by line."""

    def __init__(self, command: str, config: Path | None, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        env["PYTHONUNBUFFERED"] = "1"
        options = ["--config", str(config)] if config is not None else []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "llmgw", *command.split(), *options, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip())
            if " ready" in line:
                self._ready.set()

    def wait_ready(self, timeout: float = 30) -> None:
        if not self._ready.wait(timeout):
            raise AssertionError("service never got ready:\n" + "\n".join(self.lines[-30:]))

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)

    def stop(self) -> None:
        self.ask_to_stop()
        self.wait_stopped()

    def ask_to_stop(self) -> None:
        """SIGCONT (a paused one must run to stop) and SIGTERM, unless it has exited."""
        if self.process.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGTERM):
                try:
                    os.kill(self.process.pid, sig)
                except ProcessLookupError:
                    return

    def wait_stopped(self) -> None:
        """Its exit (killed if it lingers past 10 s)."""
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


def stop_all(services: Iterable[Service]) -> None:
    """Stop services together: each asked first, then each waited for, instead of one drain
    after another."""
    services = list(services)
    for service in services:
        service.ask_to_stop()
    for service in services:
        service.wait_stopped()


def edge_url(config: Path) -> str:
    return "http://" + yaml.safe_load(config.read_text())["listen"]
