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
from llmgw.logs import accept_request_id, log_fields, request_id, setup_logging


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
