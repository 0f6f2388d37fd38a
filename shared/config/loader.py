"""Loading a config: YAML file -> dict -> `Config`, with LLMGW_* environment overrides on top.

Every failure becomes one `ConfigError` whose lines read "FILE: field.path: problem", one per problem,
so an operator can fix them all in one pass. Values that came from the environment say so
("(from LLMGW_ROUTER__RETRIES)"), because the file alone would not explain them.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, SecretStr, ValidationError
from pydantic_settings import SettingsError

from llmgw.config.schema import (
    ENV_NESTED_DELIMITER,
    ENV_PREFIX,
    Config,
    MappingEnvSource,
    environ_override,
)


class ConfigError(Exception):
    """An invalid or unreadable config; `problems` holds "field.path: message" strings."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = list(problems)
        super().__init__(self.__str__())

    @property
    def lines(self) -> list[str]:
        return [f"{self.source}: {problem}" for problem in self.problems]

    def __str__(self) -> str:
        return "\n".join(self.lines)


def load_config(path: str | Path | None, env: Mapping[str, str] | None = None) -> Config:
    """Read, validate and return the config at `path`; `env` replaces os.environ when given."""
    if path is None:
        raise ConfigError("<config>", ["no config file given"])
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        if Path(path).is_absolute():
            raise ConfigError(source, ["no such file"]) from None
        raise ConfigError(
            source,
            [f"no such file in {Path.cwd()} (pass --config PATH, or run from the repository root)"],
        ) from None
    except IsADirectoryError:
        raise ConfigError(source, ["is a directory, not a file"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(source, [f"cannot read: {exc}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(source, [_yaml_problem(exc)]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"invalid YAML: {exc}"]) from None
    if data is None:
        raise ConfigError(source, ["empty file"])
    return config_from_dict(data, source=source, env=env)


def config_from_dict(
    data: Mapping[str, Any], source: str = "<dict>", env: Mapping[str, str] | None = None
) -> Config:
    """Validate an already-parsed config mapping (file values), applying the environment on top."""
    if not isinstance(data, Mapping):
        raise ConfigError(source, [f"top level must be a mapping of fields, got {_kind(data)}"])
    for key in data:
        # Keys like "_env_file" would reach BaseSettings' own keyword arguments; reject them as typos.
        if not isinstance(key, str) or key.startswith("_"):
            raise ConfigError(source, [f"{key}: unknown field"])
    environ = os.environ if env is None else env
    token = environ_override.set(environ)
    try:
        return Config(**data)
    except ValidationError as exc:
        raise ConfigError(source, format_validation_error(exc, _env_values(environ))) from None
    except SettingsError as exc:
        raise ConfigError(source, [_settings_problem(exc)]) from None
    finally:
        environ_override.reset(token)


def format_validation_error(
    error: ValidationError, env_values: Mapping[str, Any] | None = None
) -> list[str]:
    """One "field.path: message" string per pydantic error."""
    problems = []
    for item in error.errors():
        loc = tuple(item["loc"])
        message = _message(item, loc)
        origin = _env_origin(loc, env_values or {})
        problems.append(f"{format_loc(loc) or '(top level)'}: {message}{origin}")
    return problems


def format_loc(loc: Sequence[str | int]) -> str:
    """("providers", 0, "models", 1, "limits") -> "providers[0].models[1].limits"."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _message(item: Mapping[str, Any], loc: tuple[str | int, ...]) -> str:
    kind = item["type"]
    message = str(item["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            message = message[len(prefix) :]
    if kind == "extra_forbidden":
        return _unknown_field_message(loc)
    if kind == "missing":
        return "required field is missing"
    value = item.get("input")
    if (
        kind != "config"
        and isinstance(value, str | int | float | bool)
        and repr(value) not in message
        and not _is_secret(loc)
    ):
        message += f" (got {value!r})"
    return message


def _is_secret(loc: tuple[str | int, ...]) -> bool:
    """Whether `loc` is a secret field (a password, a token): its value is never echoed."""
    model = _model_at(loc[:-1])
    field = model.model_fields.get(str(loc[-1])) if model is not None and loc else None
    if field is None:
        return False
    annotation = field.annotation
    return annotation is SecretStr or SecretStr in typing.get_args(annotation)


def _unknown_field_message(loc: tuple[str | int, ...]) -> str:
    model = _model_at(loc[:-1])
    if model is None or not isinstance(loc[-1], str):
        return "unknown field"
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(loc[-1], allowed, n=1)
    if close:
        return f"unknown field; did you mean {close[0]!r}?"
    return f"unknown field; allowed fields: {', '.join(allowed)}"


def _model_at(loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model class found by following `loc` from `Config`, or None if it leads elsewhere."""
    current: Any = Config
    for part in loc:
        current = _unwrap(current)
        origin = typing.get_origin(current)
        if isinstance(part, int) and origin is list:
            current = typing.get_args(current)[0]
        elif origin is dict:
            current = typing.get_args(current)[1]
        elif (
            isinstance(current, type)
            and issubclass(current, BaseModel)
            and part in current.model_fields
        ):
            current = current.model_fields[str(part)].annotation
        else:
            return None
    current = _unwrap(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            options = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
            if len(options) != 1:
                return annotation
            annotation = options[0]
        else:
            return annotation


def _env_values(environ: Mapping[str, str]) -> Mapping[str, Any]:
    try:
        return MappingEnvSource(Config, environ)()
    except SettingsError:
        return {}


def _env_origin(loc: tuple[str | int, ...], env_values: Mapping[str, Any]) -> str:
    """ " (from LLMGW_X__Y)" when the value at `loc` came from the environment, else ""."""
    current: Any = env_values
    for depth, part in enumerate(loc):
        if isinstance(current, Mapping) and isinstance(part, str) and part in current:
            current = current[part]
        elif isinstance(current, list) and isinstance(part, int) and 0 <= part < len(current):
            current = current[part]
        else:
            return ""
        if not isinstance(current, Mapping | list) or depth == len(loc) - 1:
            names = [str(p).upper() for p in loc[: depth + 1] if isinstance(p, str)]
            return f" (from {ENV_PREFIX}{ENV_NESTED_DELIMITER.join(names)})"
    return ""


def _settings_problem(error: SettingsError) -> str:
    # pydantic-settings names the field but not the variable: "error parsing value for field "nats"".
    match = re.search(r'field "([^"]+)"', str(error))
    if match is None:
        return f"environment: {error}"
    field = match.group(1)
    return f"{field}: {ENV_PREFIX}{field.upper()} is not valid JSON (a section or list needs JSON)"


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    what = " ".join(part for part in (exc.context, exc.problem) if part)
    return f"{where}invalid YAML: {what or exc}"


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__
    )
