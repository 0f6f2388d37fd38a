"""The command line: services refuse clearly when they have no NATS server to talk to."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from llmgw import natsconn
from llmgw.cli import main
from llmgw.serving import free_port

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


# Each tool that dials the cluster, and the line it prints when nothing listens at nats.url.
UNREACHED = {
    "state": (["state"], "llmgw state: cannot read from NATS at {url}: "),
    "spend": (["spend"], "llmgw spend: cannot read from NATS at {url}: "),
    "events": (["events"], "llmgw events: cannot read from NATS: "),
    "keys": (["keys", "list"], "llmgw keys: cannot reach NATS: "),
    "endpoints": (["endpoints", "list"], "llmgw endpoints: cannot reach NATS: "),
    "register": (
        ["register", "e1", "--url", "http://127.0.0.1:9", "--provider", "iris", "--ttl", "9"],
        "llmgw register: cannot reach NATS: ",
    ),
    "config apply": ([], "llmgw config apply: cannot reach NATS: "),
}


@pytest.mark.parametrize("tool", sorted(UNREACHED))
def test_a_tool_that_cannot_reach_nats_says_so_in_its_own_name_and_exits_1(
    tool: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    data = yaml.safe_load((ROOT / "config" / "local.yaml").read_text())
    data["nats"] = {"url": url, "connect_timeout": "1s"}
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(data))
    argv, said = UNREACHED[tool]
    if tool == "config apply":
        argv = ["config", "apply", str(config), "--wait", "1"]
    else:
        argv = [argv[0], "--config", str(config), *argv[1:]]
    started = time.monotonic()
    assert main(argv) == 1
    assert time.monotonic() - started < 10
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(said.format(url=url)) and len(line) > len(said.format(url=url))


async def test_a_refusal_by_the_server_is_told_in_the_tools_own_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A tool the server refused (a wrong NATS role) says so instead of "cannot reach NATS"."""
    refusals = natsconn.Refusals()
    assert refusals.report("spend", TimeoutError()) == 1
    assert capsys.readouterr().err == "llmgw spend: cannot reach NATS: TimeoutError\n"
    await refusals.record(Exception("nats: 'Permissions Violation for Subscribe to \"x\"'"))
    assert refusals.report("spend", TimeoutError(), "cannot read from NATS") == 1
    assert capsys.readouterr().err.startswith(
        'llmgw spend: NATS refused it: Permissions Violation for Subscribe to "x" (is nats.user'
    )
