"""`llmgw endpoints add|update --context-window N` sets the endpoint's `context_window`."""

from __future__ import annotations

import argparse

from llmgw.config.catalog import EndpointConfig
from llmgw.services.fleet.main import spec_from_args
from llmgw.services.fleet.options import add_endpoints_arguments


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_endpoints_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_option_gives_the_endpoints_window_and_its_absence_leaves_it_alone() -> None:
    added = spec_from_args(
        parse("add", "e9", "--url", "http://h:8000", "--provider", "iris", "--models", "m1",
              "--context-window", "8192")
    )  # fmt: skip
    assert added["context_window"] == 8192
    assert EndpointConfig.model_validate({"id": "e9", **added}).context_window == 8192
    assert "context_window" not in spec_from_args(parse("update", "e9", "--weight", "50"))
