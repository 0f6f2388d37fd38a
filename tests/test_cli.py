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


def test_a_reader_that_leaves_early_ends_the_command_quietly():
    """`llmgw ... | head -1`: the pipe closes while output is written; no traceback."""
    script = (
        "import sys; from llmgw.cli import main\n"
        "class Gone:\n"
        "    def write(self, text): raise BrokenPipeError(32, 'Broken pipe')\n"
        "    def flush(self): pass\n"
        "    def fileno(self): return sys.__stdout__.fileno()\n"
        "sys.stdout = Gone()\n"
        f"sys.exit(main(['config', 'check', {str(ROOT / 'config' / 'local.yaml')!r}]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 141 and result.stderr == ""


def test_a_missing_default_config_says_where_it_looked(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "llmgw", "state"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"config/local.yaml: no such file in {tmp_path} (pass --config PATH, or run from the "
        "repository root)"
    )
