"""`llmgw up --secure`: the embedded NATS with one user per service role (`llmgw.nats_auth`).

The passwords are random per start, or read from `--nats-passwords FILE` (a YAML mapping of
role to password; a missing file is created, mode 0600, with new ones, and roles it lacks are
added), so scripts and operators can connect as a role: `LLMGW_NATS__USER=keys
LLMGW_NATS__PASSWORD=<the file's keys entry> llmgw keys list`. The nats-server config is
written beside them in a private temporary directory removed at exit. Each service gets its
role's user and password in its environment (LLMGW_NATS__USER / LLMGW_NATS__PASSWORD).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from pydantic import SecretStr

from llmgw.nats_auth import ROLES, SERVICE_ROLES, render_server_config

if TYPE_CHECKING:
    from llmgw.config import Config
    from llmgw.services.up.plan import ServiceSpec

__all__ = ["PROBE_ROLE", "SecureNats", "role_env", "write_private"]

# The role `llmgw up` checks the servers' readiness with (it may read JetStream account info).
PROBE_ROLE = "state"
_PASSWORD_BYTES = 24


def role_env(role: str, password: str) -> dict[str, str]:
    """The environment that makes a `llmgw` process connect as `role`."""
    return {"LLMGW_NATS__USER": role, "LLMGW_NATS__PASSWORD": password}


def _load_passwords(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in data.items()
    ):
        raise ValueError(f"{path}: expected a mapping of NATS role to password")
    unknown = sorted(set(data) - set(ROLES))
    if unknown:
        raise ValueError(f"{path}: {unknown[0]!r} is not a NATS role (roles: {', '.join(ROLES)})")
    return dict(data)


def write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT: make it private too
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)


@dataclass
class SecureNats:
    """The passwords and the nats-server config file of one `llmgw up --secure` run."""

    passwords: dict[str, str]
    config_path: Path
    passwords_path: Path
    _runtime_dir: Path | None = field(default=None, repr=False)

    @classmethod
    def prepare(cls, config: Config, passwords_file: str | None = None) -> SecureNats:
        """Passwords (from `passwords_file`, completed and written back, or new) and the config.

        Raises ValueError for a passwords file that is not a mapping of known roles.
        """
        given = Path(passwords_file) if passwords_file else None
        passwords = _load_passwords(given) if given is not None else {}
        missing = [role for role in ROLES if role not in passwords]
        for role in missing:
            passwords[role] = secrets.token_urlsafe(_PASSWORD_BYTES)
        runtime = Path(tempfile.mkdtemp(prefix="llmgw-up-secure-"))  # mode 0700
        passwords_path = given if given is not None else runtime / "nats-passwords.yaml"
        if missing or given is None:
            write_private(passwords_path, yaml.safe_dump(passwords, sort_keys=False))
        config_path = runtime / "nats-auth.conf"
        write_private(config_path, render_server_config(config, passwords))
        return cls(passwords, config_path, passwords_path, runtime)

    @property
    def server_args(self) -> tuple[str, ...]:
        return ("-c", str(self.config_path))

    @property
    def probe_auth(self) -> tuple[str, str]:
        return PROBE_ROLE, self.passwords[PROBE_ROLE]

    def as_role(self, config: Config, role: str) -> Config:
        """`config` connecting as `role`."""
        password = SecretStr(self.passwords[role])
        nats = config.nats.model_copy(update={"user": role, "password": password})
        return config.model_copy(update={"nats": nats})

    def spec_env(self, specs: list[ServiceSpec]) -> dict[str, Mapping[str, str]]:
        """Each NATS-using child's credentials by spec name (simulators use no NATS)."""
        return {
            spec.name: role_env(SERVICE_ROLES[spec.kind], self.passwords[SERVICE_ROLES[spec.kind]])
            for spec in specs
            if spec.kind in SERVICE_ROLES
        }

    def cleanup(self) -> None:
        if self._runtime_dir is not None:
            shutil.rmtree(self._runtime_dir, ignore_errors=True)
            self._runtime_dir = None
