"""Logging for every service: text or JSON lines on stderr, levels from the config, and the
request id of the request being handled on every record logged while handling it.

- `setup_logging(service, config.log)` installs one stderr handler on the root logger (text by
  default, for the terminal of `llmgw up`; ``log.format: json`` for log shippers) and the levels
  (``log.level``, ``log.levels`` per logger).
- `request_id` is a context variable: the edge sets it per request, admission per decision,
  so every record of that work carries ``request_id`` (asyncio tasks inherit it).
- `log_fields(logger, message, fields)` logs a record with structured fields: top-level keys in
  JSON, ``key=value`` pairs in text. The access log uses it.

Invariant: formatting never raises into the caller (a field that JSON cannot encode is written
as its `repr`).
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmgw.config.observability import LogConfig

__all__ = [
    "REQUEST_ID_HEADER",
    "JsonFormatter",
    "TextFormatter",
    "accept_request_id",
    "log_fields",
    "request_id",
    "setup_logging",
]

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID = 128
request_id: ContextVar[str | None] = ContextVar("llmgw_request_id", default=None)

_FIELDS = "llmgw_fields"  # the LogRecord attribute `log_fields` puts its fields in
# Loggers too chatty at info for a service's own log (one line per HTTP call or probe).
_QUIET = ("httpx", "httpcore", "uvicorn.access")


def accept_request_id(given: str | None) -> str:
    """The client's request id if it is a sane one (printable, at most 128 characters), else a
    fresh one: kept, returned to the client, forwarded upstream, logged. A fresh one is 128
    random bits as 32 hex digits (uuid4's form; from the process's PRNG, reseeded at fork, not
    the kernel's: an id, not a secret, and no system call per request)."""
    if given and len(given) <= MAX_REQUEST_ID and given.isprintable():
        return given
    return f"{random.getrandbits(128):032x}"


def log_fields(logger: logging.Logger, message: str, fields: dict[str, Any]) -> None:
    """Log `message` at info with structured `fields` (skipped cheaply when info is off)."""
    if logger.isEnabledFor(logging.INFO):
        logger.info(message, extra={_FIELDS: fields})


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, service, logger, msg, request_id, fields, exc."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service
        self._seconds = _Seconds("%Y-%m-%dT%H:%M:%S", time.gmtime)

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": f"{self._seconds(record.created)}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid is not None:
            line["request_id"] = rid
        fields = getattr(record, _FIELDS, None)
        if fields:
            line.update(fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=repr, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """`<time> <service> <LEVEL> <logger>: <message> [request_id=...] [key=value ...]`."""

    def __init__(self, service: str) -> None:
        super().__init__(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
        self._seconds = _Seconds("%Y-%m-%d %H:%M:%S", self.converter)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """logging's default, `2026-12-02 01:43:17,287` (local time)."""
        return f"{self._seconds(record.created)},{int(record.msecs):03d}"

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extra = []
        rid = getattr(record, "request_id", None)
        if rid is not None and not (getattr(record, _FIELDS, None) or {}).get("request_id"):
            extra.append(f"request_id={rid}")
        for key, value in (getattr(record, _FIELDS, None) or {}).items():
            if value is not None:
                extra.append(f"{key}={value}")
        return f"{text} {' '.join(extra)}" if extra else text


def setup_logging(service: str, config: LogConfig | None = None, stream: Any = None) -> None:
    """Install the service's stderr handler and levels (replacing any earlier setup).

    Records skip what neither formatter prints (the logging HOWTO's "Optimization"): the
    caller's frame, thread, process and multiprocessing names. The edge writes one access record
    per request, so these are per-request costs."""
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    fmt = config.format if config is not None else "text"
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter(service))
    handler.addFilter(_RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel((config.level if config is not None else "info").upper())
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    if config is not None:
        for name, level in config.levels.items():
            logging.getLogger(name).setLevel(level.upper())
        access = logging.getLogger("llmgw.access")
        access.setLevel(logging.NOTSET if config.access_log else logging.WARNING)


class _Seconds:
    """A record time's date and seconds as `strftime(fmt)` gives them, formatted once per
    second (the edge logs a line per request)."""

    def __init__(self, fmt: str, converter: Any) -> None:
        self.fmt = fmt
        self.converter = converter
        self._second = -1
        self._text = ""

    def __call__(self, created: float) -> str:
        second = int(created)
        if second != self._second:
            self._text = time.strftime(self.fmt, self.converter(second))
            self._second = second
        return self._text
