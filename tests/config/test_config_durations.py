"""Durations and addresses: the two string formats a config file is written in."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.config import format_duration, parse_duration, parse_hostport


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("150ms", 0.15),
        ("2s", 2.0),
        ("1.5s", 1.5),
        ("30m", 1800.0),
        ("1h", 3600.0),
        ("1h30m", 5400.0),
        ("2m30s", 150.0),
        ("100us", 0.0001),
        (" 5S ", 5.0),
        ("7", 7.0),
        ("0.25", 0.25),
        (3, 3.0),
        (0.5, 0.5),
        (0, 0.0),
    ],
    ids=repr,
)
def test_parses_units_and_plain_seconds(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds, abs=1e-12)


@pytest.mark.parametrize(
    "bad",
    [
        "-1s",
        "-5",
        -0.5,
        "",
        "s",
        "1x",
        "1s2",
        "1 s",
        "ten seconds",
        "1.2.3s",
        True,
        None,
        [1],
        float("nan"),
        float("inf"),
        "inf",
    ],
    ids=repr,
)
def test_rejects_negative_and_garbage_with_a_message(bad):
    with pytest.raises(ValueError, match=r"duration"):
        parse_duration(bad)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (2.0, "2s"),
        (0.15, "150ms"),
        (1800.0, "30m"),
        (5400.0, "1h30m"),
        (1.5, "1.5s"),
        (0.0, "0s"),
        (60.0, "1m"),
        (7200.0, "2h"),
        (3601.0, "1h1s"),
        (0.0001, "100us"),
        (0.0015, "1.5ms"),
    ],
)
def test_formats_compactly(seconds, text):
    assert format_duration(seconds) == text


@given(st.integers(min_value=0, max_value=10**12).map(lambda micros: micros / 1_000_000))
def test_format_then_parse_round_trips_to_the_microsecond(seconds):
    assert math.isclose(
        parse_duration(format_duration(seconds)), seconds, abs_tol=1e-9, rel_tol=1e-12
    )


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        (":9090", ("0.0.0.0", 9090)),
        ("localhost:0", ("localhost", 0)),
        ("[::1]:8080", ("::1", 8080)),
    ],
)
def test_parses_host_port(address, expected):
    assert parse_hostport(address) == expected


@pytest.mark.parametrize(
    "bad", ["8080", "host:", "host:http", ":65536", "::1:80", "[::1:80", "a b:1"]
)
def test_rejects_malformed_addresses(bad):
    with pytest.raises(ValueError):
        parse_hostport(bad)
