"""Connecting to NATS from the `nats` config section (one connection per process)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import sys
from typing import TYPE_CHECKING, Any

import nats
from nats.aio.client import Client as NATS

if TYPE_CHECKING:
    from llmgw.config.schema import NatsConfig


class _Client(NATS):
    """nats-py's client, but a PONG for a flush that gave up (its timeout passed, or its caller
    was cancelled) is consumed quietly. nats-py (2.16) sets a result on that flush's cancelled
    future, which raises in its read loop and ends it: the connection then looks connected
    and reads nothing. PONGs come back in the order of their PINGs, so the first waiter is
    this PONG's."""

    async def _process_pong(self) -> None:
        if self._pongs and self._pongs[0].done():
            self._pongs.pop(0)
            self._pongs_received += 1
            self._pings_outstanding = 0
            return
        await super()._process_pong()


async def open_connection(**options: Any) -> NATS:
    """`nats.connect(**options)`, with the client every llmgw connection uses (`_Client`)."""
    nc = _Client()
    await nc.connect(**options)
    return nc


def connect_options(cfg: NatsConfig, name: str) -> dict[str, Any]:
    """Keyword arguments for `nats.connect` from the config section."""
    if cfg.url == "embedded":
        raise ValueError(
            "nats.url is 'embedded': only `llmgw up` starts an embedded server; "
            "set LLMGW_NATS__URL=nats://HOST:PORT to run a service on its own"
        )
    options: dict[str, Any] = {
        "servers": [u.strip() for u in cfg.url.split(",") if u.strip()],
        "name": name,
        "connect_timeout": cfg.connect_timeout,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
    }
    if cfg.user:
        options["user"] = cfg.user
    if cfg.password:
        options["password"] = cfg.password.get_secret_value()
    if cfg.token:
        options["token"] = cfg.token.get_secret_value()
    if cfg.creds_file:
        options["user_credentials"] = cfg.creds_file
    if cfg.nkeys_seed_file:
        options["nkeys_seed"] = cfg.nkeys_seed_file
    if cfg.tls is not None:
        context = ssl.create_default_context(cafile=cfg.tls.ca_file)
        if cfg.tls.cert_file:
            context.load_cert_chain(cfg.tls.cert_file, cfg.tls.key_file)
        if not cfg.tls.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        options["tls"] = context
    return options


async def connect(cfg: NatsConfig, name: str) -> NATS:
    """Connect with the configured servers, credentials and TLS; reconnects forever."""
    return await open_connection(**connect_options(cfg, name))


def embedded_servers(cfg: NatsConfig) -> list[str]:
    """The servers `llmgw up` starts for an embedded config: node i on embedded_port + i."""
    if cfg.embedded_port == 0:
        raise ValueError(
            "nats.url is 'embedded' with embedded_port 0 (a random port): set "
            "LLMGW_NATS__URL=nats://HOST:PORT to the URL `llmgw up` printed"
        )
    return [f"nats://127.0.0.1:{cfg.embedded_port + i}" for i in range(cfg.embedded_cluster)]


# What a command-line tool's talk with NATS raises when the server cannot be reached, refuses
# it, or does not answer in time: the tool then prints one line (`Refusals.report`) and exits 1.
UNREACHABLE: tuple[type[Exception], ...] = (OSError, TimeoutError, nats.errors.Error)


class Refusals:
    """A tool's `error_cb` (`record`): quiet (a CLI reports one clear error, not nats-py's retry
    tracebacks), but keeps the server's permission and authorization violations, so a tool whose
    request timed out can say it was refused (a wrong NATS role) instead of "cannot reach NATS"
    (`report`)."""

    def __init__(self) -> None:
        self.denied: list[str] = []

    async def record(self, exc: Exception) -> None:
        """The `error_cb` to pass (nats-py wants a coroutine function, not a callable object)."""
        text = str(exc).lower()
        if "permissions violation" in text or "authorization violation" in text:
            self.denied.append(str(exc).removeprefix("nats: ").strip("'"))

    def explain(self, tool: str) -> str | None:
        """The line a tool prints for a refusal, None if there was none."""
        if not self.denied:
            return None
        return (
            f"llmgw {tool}: NATS refused it: {self.denied[-1]} (is nats.user the role this "
            "tool needs? docs/keys.md, NATS permissions)"
        )

    def report(self, tool: str, exc: BaseException, problem: str = "cannot reach NATS") -> int:
        """Tell on stderr why `llmgw <tool>` could not talk to NATS (one of `UNREACHABLE`): the
        server's refusal if it gave one, else `problem` and the error (its type when it has no
        message, as a bare TimeoutError). The exit code: 1."""
        line = self.explain(tool) or f"llmgw {tool}: {problem}: {str(exc) or type(exc).__name__}"
        print(line, file=sys.stderr)
        return 1


async def connect_tool(cfg: NatsConfig, name: str, refusals: Refusals | None = None) -> NATS:
    """A command-line tool's connection: one attempt per server, bounded, quiet. An embedded
    config reaches the server (or cluster) `llmgw up` started with it on this machine.
    `refusals` collects the server's permission violations for the tool's error message."""
    if cfg.is_embedded:
        cfg = cfg.model_copy(update={"url": ",".join(embedded_servers(cfg))})
    options = connect_options(cfg, name)
    refusals = refusals if refusals is not None else Refusals()
    options.update(max_reconnect_attempts=1, reconnect_time_wait=0.1, error_cb=refusals.record)
    try:
        async with asyncio.timeout(cfg.connect_timeout * 2 + 5):
            return await open_connection(**options)
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        if refusals.denied:  # the server answered: say it refused, not that it is unreachable
            raise nats.errors.Error(
                f"NATS refused the connection: {refusals.denied[-1]} (nats.user / nats.password:"
                " docs/keys.md, NATS permissions)"
            ) from exc
        raise


async def drain_or_close(nc: NATS) -> None:
    """Drain a connected client (deliver what is pending, then close); close one that is not
    (draining a reconnecting client raises, and nothing pending could be delivered anyway)."""
    if nc.is_closed:
        return
    try:
        if nc.is_connected:
            await nc.drain()
            return
    except Exception:  # the connection dropped meanwhile
        pass
    with contextlib.suppress(Exception):
        await nc.close()
