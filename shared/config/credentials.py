"""Upstream API keys of providers, read when the edge starts and at each applied config.

`provider_keys` reads each provider's `api_key_env` (from the environment) or `api_key_file`
and fails with every problem at once when a configured source is missing or empty: a provider
whose key did not arrive is an error at start, never a stream of upstream 401s. `read_keys`
reads the same, provider by provider, for an edge that runs already (an applied config: a new
provider's key, a key file rotated): it returns the keys it read and the problems by provider,
so the caller keeps what runs where a source cannot be read now. The keys are returned, never
logged; problems name the variable or file, never a value.

`admin_token` reads the admin API's token (`auth.admin_token` or `auth.admin_token_file`) the
same way, once at a service's start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from llmgw.config.sections import MIN_ADMIN_TOKEN

if TYPE_CHECKING:
    from llmgw.config.schema import Config

__all__ = ["CredentialsError", "admin_token", "provider_keys", "read_keys"]


class CredentialsError(ValueError):
    """Configured provider keys that could not be read; str() has one line per provider."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


def provider_keys(config: Config, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """provider id -> its upstream API key, for the providers that configure one."""
    keys, problems = read_keys(config, environ)
    if problems:
        raise CredentialsError(list(problems.values()))
    return keys


def read_keys(
    config: Config, environ: Mapping[str, str] | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """(provider id -> key, provider id -> problem): each provider that configures a key has
    one or the other; a provider without `api_key_env` or `api_key_file` has neither."""
    environ = os.environ if environ is None else environ
    keys: dict[str, str] = {}
    problems: dict[str, str] = {}
    for index, provider in enumerate(config.providers):
        where = f"providers[{index}] ({provider.id})"
        if provider.api_key_env is not None:
            value = environ.get(provider.api_key_env, "").strip()
            if not value:
                problems[provider.id] = (
                    f"{where}.api_key_env: environment variable {provider.api_key_env} is not set"
                )
        elif provider.api_key_file is not None:
            try:
                with open(provider.api_key_file, encoding="utf-8") as handle:
                    value = handle.read().strip()
            except OSError as exc:
                problems[provider.id] = (
                    f"{where}.api_key_file: {provider.api_key_file}: {exc.strerror}"
                )
                continue
            if not value:
                problems[provider.id] = f"{where}.api_key_file: {provider.api_key_file} is empty"
        else:
            continue
        if value:
            keys[provider.id] = value
    return keys, problems


def admin_token(config: Config) -> str | None:
    """The admin API's bearer token, None when none is configured (the API then refuses every
    call). A token file that cannot be read, is empty or too short is a `CredentialsError`."""
    auth = config.auth
    if auth.admin_token is not None:
        return auth.admin_token.get_secret_value().strip()
    if auth.admin_token_file is None:
        return None
    where = f"auth.admin_token_file: {auth.admin_token_file}"
    try:
        with open(auth.admin_token_file, encoding="utf-8") as handle:
            token = handle.read().strip()
    except OSError as exc:
        raise CredentialsError([f"{where}: {exc.strerror}"]) from None
    if len(token) < MIN_ADMIN_TOKEN:
        raise CredentialsError(
            [f"{where}: holds {len(token)} characters; at least {MIN_ADMIN_TOKEN} expected"]
        )
    return token
