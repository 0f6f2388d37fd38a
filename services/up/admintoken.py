"""The admin API's token for the cluster `llmgw up` starts (docs/security.md).

The admin ports' `/admin/...` routes (the live fleet) need a bearer token. `llmgw up` gives
every child the same one:

- a token the config gives (`auth.admin_token`, or `LLMGW_AUTH__ADMIN_TOKEN`) is used as is;
- `auth.admin_token_file`: the file's token; a file that does not exist yet is created with a
  new random token (mode 0600), so it stays the same from one run to the next;
- neither: a new random token per run, in a private temporary file (its directory is mode
  0700) removed at exit, given to the children as ``LLMGW_AUTH__ADMIN_TOKEN_FILE``.

The token is never printed: `llmgw up` says where it is.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from llmgw.services.up.secure import write_private

if TYPE_CHECKING:
    from llmgw.config import Config

__all__ = ["AdminToken"]

ADMIN_TOKEN_FILE_ENV = "LLMGW_AUTH__ADMIN_TOKEN_FILE"
_TOKEN_BYTES = 32


@dataclass
class AdminToken:
    """Where this run's admin token is: ``env`` for the children, ``where`` for the operator."""

    env: dict[str, str]
    where: str
    _runtime_dir: Path | None = field(default=None, repr=False)

    @classmethod
    def prepare(cls, config: Config) -> AdminToken:
        """The config's token, its file (created if missing), or a new one in a temporary
        file. Raises OSError when a token file cannot be created."""
        auth = config.auth
        if auth.admin_token is not None:
            return cls({}, "auth.admin_token (the config, or LLMGW_AUTH__ADMIN_TOKEN)")
        if auth.admin_token_file is not None:
            path = Path(auth.admin_token_file)
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                write_private(path, secrets.token_urlsafe(_TOKEN_BYTES) + "\n")
            return cls({}, str(path))
        runtime = Path(tempfile.mkdtemp(prefix="llmgw-up-admin-"))  # mode 0700
        path = runtime / "admin-token"
        write_private(path, secrets.token_urlsafe(_TOKEN_BYTES) + "\n")
        return cls({ADMIN_TOKEN_FILE_ENV: str(path)}, str(path), runtime)

    @property
    def announcement(self) -> str:
        """The line that tells the operator how to call the admin API."""
        if self.where.startswith("auth."):
            return f"llmgw up: the admin API (/admin/...) takes the token of {self.where}"
        return (
            f"llmgw up: admin API token in {self.where} (send 'Authorization: Bearer TOKEN'; "
            f"the CLI reads it with export {ADMIN_TOKEN_FILE_ENV}={self.where})"
        )

    def cleanup(self) -> None:
        if self._runtime_dir is not None:
            shutil.rmtree(self._runtime_dir, ignore_errors=True)
            self._runtime_dir = None
