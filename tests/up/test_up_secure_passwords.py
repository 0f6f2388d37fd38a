"""`llmgw up --secure`'s passwords and server config (services/up/secure.py), without a server."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import yaml

from llmgw.config import load_config
from llmgw.nats_auth import ROLES
from llmgw.services.up.plan import plan_cluster
from llmgw.services.up.secure import SecureNats

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def config():  # type: ignore[no-untyped-def]
    """The local config as `--secure` runs it: admission in a process of its own role."""
    return load_config(REPO / "config" / "local.yaml", env={"LLMGW_ADMISSION__COLOCATED": "false"})


def test_a_passwords_file_is_completed_and_kept(config, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    file = tmp_path / "pw.yaml"
    file.write_text(yaml.safe_dump({"keys": "my-keys-password"}))
    secure = SecureNats.prepare(config, str(file))
    try:
        kept = yaml.safe_load(file.read_text())
        assert set(kept) == set(ROLES) and kept["keys"] == "my-keys-password"
        assert len(set(kept.values())) == len(ROLES)  # a distinct random one for every other role
        assert stat.S_IMODE(file.stat().st_mode) == 0o600
        assert stat.S_IMODE(secure.config_path.stat().st_mode) == 0o600
        assert '"my-keys-password"' in secure.config_path.read_text()
        again = SecureNats.prepare(config, str(file))
        assert again.passwords == kept  # the next start reads the same
        again.cleanup()
    finally:
        secure.cleanup()
    assert not secure.config_path.exists() and file.exists()


def test_random_passwords_differ_per_start(config) -> None:  # type: ignore[no-untyped-def]
    first, second = SecureNats.prepare(config), SecureNats.prepare(config)
    try:
        assert not set(first.passwords.values()) & set(second.passwords.values())
    finally:
        first.cleanup()
        second.cleanup()
    assert not first.passwords_path.exists()  # a temporary file goes with the run


@pytest.mark.parametrize(
    ("content", "problem"),
    [("[a, b]", "expected a mapping"), ("operator: x", "'operator' is not a NATS role")],
)
def test_a_bad_passwords_file_is_refused(
    config, tmp_path: Path, content: str, problem: str
) -> None:  # type: ignore[no-untyped-def]
    file = tmp_path / "pw.yaml"
    file.write_text(content)
    with pytest.raises(ValueError, match=problem):
        SecureNats.prepare(config, str(file))


def test_each_nats_client_gets_its_role_and_the_simulators_nothing(config) -> None:  # type: ignore[no-untyped-def]
    secure = SecureNats.prepare(config)
    try:
        env = secure.spec_env(plan_cluster(config, "c.yaml"))
    finally:
        secure.cleanup()
    assert {name: e["LLMGW_NATS__USER"] for name, e in env.items()} == {
        "admission": "admission",
        "reaper": "reaper",
        "scraper": "scraper",
        "edge": "edge",
    }
    assert all(e["LLMGW_NATS__PASSWORD"] == secure.passwords[n] for n, e in env.items())


def test_a_passwords_file_without_secure_is_refused(tmp_path: Path) -> None:
    from llmgw.cli import main

    file = tmp_path / "pw.yaml"
    args = ["up", "--config", str(REPO / "config" / "local.yaml"), "--nats-passwords", str(file)]
    assert main([*args, "--dry-run"]) == 2
    assert not file.exists()


def test_secure_runs_admission_as_its_own_process_when_the_config_colocates_it(
    capsys,  # type: ignore[no-untyped-def]
) -> None:
    """An edge's own instance would connect as the edge role, which may not write the routing
    bucket: under --secure the plan has a separate admission process (the edge is told not to
    colocate; tests/up/test_up_secure.py runs it)."""
    from llmgw.cli import main

    config = REPO / "config" / "local.yaml"  # admission.colocated: true
    assert main(["up", "--config", str(config), "--dry-run"]) == 0
    assert "admission" not in _planned_services(capsys.readouterr().out)
    assert main(["up", "--config", str(config), "--secure", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "admission.colocated is off for this run" in out
    assert "admission" in _planned_services(out)


def _planned_services(dry_run: str) -> list[str]:
    return [line.split()[0] for line in dry_run.splitlines() if line[:1].isalnum()]
