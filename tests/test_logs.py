"""`llmgw.logs`: the line formats, levels from the config, and the request id on records."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from collections.abc import Iterator

import pytest

from llmgw.config.observability import LogConfig
from llmgw.logs import (
    _FIELDS,
    AccessLog,
    accept_request_id,
    log_fields,
    request_id,
    setup_logging,
)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name in ("llmgw.access", "llmgw.admission", "httpx"):
        logging.getLogger(name).setLevel(logging.NOTSET)


def test_json_lines_carry_the_request_id_and_fields(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging("edge", LogConfig(format="json", levels={"llmgw.admission": "debug"}), out)

    async def handle(rid: str) -> None:
        request_id.set(rid)
        await asyncio.sleep(0)
        logging.getLogger("llmgw.edge").warning("slow %s", "upstream")

    async def both() -> None:
        await asyncio.gather(handle("a"), handle("b"))  # each task keeps its own id

    asyncio.run(both())
    logging.getLogger("llmgw.admission").debug("visible at debug")
    logging.getLogger("llmgw.edge").debug("hidden at info")
    log_fields(logging.getLogger("llmgw.access"), "request", {"status": 200, "odd": object()})
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(x["request_id"], x["msg"]) for x in lines[:2]] == [
        ("a", "slow upstream"),
        ("b", "slow upstream"),
    ]
    assert lines[0]["level"] == "warning" and lines[0]["service"] == "edge"
    assert lines[0]["ts"].endswith("Z") and lines[0]["logger"] == "llmgw.edge"
    assert [x["msg"] for x in lines[2:]] == ["visible at debug", "request"]
    assert lines[3]["status"] == 200 and lines[3]["odd"].startswith("<object")


def test_text_lines_and_the_access_switch(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging("edge", LogConfig(access_log=False), out)
    log_fields(logging.getLogger("llmgw.access"), "request", {"status": 200})
    assert out.getvalue() == ""
    setup_logging("edge", LogConfig(), out)  # a later setup turns it back on
    log_fields(logging.getLogger("llmgw.access"), "request", {"status": 200, "route": None})
    [line] = out.getvalue().splitlines()
    assert " edge INFO llmgw.access: request status=200" in line and "route" not in line


@pytest.mark.parametrize(
    ("given", "kept"),
    [("abc-123", True), ("x" * 128, True), ("x" * 129, False), ("a\nb", False), ("", False)],
)
def test_a_client_request_id_is_kept_only_when_sane(given: str, kept: bool) -> None:
    got = accept_request_id(given)
    assert (got == given) is kept and 0 < len(got) <= 128


@pytest.mark.parametrize(
    "created",
    [1796175755.0, 1796175755.287, 1796175755.9999, 1796175756.001, 1796175816.5, 1796262155.25],
)
def test_record_times_read_as_logging_and_utc_iso_give_them(created: float) -> None:
    """Both formatters format a second's date and time once; every record still gets its own
    time, the same as logging's default (text, local) and ISO 8601 in UTC (json)."""
    from llmgw.logs import JsonFormatter, TextFormatter

    text, structured, reference = TextFormatter("edge"), JsonFormatter("edge"), logging.Formatter()
    for at in (created - 1.5, created, created + 0.0004, created + 1.0):  # cached and not
        record = logging.LogRecord("llmgw.x", logging.INFO, "", 0, "m", None, None)
        record.created, record.msecs = at, int((at - int(at)) * 1000) + 0.0
        assert text.formatTime(record) == reference.formatTime(record)
        iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(record.msecs):03d}Z"
        assert json.loads(structured.format(record))["ts"] == iso


ACCESS_FIELDS = {"request_id": "r-1", "model": "m1", "status": 200, "route": None, "ms": 1.5}


