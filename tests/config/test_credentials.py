"""Provider API keys: from the environment or a file; a configured one missing is an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.config import ConfigError, config_from_dict
from llmgw.config.credentials import CredentialsError, admin_token, provider_keys


def _config(**provider: object):  # type: ignore[no-untyped-def]
    return config_from_dict(
        {
            "models": [{"name": "m"}],
            "providers": [
                {"id": "ours", "kind": "managed", "models": [{"name": "m"}]},
                {"id": "third", "kind": "unlimited", "models": [{"name": "m"}], **provider},
            ],
            "endpoints": [
                {"id": "e1", "url": "http://127.0.0.1:1", "provider": "ours", "models": ["m"]},
                {"id": "e2", "url": "http://127.0.0.1:2", "provider": "third", "models": ["m"]},
            ],
        },
        source="<test>",
        env={},
    )


def test_keys_come_from_the_environment_or_a_file(tmp_path: Path) -> None:
    assert provider_keys(_config(api_key_env="THIRD_KEY"), {"THIRD_KEY": "sk-3"}) == {
        "third": "sk-3"
    }
    secret = tmp_path / "third.key"
    secret.write_text("sk-from-file\n")
    assert provider_keys(_config(api_key_file=str(secret)), {}) == {"third": "sk-from-file"}
    assert provider_keys(_config(), {}) == {}


def test_a_missing_key_is_an_error_naming_its_source_never_a_value(tmp_path: Path) -> None:
    with pytest.raises(
        CredentialsError, match=r"providers\[1\] \(third\).api_key_env: .*THIRD_KEY"
    ):
        provider_keys(_config(api_key_env="THIRD_KEY"), {"OTHER": "sk-other"})
    with pytest.raises(CredentialsError, match="api_key_env"):
        provider_keys(_config(api_key_env="THIRD_KEY"), {"THIRD_KEY": "  "})
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    with pytest.raises(CredentialsError, match="is empty"):
        provider_keys(_config(api_key_file=str(empty)), {})
    with pytest.raises(CredentialsError, match="No such file"):
        provider_keys(_config(api_key_file=str(tmp_path / "nope")), {})


def test_one_key_source_per_provider() -> None:
    with pytest.raises(ConfigError, match="api_key_file: set api_key_env or api_key_file"):
        _config(api_key_env="A", api_key_file="/b")


def _with_auth(env: dict[str, str] | None = None, **auth: object):  # type: ignore[no-untyped-def]
    return config_from_dict(
        {
            "auth": auth,
            "models": [{"name": "m"}],
            "providers": [{"id": "ours", "kind": "managed", "models": [{"name": "m"}]}],
        },
        source="<test>",
        env=env or {},
    )


def test_the_admin_token_comes_from_the_config_the_environment_or_a_file(tmp_path: Path) -> None:
    token = "t" * 24
    assert admin_token(_with_auth()) is None  # the admin API is then off
    assert admin_token(_with_auth(admin_token=token)) == token
    assert admin_token(_with_auth({"LLMGW_AUTH__ADMIN_TOKEN": token})) == token
    secret = tmp_path / "admin-token"
    secret.write_text(f"{token}\n")
    assert admin_token(_with_auth(admin_token_file=str(secret))) == token
    by_env = _with_auth({"LLMGW_AUTH__ADMIN_TOKEN_FILE": str(secret)})
    assert admin_token(by_env) == token
    assert token not in _with_auth(admin_token=token).model_dump_json()  # masked


def test_a_bad_admin_token_is_refused_naming_its_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as short:
        _with_auth(admin_token="short")
    assert "auth.admin_token" in str(short.value) and "16 characters" in str(short.value)
    assert "short" not in str(short.value)  # a secret is never echoed
    with pytest.raises(ConfigError) as both:
        _with_auth(admin_token="t" * 24, admin_token_file="/x")
    assert "auth.admin_token_file" in str(both.value)
    with pytest.raises(CredentialsError) as missing:
        admin_token(_with_auth(admin_token_file=str(tmp_path / "nope")))
    assert "auth.admin_token_file" in str(missing.value)
    (tmp_path / "weak").write_text("abc\n")
    with pytest.raises(CredentialsError) as weak:
        admin_token(_with_auth(admin_token_file=str(tmp_path / "weak")))
    assert "at least 16" in str(weak.value)


def test_an_applied_config_does_not_store_an_admin_token_written_in_its_file(
    tmp_path: Path,
) -> None:
    from llmgw.services.fleet.apply import file_values

    path = tmp_path / "config.yaml"
    path.write_text("auth: {mode: keys, admin_token: tttttttttttttttttttttttt}\nmodels: []\n")
    assert file_values(path)["auth"] == {"mode": "keys"}
