"""Upstream API keys of providers, read once when the edge starts.

`provider_keys` reads each provider's `api_key_env` (from the environment) or `api_key_file`
and fails with every problem at once when a configured source is missing or empty: a provider
whose key did not arrive is an error at start, never a stream of upstream 401s. The keys are
returned, never logged; problems name the variable or file, never a value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmgw.config.schema import Config

__all__ = ["CredentialsError", "provider_keys"]


class CredentialsError(ValueError):
    """Configured provider keys that could not be read; str() has one line per provider."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


def provider_keys(config: Config, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """provider id -> its upstream API key, for the providers that configure one."""
    environ = os.environ if environ is None else environ
    keys: dict[str, str] = {}
    problems: list[str] = []
    for index, provider in enumerate(config.providers):
        where = f"providers[{index}] ({provider.id})"
        if provider.api_key_env is not None:
            value = environ.get(provider.api_key_env, "").strip()
            if not value:
                problems.append(
                    f"{where}.api_key_env: environment variable {provider.api_key_env} is not set"
                )
        elif provider.api_key_file is not None:
            try:
                with open(provider.api_key_file, encoding="utf-8") as handle:
                    value = handle.read().strip()
            except OSError as exc:
                problems.append(f"{where}.api_key_file: {provider.api_key_file}: {exc.strerror}")
                continue
            if not value:
                problems.append(f"{where}.api_key_file: {provider.api_key_file} is empty")
        else:
            continue
        if value:
            keys[provider.id] = value
    if problems:
        raise CredentialsError(problems)
    return keys
