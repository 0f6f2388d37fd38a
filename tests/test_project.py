"""The project's promises about itself: README commands, CI, package layout."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, flags=re.S)
    return [b.strip() for b in blocks if "python3 -m venv" in b]


def test_readme_has_exactly_two_setup_commands_run_and_test():
    commands = readme_setup_commands()
    assert len(commands) == 2
    run, test = commands
    assert run.endswith("llmgw up")
    assert "[test]" in test and test.endswith("pytest")


def test_ci_runs_exactly_the_readme_test_command():
    ci_commands = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip()
        and not line.lstrip().startswith("#")
        and not line.startswith(("set ", "cd "))
    ]
    assert ci_commands == [readme_setup_commands()[1]]


def test_console_script_and_package_mapping():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"] == {"llmgw": "llmgw.cli:main"}
    assert project["project"]["requires-python"] == ">=3.11"
    import llmgw
    import llmgw.services

    assert Path(llmgw.__file__).parent == ROOT / "shared"
    assert Path(llmgw.services.__file__).parent == ROOT / "services"
