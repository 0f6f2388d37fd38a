"""Reproducible installs: constraints.txt pins every package a fresh install resolves to; the
README's commands and CI install with it (tests/test_project.py), and so does the image."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from test_project import readme_setup_commands

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = (
    "test",
    "tracing",
    "bench",
    "kv-events",
    "tokenizer",
)  # what constraints.txt was resolved with
REFRESH = "constraints.txt's header says how to refresh it"


def pins() -> dict[str, str]:
    found: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line)
        assert match, f"constraints.txt: {line!r} is not NAME==VERSION"
        name = canonicalize_name(match.group(1))
        assert name not in found, f"constraints.txt pins {name} twice"
        found[name] = match.group(2)
    return found


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = list(project["dependencies"])
    for extra in EXTRAS:
        listed += project["optional-dependencies"][extra]
    return [Requirement(r) for r in listed]


def test_every_requirement_is_pinned_within_its_range() -> None:
    pinned = pins()
    problems = []
    for requirement in project_requirements():
        version = pinned.get(canonicalize_name(requirement.name))
        if version is None:
            problems.append(f"{requirement} is not pinned")
        elif not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement}: the pin {version} is outside its range")
    assert problems == [], f"{problems} ({REFRESH})"


def _closure() -> dict[str, str]:
    """Installed distributions llmgw (with the test extra) needs, transitively: name -> version."""
    environment = default_environment()
    seen: dict[str, str] = {}
    walked: set[tuple[str, frozenset[str]]] = set()  # a package again with other extras: again
    todo = [Requirement("llmgw[test]")]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if (name, frozenset(requirement.extras)) in walked:
            continue
        walked.add((name, frozenset(requirement.extras)))
        distribution = importlib.metadata.distribution(requirement.name)
        seen[name] = distribution.version
        for spec in distribution.requires or []:
            needed = Requirement(spec)
            if needed.marker is None or any(
                needed.marker.evaluate({**environment, "extra": extra})
                for extra in requirement.extras or {""}
            ):
                todo.append(needed)
    del seen["llmgw"]
    return seen


def test_the_tests_run_on_the_pinned_versions() -> None:
    pinned = pins()
    installed = _closure()
    assert len(installed) > 30  # the walk found the dependency tree, not one package
    differ = {
        name: (version, pinned.get(name))
        for name, version in sorted(installed.items())
        if pinned.get(name) != version
    }
    assert differ == {}, f"installed vs pinned {differ} ({REFRESH})"


def test_the_setup_commands_install_with_the_constraints() -> None:
    for command in readme_setup_commands():
        assert "pip install -q -c constraints.txt -e " in command, command
