"""Simulator parameters: `EngineParams` (a vLLM-like engine) and `ProviderParams` (a third-party
API), and `apply_overrides` for ``--set KEY=VALUE``.

The parameter models are defined in the config package (`llmgw.config.simulate`), which validates
an endpoint's ``simulate`` block with them; they are re-exported here, under the simulator's own
name for them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from llmgw.config.durations import Duration
from llmgw.config.simulate import (
    METRICS_DIALECTS,
    DriftPoint,
    EngineParams,
    FaultKnobs,
    MetricsDialect,
    ProviderParams,
)

__all__ = [
    "METRICS_DIALECTS",
    "DriftPoint",
    "Duration",
    "EngineParams",
    "FaultKnobs",
    "MetricsDialect",
    "ProviderParams",
    "apply_overrides",
]


_Params = TypeVar("_Params", bound=BaseModel)


def _override_value(text: str) -> Any:
    """JSON for lists/objects/null, else the raw string (pydantic's lax mode converts it)."""
    stripped = text.strip()
    if stripped.startswith(("[", "{")) or stripped == "null":
        return json.loads(stripped)
    return stripped


def apply_overrides(
    params: _Params, assignments: Iterable[str], extra: Mapping[str, Any] | None = None
) -> _Params:
    """A copy of `params` with ``key=value`` overrides applied and validated.

    Raises ValueError naming the key for malformed assignments or invalid values.
    """
    data = params.model_dump(exclude_unset=False)
    for assignment in assignments:
        key, sep, value = assignment.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set {assignment!r}: expected KEY=VALUE")
        if key not in type(params).model_fields:
            raise ValueError(f"--set {key}: unknown parameter for {type(params).__name__}")
        try:
            data[key] = _override_value(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--set {key}: invalid JSON value: {exc}") from None
    data.update(extra or {})
    try:
        return type(params).model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise ValueError(problems) from None
