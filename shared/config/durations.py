"""Durations as they appear in config files: "150ms", "2s", "1.5s", "30m", "1h30m".

Inside Python a duration is always a float number of SECONDS (`Duration`); the strings exist only at the
edges (YAML, environment variables, the effective-config dump). Invariants:

- `parse_duration` accepts a non-negative int/float (seconds), a numeric string (seconds) or a sequence of
  `<number><unit>` parts with units h, m, s, ms, us; anything else (negative, NaN, infinite, booleans,
  unknown units, empty strings) raises ValueError with a message meant for a human.
- `format_duration(parse_duration(s))` parses back to the same number of seconds (to the microsecond).
"""

from __future__ import annotations

import math
import re
from typing import Annotated

from pydantic import BeforeValidator, Field, PlainSerializer

# (multiplier, divisor): dividing for sub-second units keeps "150ms" exactly 0.15.
_UNIT_SCALE = {
    "h": (3600, 1),
    "m": (60, 1),
    "s": (1, 1),
    "ms": (1, 1000),
    "us": (1, 1e6),
    "µs": (1, 1e6),
}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|us|µs|h|m|s)")
_NUMBER = re.compile(r"[+]?(\d+(?:\.\d*)?|\.\d+)")

_EXPECTED = 'expected a duration like "150ms", "2s", "30m", "1h30m" or a number of seconds'


def parse_duration(value: object) -> float:
    """Return `value` as seconds (float); raise ValueError naming what was wrong."""
    if isinstance(value, bool):
        raise ValueError(f"{_EXPECTED}, got {value!r}")
    if isinstance(value, int | float):
        return _checked(float(value), value)
    if not isinstance(value, str):
        raise ValueError(f"{_EXPECTED}, got {type(value).__name__}")
    text = value.strip().lower()
    if text.startswith("-"):
        raise ValueError(f"duration must not be negative, got {value!r}")
    if _NUMBER.fullmatch(text):
        return _checked(float(text), value)
    total = 0.0
    position = 0
    for match in _PART.finditer(text):
        if match.start() != position:
            break
        multiplier, divisor = _UNIT_SCALE[match.group(2)]
        total += float(match.group(1)) * multiplier / divisor
        position = match.end()
    if position == 0 or position != len(text):
        raise ValueError(f"{_EXPECTED}, got {value!r}")
    return _checked(total, value)


def _checked(seconds: float, original: object) -> float:
    if math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"{_EXPECTED}, got {original!r}")
    if seconds < 0:
        raise ValueError(f"duration must not be negative, got {original!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """Render seconds compactly: 2.0 -> "2s", 0.15 -> "150ms", 5400 -> "1h30m", 1.5 -> "1.5s"."""
    micros = round(seconds * 1_000_000)
    if micros == 0:
        return "0s"
    if micros % 1_000_000 == 0:
        whole = micros // 1_000_000
        hours, rest = divmod(whole, 3600)
        minutes, secs = divmod(rest, 60)
        parts = [
            f"{hours}h" if hours else "",
            f"{minutes}m" if minutes else "",
            f"{secs}s" if secs else "",
        ]
        return "".join(parts)
    if micros < 1_000_000:
        if micros % 1000 == 0:
            return f"{micros // 1000}ms"
        if micros < 1000:
            return f"{micros}us"
        return f"{micros / 1000:g}ms"
    return f"{micros / 1_000_000:.6f}".rstrip("0").rstrip(".") + "s"


# A duration field: seconds (float) in Python, a compact string in JSON/YAML dumps.
Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]
# A duration that must be strictly positive (timeouts, intervals).
PositiveDuration = Annotated[Duration, Field(gt=0)]
