"""Test harness for `llmgw up`: a config on free ports and a handle on a running `llmgw up`."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from llmgw.serving import free_port, free_port_block

REPO = Path(__file__).resolve().parents[2]
LOCAL_CONFIG = REPO / "config" / "local.yaml"


# What `llmgw up` prints once ready about the admin token it made (never the token itself).
ADMIN_TOKEN_LINE = r"^llmgw up: admin API token in (\S+) "

ADMIN_PORTS = 4  # `llmgw up` gives admission, reaper and scraper the three after the edge's


def admin_port_block() -> int:
    """A port p with p .. p+3 free: the edge's admin port and the three that follow it."""
    return free_port_block(ADMIN_PORTS)


def _distinct_free_ports(count: int, avoid: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports and port not in avoid:
            ports.append(port)
    return ports


def write_cluster_config(path: Path, **overrides: Any) -> Path:
    """config/local.yaml with every port replaced by a free one (NATS: any free port)."""
    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    admin = admin_port_block()
    ports = iter(
        _distinct_free_ports(1 + len(data["endpoints"]), set(range(admin, admin + ADMIN_PORTS)))
    )
    data["listen"] = f"127.0.0.1:{next(ports)}"
    data["admin_listen"] = f"127.0.0.1:{admin}"
    data["nats"] = {"url": "embedded", "embedded_port": 0}
    for endpoint in data["endpoints"]:
        endpoint["url"] = f"http://127.0.0.1:{next(ports)}"
    data.update(overrides)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def llmgw_cli(
    config: Path, command: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`llmgw COMMAND --config CONFIG ARGS` run to its end, with no LLMGW_ variable of ours
    but those in `env`."""
    full = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLMGW_")}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "llmgw", command, "--config", str(config), *args],
        cwd=REPO,
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )


def config_apply(
    path: Path, nats_url: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`llmgw config apply PATH` against the cluster whose NATS is `nats_url` (and `env`, e.g.
    a NATS user), run to its end."""
    full = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLMGW_")}
    return subprocess.run(
        [sys.executable, "-m", "llmgw", "config", "apply", str(path)],
        env={**full, **(env or {}), "LLMGW_NATS__URL": nats_url},
        capture_output=True,
        text=True,
        timeout=60,
    )


class WatchedProcess:
    """A Python subprocess (`python ARGS`) whose output is collected line by line, with no
    LLMGW_ variable of ours but those in `env`."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        full = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLMGW_")}
        full.update(env or {})
        full["PYTHONUNBUFFERED"] = "1"
        self.process = subprocess.Popen(
            [sys.executable, *args],
            cwd=REPO,
            env=full,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 60.0, count: int = 1) -> re.Match[str]:
        """The `count`-th output line matching `pattern`; fails with the output so far."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                matches = [m for m in map(regex.search, self.lines) if m]
                if len(matches) >= count:
                    return matches[count - 1]
                left = deadline - time.monotonic()
                if left <= 0 or (not self._reader.is_alive()):
                    raise AssertionError(
                        f"no line matching {pattern!r} (x{count}); output:\n"
                        + "\n".join(self.lines)
                    )
                self._changed.wait(left)

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 30.0) -> int:
        self.process.send_signal(sig)
        code = self.process.wait(timeout)
        self._reader.join(5)
        return code


class UpProcess(WatchedProcess):
    """`python -m llmgw up` as a subprocess; its output is collected line by line."""

    def __init__(self, config: Path, *extra_args: str) -> None:
        super().__init__("-m", "llmgw", "up", "--config", str(config), *extra_args)

    def admin_token_file(self, timeout: float = 90.0) -> str:
        """The file of the admin token this run made (the line `llmgw up` prints at ready)."""
        return self.wait_for(ADMIN_TOKEN_LINE, timeout).group(1)

    def admin_headers(self, timeout: float = 90.0) -> dict[str, str]:
        """Headers that let a client call the admin API of this run."""
        token = Path(self.admin_token_file(timeout)).read_text().strip()
        return {"authorization": f"Bearer {token}"}

    def pids(self) -> dict[str, int]:
        """Latest pid of every process it reported ("[name] started pid N", "[nats-0] ... pid N")."""
        found: dict[str, int] = {}
        for line in list(self.lines):
            if match := re.match(r"^\[([\w.-]+)\] started pid (\d+)", line):
                found[match.group(1)] = int(match.group(2))
            elif match := re.match(r"^\[(nats(?:-\d+)?)\] .*\(pid (\d+)", line):
                found[match.group(1)] = int(match.group(2))  # one server, or a cluster's nodes
        return found

    def all_pids(self) -> set[int]:
        pids = {int(m) for line in list(self.lines) for m in re.findall(r"started pid (\d+)", line)}
        return pids | set(self.pids().values())

    def kill_everything(self) -> None:
        """Last-resort cleanup: SIGKILL `llmgw up` and every process it reported."""
        for pid in [self.process.pid, *self.all_pids()]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)


def process_exists(pid: int) -> bool:
    """Whether `pid` runs (a zombie awaiting its reaper counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        # /proc/PID/stat: "pid (comm) STATE ..."; comm may contain spaces and parentheses.
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True
