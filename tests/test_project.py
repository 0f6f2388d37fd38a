"""The project's promises about itself: README commands, CI, package layout."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

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
    assert "[test]" in test and test.endswith(("pytest", "pytest -n 4"))


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


# --- lint, format and types, enforced by the README's test command (so by CI) ---------------


def _run(*argv: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> None:
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env)
    assert result.returncode == 0, f"{' '.join(argv)}:\n{result.stdout}{result.stderr}"


def test_ruff_lint_is_clean():
    _run(sys.executable, "-m", "ruff", "check", "--no-cache", ".")


def test_ruff_format_is_applied():
    _run(sys.executable, "-m", "ruff", "format", "--check", "--no-cache", ".")


def test_the_package_type_checks_strictly(tmp_path: Path, pytestconfig: pytest.Config):
    """mypy --strict (pyproject's [tool.mypy]) on the whole package: `llmgw` and
    `llmgw.services`. The repository keeps them as shared/ and services/, so mypy reads them
    through a tree of links laid out as the package. Its cache is kept with pytest's, so a run
    after a small change rechecks only what it touches."""
    package = tmp_path / "llmgw"
    package.mkdir()
    for entry in (ROOT / "shared").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    (package / "services").symlink_to(ROOT / "services", target_is_directory=True)
    cache = getattr(pytestconfig, "cache", None)  # none under -p no:cacheprovider
    kept = cache.mkdir("mypy") if cache is not None else tmp_path
    env = {**os.environ, "MYPYPATH": str(tmp_path)}
    _run(
        sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
        "--cache-dir", str(kept), "-p", "llmgw", env=env,
    )  # fmt: skip
