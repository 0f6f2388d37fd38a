"""Engine load from a Prometheus text exposition: the numbers the saturation detector needs.

Pure: takes the body of an engine's ``/metrics`` response as text and returns an `EngineSample`.
Fetching it is the scraper's job.

Four dialects are understood, told apart by metric names (each is what that engine's own source
registers; the versions are where the names were read):

- vLLM (``vllm/v1/metrics/loggers.py``): ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, optionally
  ``vllm:cache_config_info`` whose ``block_size`` and ``num_gpu_blocks`` labels describe the KV
  cache. Older vLLM (the V0 engine, ``vllm/engine/metrics.py``, and V1 before its KV gauge was
  renamed) calls KV usage ``vllm:gpu_cache_usage_perc``, and V0 also exposes
  ``vllm:num_requests_swapped``: requests preempted to CPU memory, which wait to run again and
  are counted as waiting;
- SGLang (``python/sglang/srt/metrics/collector.py``): ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:token_usage`` (the fraction of KV token slots in use);
- llama.cpp's ``llama-server`` (``tools/server``, formerly ``examples/server``, with
  ``--metrics``): ``llamacpp:requests_processing`` (busy slots), ``llamacpp:requests_deferred``
  (tasks waiting for a slot); builds of 2024 also had ``llamacpp:kv_cache_usage_ratio`` (used KV
  cells / context size), later builds have no KV gauge;
- Text Generation Inference (``router/src``): ``tgi_batch_current_size`` (requests in the running
  batch), ``tgi_queue_size`` (requests waiting); TGI has no KV usage gauge, and, like any engine
  exporting through Rust's ``metrics`` crate, exposes a gauge only once it has been set (a fresh
  TGI may expose none yet).

Engines expose all of these, some, or none: a gauge that is missing is None in the sample, and
an exposition without any is no sample at all (the gateway then counts that engine's load
itself). When several dialects are present, the one with more gauges wins, in the order above on
a tie (vLLM first: it is the contract our simulator speaks by default).

Aggregation over label sets (one engine may label series by model name, or by data-parallel rank):
request counts are summed; KV usage, a fraction of one cache, takes the maximum, because summing
fractions of separate caches is meaningless and the saturation detector wants the worst cache.

Parsing follows Prometheus: a malformed line rejects the whole exposition (`MetricsFormatError`,
naming the line), since a half-read scrape is worse than a clearly failed one. Comments (``#``),
blank lines, trailing timestamps and OpenMetrics exemplars are skipped.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "EngineDialect",
    "EngineSample",
    "MetricsFormatError",
    "Series",
    "parse_engine_metrics",
    "parse_exposition",
]

# A usage reading this far above 1 is float noise; further above it is a unit mix-up (percent).
_USAGE_TOLERANCE = 1e-6

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


class MetricsFormatError(ValueError):
    """The exposition is malformed, or a load value is out of range.

    Raised instead of guessing: a half-read scrape is worse than a clearly failed one. An
    exposition that is well formed but has no load gauges is not an error (see
    `parse_engine_metrics`).
    """


class EngineDialect(enum.StrEnum):
    """The engine family whose metric names an exposition uses (the ``dialect`` label)."""

    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"
    TGI = "tgi"


@dataclass(frozen=True, slots=True)
class Series:
    """One sample line: metric name, its labels and the value."""

    name: str
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class EngineSample:
    """An engine's load at one scrape; a field is None when the engine does not report it.

    Invariants: ``running`` and ``waiting`` are None or >= 0; ``kv_usage`` is None or within
    0..1; ``block_size`` and ``num_gpu_blocks`` are None (not reported) or >= 1; at least one
    of running, waiting and kv_usage is set (an exposition with none of them has no sample).
    """

    dialect: EngineDialect
    running: int | None
    waiting: int | None
    kv_usage: float | None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    # The LoRA adapters of its running and waiting requests (vllm:lora_requests_info): loaded
    # in its GPU memory. None: not reported (no LoRA, or another engine).
    lora_adapters: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.running is not None and self.running < 0:
            raise ValueError(f"running must be >= 0, got {self.running}")
        if self.waiting is not None and self.waiting < 0:
            raise ValueError(f"waiting must be >= 0, got {self.waiting}")
        if self.kv_usage is not None and not 0.0 <= self.kv_usage <= 1.0:  # also rejects NaN
            raise ValueError(f"kv_usage must be within 0..1, got {self.kv_usage}")
        if self.running is None and self.waiting is None and self.kv_usage is None:
            raise ValueError("a sample needs at least one of running, waiting, kv_usage")
        for field_name in ("block_size", "num_gpu_blocks"):
            value = getattr(self, field_name)
            if value is not None and value < 1:
                raise ValueError(f"{field_name} must be >= 1 when present, got {value}")

    @property
    def complete(self) -> bool:
        """All three load gauges are reported."""
        return None not in (self.running, self.waiting, self.kv_usage)

    @property
    def missing(self) -> tuple[str, ...]:
        """The gauges this engine does not report (running, waiting, kv_usage)."""
        return tuple(
            name for name in ("running", "waiting", "kv_usage") if getattr(self, name) is None
        )


@dataclass(frozen=True, slots=True)
class _Dialect:
    dialect: EngineDialect
    running: str
    waiting: str
    kv_usage: tuple[str, ...]  # first present name wins; () when the engine has none
    cache_info: str | None = None
    also_waiting: tuple[str, ...] = ()  # added to waiting when present
    lora_info: str | None = None


_DIALECTS = (
    _Dialect(
        EngineDialect.VLLM,
        running="vllm:num_requests_running",
        waiting="vllm:num_requests_waiting",
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        cache_info="vllm:cache_config_info",
        also_waiting=("vllm:num_requests_swapped",),
        lora_info="vllm:lora_requests_info",
    ),
    _Dialect(
        EngineDialect.SGLANG,
        running="sglang:num_running_reqs",
        waiting="sglang:num_queue_reqs",
        kv_usage=("sglang:token_usage",),
    ),
    _Dialect(
        EngineDialect.LLAMACPP,
        running="llamacpp:requests_processing",
        waiting="llamacpp:requests_deferred",
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
    ),
    _Dialect(
        EngineDialect.TGI,
        running="tgi_batch_current_size",
        waiting="tgi_queue_size",
        kv_usage=(),
    ),
)


def parse_engine_metrics(text: str) -> EngineSample | None:
    """Read running, waiting and KV usage of one engine from its ``/metrics`` text.

    Engines expose all, some or none of these: the dialect with the most of them present wins
    (the first in the module's list on a tie), and what it lacks is None in the sample. None
    when the exposition has no load gauge of any dialect (an OpenAI-compatible server without
    engine metrics): the gateway then runs that endpoint on its own accounting. Raises `MetricsFormatError` when the
    text is malformed or a value is out of range.
    """
    by_name: dict[str, list[Series]] = {}
    for series in parse_exposition(text):
        by_name.setdefault(series.name, []).append(series)
    best: tuple[int, _Dialect] | None = None
    for dialect in _DIALECTS:
        present = len(_DIALECT_FIELDS) - len(_missing(dialect, by_name))
        if present and (best is None or present > best[0]):
            best = (present, dialect)
    if best is None:
        return None
    return _sample(best[1], by_name)


_DIALECT_FIELDS = ("running", "waiting", "kv_usage")


def parse_exposition(text: str) -> list[Series]:
    """Every sample line of a Prometheus text exposition, in order."""
    result = []
    # Lines end at "\n" only (str.splitlines would also split inside label values).
    for number, line in enumerate(text.split("\n"), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            result.append(_parse_line(stripped))
        except MetricsFormatError as exc:
            raise MetricsFormatError(f"line {number}: {exc}: {stripped[:200]!r}") from None
    return result


def _missing(dialect: _Dialect, by_name: Mapping[str, list[Series]]) -> list[str]:
    missing = [name for name in (dialect.running, dialect.waiting) if name not in by_name]
    if not any(name in by_name for name in dialect.kv_usage):
        missing.append(" or ".join(dialect.kv_usage))
    return missing


def _sample(dialect: _Dialect, by_name: Mapping[str, list[Series]]) -> EngineSample:
    usage: float | None = None
    usage_name = next((name for name in dialect.kv_usage if name in by_name), None)
    if usage_name is not None:
        readings = [series.value for series in by_name[usage_name]]
        for value in readings:
            if not 0.0 <= value <= 1.0 + _USAGE_TOLERANCE:  # also rejects NaN
                raise MetricsFormatError(
                    f"{usage_name} must be a fraction within 0..1, got {value}"
                )
        usage = min(max(readings), 1.0)
    block_size = num_gpu_blocks = None
    if dialect.cache_info is not None and dialect.cache_info in by_name:
        infos = by_name[dialect.cache_info]
        block_size = _agreed_int_label(infos, "block_size")
        num_gpu_blocks = _agreed_int_label(infos, "num_gpu_blocks")
    return EngineSample(
        dialect=dialect.dialect,
        running=_count(by_name, dialect.running) if dialect.running in by_name else None,
        waiting=_waiting(dialect, by_name),
        kv_usage=usage,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        lora_adapters=_lora_adapters(by_name.get(dialect.lora_info or "", ())),
    )


def _lora_adapters(series: Sequence[Series]) -> tuple[str, ...] | None:
    """The adapters of the latest `vllm:lora_requests_info` series (its value is the time it
    was set: vLLM keeps old label sets, so the largest value is the current one), running and
    waiting together, sorted. None without the series."""
    if not series:
        return None
    latest = max(series, key=lambda s: s.value)
    names: set[str] = set()
    for label in ("running_lora_adapters", "waiting_lora_adapters"):
        names.update(name for name in latest.labels.get(label, "").split(",") if name)
    return tuple(sorted(names))


def _waiting(dialect: _Dialect, by_name: Mapping[str, list[Series]]) -> int | None:
    """The waiting gauge, plus the gauges that also wait (only when the gauge itself is there)."""
    if dialect.waiting not in by_name:
        return None
    return _count(by_name, dialect.waiting) + sum(
        _count(by_name, name) for name in dialect.also_waiting if name in by_name
    )


def _count(by_name: Mapping[str, list[Series]], name: str) -> int:
    total = math.fsum(series.value for series in by_name[name])
    if not math.isfinite(total) or total < 0 or total != int(total):
        raise MetricsFormatError(f"{name} must be a non-negative whole number, got {total}")
    return int(total)


def _agreed_int_label(infos: list[Series], label: str) -> int | None:
    """The label's value when every series carries the same positive integer, else None.

    The cache description is informative only, so a missing or odd label leaves it unknown
    rather than failing the scrape.
    """
    values = {series.labels.get(label) for series in infos}
    if len(values) != 1:
        return None
    (value,) = values
    if value is None or not value.isdigit() or int(value) < 1:
        return None
    return int(value)


def _parse_line(line: str) -> Series:
    match = _NAME.match(line)
    if match is None:
        raise MetricsFormatError("expected a metric name")
    name = match.group()
    position = match.end()
    labels: dict[str, str] = {}
    if position < len(line) and line[position] == "{":
        labels, position = _parse_labels(line, position + 1)
    rest = line[position:]
    if rest[:1] not in (" ", "\t"):
        raise MetricsFormatError("expected whitespace before the value")
    # After the value: an optional timestamp, then an optional OpenMetrics exemplar ("# {...}").
    fields = rest.split("#", 1)[0].split()
    if not 1 <= len(fields) <= 2:
        raise MetricsFormatError("expected a value and at most a timestamp")
    return Series(name, labels, _parse_value(fields[0]))


def _parse_labels(line: str, position: int) -> tuple[dict[str, str], int]:
    """Labels from just after ``{``; returns them and the position just after ``}``."""
    labels: dict[str, str] = {}
    while True:
        position = _skip_blanks(line, position)
        if line[position : position + 1] == "}":
            return labels, position + 1
        match = _LABEL_NAME.match(line, position)
        if match is None:
            raise MetricsFormatError("expected a label name")
        position = _skip_blanks(line, match.end())
        if line[position : position + 1] != "=":
            raise MetricsFormatError(f'expected ="..." after label {match.group()}')
        position = _skip_blanks(line, position + 1)
        if line[position : position + 1] != '"':
            raise MetricsFormatError(f'expected ="..." after label {match.group()}')
        labels[match.group()], position = _parse_label_value(line, position + 1)
        position = _skip_blanks(line, position)
        if line[position : position + 1] == ",":
            position += 1
        elif line[position : position + 1] != "}":
            raise MetricsFormatError("expected , or } after a label")


def _skip_blanks(line: str, position: int) -> int:
    while position < len(line) and line[position] in " \t":
        position += 1
    return position


def _parse_label_value(line: str, position: int) -> tuple[str, int]:
    """A quoted label value from just after the opening quote; returns it and the next position."""
    chars: list[str] = []
    while position < len(line):
        char = line[position]
        if char == '"':
            return "".join(chars), position + 1
        if char == "\\":
            escaped = line[position + 1 : position + 2]
            if escaped not in _ESCAPES:
                raise MetricsFormatError(f"invalid escape \\{escaped} in a label value")
            chars.append(_ESCAPES[escaped])
            position += 2
        else:
            chars.append(char)
            position += 1
    raise MetricsFormatError("unterminated label value")


def _parse_value(text: str) -> float:
    try:
        if "_" in text:  # Python's float() takes digit separators; Prometheus does not
            raise ValueError
        return float(text)  # accepts NaN, +Inf, -Inf as Prometheus writes them
    except ValueError:
        raise MetricsFormatError(f"invalid sample value {text!r}") from None
