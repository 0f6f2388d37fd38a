"""`llmgw config check FILE`: validate a config and print the effective configuration.

Exit codes: 0 when the file is valid (the effective config, environment overrides applied, goes to
stdout as YAML with durations as strings and secrets masked); 2 when it is not (one
"FILE: field.path: problem" line per problem on stderr). Warnings about legal-but-suspicious values go
to stderr and do not change the exit code.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Mapping
from typing import Any, TextIO

import yaml

from llmgw.config.loader import ConfigError, load_config
from llmgw.config.schema import Config, ConfigWarning

EXIT_OK = 0
EXIT_INVALID = 2


def effective_config_yaml(config: Config) -> str:
    """The config as YAML: every field with its effective value, durations as strings, secrets masked."""
    text: str = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
    return text


def check_file(
    path: str,
    env: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        try:
            config = load_config(path, env=env)
        except ConfigError as exc:
            for line in exc.lines:
                print(line, file=err)
            return EXIT_INVALID
    for warning in caught:
        if issubclass(warning.category, ConfigWarning):
            print(f"{path}: warning: {warning.message}", file=err)
        else:
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )
    out.write(f"# effective configuration of {path}\n")
    out.write(effective_config_yaml(config))
    return EXIT_OK


def run(args: argparse.Namespace | Any) -> int:
    """Entry point of `llmgw config check FILE` (args.file)."""
    return check_file(args.file)
