"""Connecting to NATS from the `nats` config section (one connection per process)."""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING, Any

import nats
from nats.aio.client import Client as NATS

if TYPE_CHECKING:
    from llmgw.config.schema import NatsConfig


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
    return await nats.connect(**connect_options(cfg, name))
