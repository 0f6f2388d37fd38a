"""Provider API keys: from the environment or a file; a configured one missing is an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.config import ConfigError, config_from_dict
from llmgw.config.credentials import CredentialsError, provider_keys


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
