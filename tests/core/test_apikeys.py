"""API keys' pure rules: the codec, authentication, model patterns, band choice, windows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.apikeys import (
    API_KEY_PREFIX,
    ApiKey,
    ApiKeyError,
    Denial,
    RateWindow,
    authenticate,
    bearer_token,
    digest_of,
    new_secret,
)

DIGEST = digest_of("sk-llmgw-test")

limits = st.none() | st.integers(1, 10**9)
names = st.text("abcdefghijklmnopqrstuvwxyz0123456789-.", min_size=1, max_size=12)
keys = st.builds(
    ApiKey,
    digest=st.just(DIGEST),
    tenant=st.from_regex(r"[a-z0-9][a-z0-9_.:@-]{0,20}", fullmatch=True),
    prefix=st.just("sk-llmgw-abcdef"),
    models=st.lists(names, min_size=1, max_size=3).map(tuple),
    bands=st.just(()),
    band_header=st.booleans(),
    max_parallel_requests=limits,
    rpm=limits,
    tpm=limits,
    expires_at=st.none() | st.floats(0, 2e9),
    enabled=st.booleans(),
    labels=st.dictionaries(names.filter(lambda n: n[0].isalnum()), names, max_size=3),
    created_at=st.floats(0, 2e9),
)


@given(keys)
def test_codec_round_trips_every_key(key: ApiKey) -> None:
    assert ApiKey.from_json(key.to_json()) == key
    assert key.kv_key == API_KEY_PREFIX + DIGEST


def test_codec_rejects_unknown_versions_and_bad_fields() -> None:
    body = ApiKey(DIGEST, "t").as_dict()
    with pytest.raises(ApiKeyError, match="unknown version"):
        ApiKey.from_json(b'{"v": 99}')
    with pytest.raises(ApiKeyError, match="not JSON"):
        ApiKey.from_json(b"{")
    with pytest.raises(ApiKeyError, match="rpm"):
        ApiKey.from_dict({**body, "rpm": 0})
    with pytest.raises(ApiKeyError, match="tenant"):
        ApiKey.from_dict({**body, "tenant": "has space"})
    with pytest.raises(ApiKeyError, match="default_band"):
        ApiKey(DIGEST, "t", bands=("silver",), default_band="gold")


def test_secrets_are_never_stored_only_their_digest() -> None:
    secret = new_secret(bytes(range(24)))
    key = ApiKey(digest_of(secret), "t", prefix=secret[:15])
    assert secret not in key.to_json().decode()
    assert key.key_id == key.digest[:16]


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (None, None),
        ("", None),
        ("Bearer sk-1", "sk-1"),
        ("bearer   sk-1 ", "sk-1"),
        ("Basic abc", None),
        ("Bearer", None),
    ],
)
def test_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


def test_authenticate_names_every_denial() -> None:
    key = ApiKey(DIGEST, "t", expires_at=100.0)
    assert authenticate(None, None, 0) is Denial.MISSING
    assert authenticate(None, "sk", 0) is Denial.UNKNOWN
    assert authenticate(key.with_changes(enabled=False), "sk", 0) is Denial.DISABLED
    assert authenticate(key, "sk", 100.0) is Denial.EXPIRED
    assert authenticate(key, "sk", 99.9) is None


@pytest.mark.parametrize(
    ("patterns", "asked", "canonical", "allowed"),
    [
        (("*",), "m1", "m1", True),
        (("m1",), "small", "m1", True),  # an alias of an allowed model
        (("small",), "m1", "m1", False),  # allowing an alias allows only the alias
        (("small",), "small", "m1", True),
        (("llama-*",), "llama-3.3-70b", "llama-3.3-70b", True),
        (("llama-*",), "qwen", "qwen2.5-32b", False),
        (("m[12]",), "m2", "m2", True),
    ],
)
def test_models_by_name_alias_or_glob(
    patterns: tuple[str, ...], asked: str, canonical: str, allowed: bool
) -> None:
    assert ApiKey(DIGEST, "t", models=patterns).allows_model(asked, canonical) is allowed


@pytest.mark.parametrize(
    ("bands", "default", "may_choose", "header", "band"),
    [
        ((), None, False, "platinum", "gold"),  # may not choose: the gateway default
        ((), "bronze", False, "platinum", "bronze"),  # may not choose: the key's default
        ((), None, True, "platinum", "platinum"),
        (("silver", "bronze"), "bronze", True, "silver", "silver"),
        (("silver", "bronze"), "bronze", True, "platinum", "bronze"),  # not one of its bands
        (("silver", "bronze"), None, True, None, "silver"),  # gateway default not allowed
        (("silver", "bronze"), "bronze", True, None, "bronze"),
    ],
)
def test_band_choice(
    bands: tuple[str, ...], default: str | None, may_choose: bool, header: str | None, band: str
) -> None:
    key = ApiKey(DIGEST, "t", bands=bands, default_band=default, band_header=may_choose)
    assert key.band_for(header, "gold") == band


@given(st.floats(0, 2e9))
def test_windows_are_epoch_aligned(now: float) -> None:
    window = RateWindow(60.0)
    assert 0 < window.reset_in(now) <= 60.0
    assert window.index(now + window.reset_in(now)) == window.index(now) + 1


def test_a_keys_budget_is_exact_money_over_a_period_and_needs_one() -> None:
    digest = "a" * 64
    key = ApiKey(digest, "t", budget_period="monthly", max_spend="2.50", max_overflow_spend="1")
    assert key.budget is not None
    assert (key.budget.max_spend, key.budget.max_overflow_spend) == (2_500_000_000_000, 10**12)
    assert ApiKey.from_json(key.to_json()) == key
    assert ApiKey(digest, "t").budget is None
    for bad, says in (
        ({"max_spend": "1"}, "budget_period: a budget needs a period"),
        ({"budget_period": "weekly", "max_spend": "1"}, "budget_period: expected"),
        ({"budget_period": "daily", "max_spend": "-1"}, "max_spend: expected a number >= 0"),
        ({"budget_period": "daily", "max_overflow_spend": "x"}, "max_overflow_spend"),
    ):
        with pytest.raises(ApiKeyError, match=says):
            ApiKey(digest, "t", **bad)