def _without_time(line: str, fmt: str) -> object:
    if fmt == "json":
        parsed = json.loads(line)
        assert parsed.pop("ts").endswith("Z")
        return parsed
    return line.split(" ", 2)[2]  # after the date and the time


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_access_log_writes_the_line_a_record_would(restore_logging: None, fmt: str) -> None:
    """As a service runs (only the service's handler): the access line is written without a
    record, and it is the line `log_fields` writes, in order with the records around it."""
    out = io.StringIO()
    setup_logging("edge", LogConfig(format=fmt), out)
    access = AccessLog(logging.getLogger("llmgw.access"))
    assert access._direct_handler() is logging.getLogger().handlers[0]
    request_id.set("from-the-context")
    logging.getLogger("llmgw.edge").info("before")
    access.write("request", ACCESS_FIELDS)
    log_fields(logging.getLogger("llmgw.access"), "request", ACCESS_FIELDS)
    access.write("request", {"status": 499})  # no request id field: the context's
    log_fields(logging.getLogger("llmgw.access"), "request", {"status": 499})
    logging.getLogger("llmgw.edge").info("after")
    lines = out.getvalue().splitlines()
    assert len(lines) == 6
    assert _without_time(lines[1], fmt) == _without_time(lines[2], fmt)
    assert _without_time(lines[3], fmt) == _without_time(lines[4], fmt)
    first, last = _without_time(lines[0], fmt), _without_time(lines[5], fmt)
    if fmt == "json":
        assert [first["msg"], last["msg"]] == ["before", "after"]  # type: ignore[index]
        assert json.loads(lines[1])["request_id"] == "r-1" and "route" in json.loads(lines[1])
        assert json.loads(lines[3])["request_id"] == "from-the-context"
    else:
        assert first.endswith("before request_id=from-the-context")  # type: ignore[union-attr]
        assert lines[1].endswith("llmgw.access: request request_id=r-1 model=m1 status=200 ms=1.5")
        assert lines[3].endswith("llmgw.access: request request_id=from-the-context status=499")
    request_id.set(None)


class _Writes(io.StringIO):
    """A stream that counts its writes."""

    writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


def test_a_batch_of_access_lines_is_one_write_of_the_lines_each_would_be(
    restore_logging: None,
) -> None:
    """`write_all` (the edge's batch of request ends): the lines `write` writes one by one, in
    order, in one write to the stream."""
    one, batch = _Writes(), _Writes()
    fields = [{"request_id": f"r-{i}", "status": 200} for i in range(5)]
    setup_logging("edge", LogConfig(format="json"), one)
    access = AccessLog(logging.getLogger("llmgw.access"))
    for each in fields:
        access.write("request", each)
    setup_logging("edge", LogConfig(format="json"), batch)
    access.write_all("request", fields)
    access.write_all("request", [])  # nothing to write: no write
    assert (one.writes, batch.writes) == (5, 1)
    expected = [_without_time(line, "json") for line in one.getvalue().splitlines()]
    assert [_without_time(line, "json") for line in batch.getvalue().splitlines()] == expected
    assert [line["request_id"] for line in expected] == [f"r-{i}" for i in range(5)]  # type: ignore[index]


def test_the_access_log_goes_through_logging_when_anything_else_listens(
    restore_logging: None,
) -> None:
    """A handler on the access logger (a test's, an embedding application's) gets the line as a
    record, and so does the service's handler; the access switch and levels still apply."""
    out = io.StringIO()
    setup_logging("edge", LogConfig(), out)
    logger = logging.getLogger("llmgw.access")
    access = AccessLog(logger)
    seen: list[logging.LogRecord] = []
    listener = logging.Handler()
    listener.emit = seen.append  # type: ignore[method-assign]
    logger.addHandler(listener)
    try:
        assert access._direct_handler() is None
        access.write("request", {"status": 200})
    finally:
        logger.removeHandler(listener)
    assert [r.getMessage() for r in seen] == ["request"]
    assert out.getvalue().rstrip().endswith("llmgw.access: request status=200")
    setup_logging("edge", LogConfig(access_log=False), out)
    access.write("request", {"status": 201})
    setup_logging("edge", LogConfig(levels={"llmgw.access": "warning"}), out)
    access.write("request", {"status": 202})
    assert "status=201" not in out.getvalue() and "status=202" not in out.getvalue()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_traceback_follows_the_record_and_its_fields(restore_logging: None, fmt: str) -> None:
    out = io.StringIO()
    setup_logging("edge", LogConfig(format=fmt), out)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("llmgw.edge").exception("failed", extra={_FIELDS: {"status": 500}})
    if fmt == "json":
        [line] = out.getvalue().splitlines()
        parsed = json.loads(line)
        assert parsed["status"] == 500 and parsed["exc"].endswith("ValueError: boom")
    else:
        first, *rest = out.getvalue().rstrip().splitlines()
        assert first.endswith("llmgw.edge: failed status=500")
        assert rest[0].startswith("Traceback") and rest[-1] == "ValueError: boom"
