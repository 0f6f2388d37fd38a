"""`spend`: prices, currency and budgets are checked by `llmgw config check`, naming the field."""

import io
from pathlib import Path

import pytest
import yaml

from llmgw.config import config_from_dict
from llmgw.config.check import check_file

SHIPPED = Path(__file__).parents[2] / "config" / "local.yaml"


def base() -> dict:
    return yaml.safe_load(SHIPPED.read_text())


def check(tmp_path, spend: dict) -> tuple[int, str]:
    config = base()
    config["spend"] = spend
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    err = io.StringIO()
    code = check_file(str(path), env={}, stdout=io.StringIO(), stderr=err)
    return code, err.getvalue()


@pytest.mark.parametrize(
    ("spend", "says"),
    [
        (
            {"prices": [{"provider": "tensorx", "input": -0.5}]},
            "spend.prices[0].input: price per million tokens: expected a number >= 0",
        ),
        (
            {"prices": [{"provider": "tensorx", "output": "cheap"}]},
            "spend.prices[0].output: price per million tokens: expected a number, got 'cheap'",
        ),
        (
            {"prices": [{"provider": "tensorx", "cached_input": 0.0000001}]},
            "spend.prices[0].cached_input: price per million tokens: at most 6 decimals",
        ),
        ({"currency": "DOUBLOON"}, "spend.currency: unknown currency 'DOUBLOON'"),
        ({"prices": [{"provider": "acme", "input": 1}]}, "spend.prices[0].provider: unknown"),
        (
            {"prices": [{"provider": "tensorx", "model": "gpt-9", "input": 1}]},
            "spend.prices[0].model: provider 'tensorx' does not serve model 'gpt-9'",
        ),
        (
            {"prices": [{"provider": "tensorx", "input": 1}, {"provider": "tensorx", "input": 2}]},
            "spend.prices[1]: duplicate price",
        ),
        (
            {"prices": [{"provider": "iris", "model": "llama-3.3-70b", "endpoint_hour": 4}]},
            "spend.prices[0].endpoint_hour: an endpoint-hour prices the provider",
        ),
        ({"prices": [{"provider": "iris", "endpoint_hour": "-4"}]}, "endpoint_hour: price"),
    ],
    ids=[
        "negative",
        "non-numeric",
        "too-fine",
        "currency",
        "provider",
        "model",
        "duplicate",
        "endpoint-hour-of-a-model",
        "negative-endpoint-hour",
    ],
)
def test_config_check_rejects_bad_spend_naming_the_field(tmp_path, spend, says):
    code, err = check(tmp_path, spend)
    assert code == 2
    assert says in err


def test_the_shipped_config_prices_the_third_party_and_round_trips():
    config = config_from_dict(base(), env={})
    book = config.spend.price_book()
    assert book.for_pair("tensorx", "llama-3.3-70b").output == 2_400_000
    assert book.for_pair("iris", "llama-3.3-70b") is None
    dumped = yaml.safe_load(yaml.safe_dump(config.model_dump(mode="json")))
    assert config_from_dict(dumped, env={}).spend == config.spend


def test_an_alias_prices_its_model_and_env_overrides_the_currency():
    config = base()
    config["spend"] = {"prices": [{"provider": "tensorx", "model": "llama", "input": 1}]}
    loaded = config_from_dict(config, env={"LLMGW_SPEND__CURRENCY": "eur"})
    assert loaded.spend.currency == "EUR"
    assert loaded.spend.price_book(loaded.resolve_model).for_pair("tensorx", "llama-3.3-70b")
