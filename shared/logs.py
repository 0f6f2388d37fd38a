"""Logging for every service: text or JSON lines on stderr, levels from the config, and the
request id of the request being handled on every record logged while handling it.

- `setup_logging(service, config.log)` installs one stderr handler on the root logger (text by
  default, for the terminal of `llmgw up`; ``log.format: json`` for log shippers) and the levels
  (``log.level``, ``log.levels`` per logger).
- `request_id` is a context variable: the edge sets it per request, admission per decision,
  so every record of that work carries ``request_id`` (asyncio tasks inherit it).
- `log_fields(logger, message, fields)` logs a record with structured fields: top-level keys in
  JSON, ``key=value`` pairs in text. `AccessLog` writes the edge's line per request: the same
  line, without a LogRecord when nothing but the service's handler would see it.

Invariant: formatting never raises into the caller (a field that JSON cannot encode is written
as its `repr`).
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmgw.config.observability import LogConfig

__all__ = [
    "REQUEST_ID_HEADER",
    "AccessLog",
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


class _LineFormatter(logging.Formatter):
    """A record's parts, handed to the subclass's `line(created, msecs, level, logger, message,
    rid, fields, below)`, which `AccessLog` calls without a record (`below`: a traceback)."""

    line: Callable[..., str]

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        below = record.exc_text or None
        if record.stack_info:
            stack = self.formatStack(record.stack_info)
            below = f"{below}\n{stack}" if below else stack
        return self.line(
            record.created,
            record.msecs,
            record.levelname,
            record.name,
            record.getMessage(),
            getattr(record, "request_id", None),
            getattr(record, _FIELDS, None),
            below,
        )


class JsonFormatter(_LineFormatter):
    """One JSON object per line: ts, level, service, logger, msg, request_id, fields, exc."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service
        self._seconds = _Seconds("%Y-%m-%dT%H:%M:%S", time.gmtime)

    def line(
        self,
        created: float,
        msecs: float,
        level: str,
        logger: str,
        message: str,
        rid: str | None,
        fields: dict[str, Any] | None,
        below: str | None = None,
    ) -> str:
        line: dict[str, Any] = {
            "ts": f"{self._seconds(created)}.{int(msecs):03d}Z",
            "level": level.lower(),
            "service": self.service,
            "logger": logger,
            "msg": message,
        }
        if rid is not None:
            line["request_id"] = rid
        if fields:
            line.update(fields)
        if below is not None:
            line["exc"] = below
        return json.dumps(line, default=repr, separators=(",", ":"))


class TextFormatter(_LineFormatter):
    """`<time> <service> <LEVEL> <logger>: <message> [request_id=...] [key=value ...]`, then
    the traceback of an exception on the lines below."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service
        self._seconds = _Seconds("%Y-%m-%d %H:%M:%S", self.converter)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """logging's default, `2026-12-02 01:43:17,287` (local time)."""
        return self._stamp(record.created, record.msecs)

    def _stamp(self, created: float, msecs: float) -> str:
        return f"{self._seconds(created)},{int(msecs):03d}"

    def line(
        self,
        created: float,
        msecs: float,
        level: str,
        logger: str,
        message: str,
        rid: str | None,
        fields: dict[str, Any] | None,
        below: str | None = None,
    ) -> str:
        text = f"{self._stamp(created, msecs)} {self.service} {level} {logger}: {message}"
        extra = (
            [f"{key}={value}" for key, value in fields.items() if value is not None]
            if fields
            else []
        )
        if rid is not None and not (fields and fields.get("request_id")):
            extra.insert(0, f"request_id={rid}")
        if extra:
            text = f"{text} {' '.join(extra)}"
        return f"{text}\n{below}" if below is not None else text


class _ServiceHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler `setup_logging` installs (`AccessLog` writes to it directly)."""


class AccessLog:
    """One structured line per request on `logger` (the edge's access log) for less than a
    record costs (~6 us against ~10 here, half of it the write: no LogRecord, no dispatch).

    The line is written directly when the only handler it would reach is the service handler of
    `setup_logging` (as a service runs): formatted by that handler's formatter, so it is the
    very line `log_fields` would write, in the same order with the other records. Otherwise (a
    handler or filter added by a test or an application embedding the edge) it goes through
    logging as any record. Info level and the logger's own level decide, as for `log_fields`.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._root = logging.getLogger()

    def write(self, message: str, fields: dict[str, Any]) -> None:
        self.write_all(message, (fields,))

    def write_all(self, message: str, batch: Sequence[dict[str, Any]]) -> None:
        """One line per fields of `batch`, written (and flushed) together: one write to the
        stream for a batch of request ends."""
        logger = self._logger
        if not batch or not logger.isEnabledFor(logging.INFO):
            return
        handler = self._direct_handler()
        if handler is None:
            for fields in batch:
                logger.info(message, extra={_FIELDS: fields})
            return
        rid = request_id.get()
        lines = []
        for fields in batch:
            created = time.time()
            lines.append(
                handler.formatter.line(  # type: ignore[union-attr]
                    created,
                    int((created - int(created)) * 1000),
                    "INFO",
                    logger.name,
                    message,
                    rid,
                    fields,
                )
            )
        terminator = handler.terminator
        with handler.lock:  # type: ignore[union-attr]
            try:
                handler.stream.write(terminator.join(lines) + terminator)
                handler.flush()
            except Exception:  # as logging does: a broken stream never fails the request
                handler.handleError(logging.makeLogRecord({"msg": lines[0]}))

    def _direct_handler(self) -> _ServiceHandler | None:
        """The service handler, if it is all that `logger` reaches (else None: use logging)."""
        root = self._root
        handlers = root.handlers
        if len(handlers) != 1 or root.filters:
            return None
        handler = handlers[0]
        if type(handler) is not _ServiceHandler or handler.level > logging.INFO:
            return None
        if not isinstance(handler.formatter, _LineFormatter):
            return None
        node: logging.Logger | None = self._logger
        while node is not None and node is not root:
            if node.handlers or node.filters or not node.propagate or node.disabled:
                return None
            node = node.parent
        for check in handler.filters:  # only the request id's filter, which `write` applies
            if type(check) is not _RequestIdFilter:
                return None
        return handler


def setup_logging(service: str, config: LogConfig | None = None, stream: Any = None) -> None:
    """Install the service's stderr handler and levels (replacing any earlier setup).

    Records skip what neither formatter prints (the logging HOWTO's "Optimization"): the
    caller's frame, thread, process and multiprocessing names. The edge writes one access record
    per request, so these are per-request costs."""
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    fmt = config.format if config is not None else "text"
    handler = _ServiceHandler(stream if stream is not None else sys.stderr)
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
        if not config.access_log:
            access.setLevel(logging.WARNING)
        elif "llmgw.access" not in config.levels:  # a level given for it is the one it gets
            access.setLevel(logging.NOTSET)


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
