"""The command line: services refuse clearly when they have no NATS server to talk to."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("service", ["edge", "admission", "reaper", "scraper"])
def test_services_explain_that_an_embedded_nats_needs_llmgw_up(service):
    env = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-m", "llmgw", service, "--config", str(ROOT / "config" / "local.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2
    assert "LLMGW_NATS__URL" in result.stderr


def test_config_check_reports_errors_with_exit_code_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("router:\n  retires: 3\n")
    result = subprocess.run(
        [sys.executable, "-m", "llmgw", "config", "check", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "router.retires" in result.stderr
