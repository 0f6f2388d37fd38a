"""The Dockerfile and .dockerignore, read as text (no Docker engine is needed or used).

What is checked is what a build would rely on: two stages on python:3.11-slim, the runtime stage
installing the builder's wheels offline (so it needs no compiler) and none of the build tools,
a numeric non-root user, `llmgw` as the entrypoint, config/ where the shipped commands look for
it, the ports the services listen on, and a build context that holds what the stages copy.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from llmgw.cli import build_parser
from llmgw.config import load_config
from llmgw.services.up.plan import plan_cluster

REPO = Path(__file__).resolve().parents[2]
BASE_IMAGE = "python:3.11-slim"


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def _instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: comments dropped, continuation lines joined."""
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if current and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, "the Dockerfile ends inside a continued instruction"
    result = []
    for line in logical:
        keyword, _, args = line.strip().partition(" ")
        result.append((keyword.upper(), args.strip()))
    return result


def _stages() -> list[Stage]:
    instructions = _instructions((REPO / "Dockerfile").read_text())
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, args in instructions:
        if keyword == "ARG" and not stages:
            name, _, default = args.partition("=")
            global_args[name] = default
        elif keyword == "FROM":
            words = args.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(image, name))
        else:
            assert stages, f"{keyword} before the first FROM"
            stages[-1].instructions.append((keyword, args))
    return stages


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return _stages()


@pytest.fixture(scope="module")
def runtime(stages: list[Stage]) -> Stage:
    return stages[-1]


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def test_two_stages_on_python_slim(stages: list[Stage]) -> None:
    assert len(stages) == 2
    builder, runtime = stages
    assert builder.name == "builder"
    assert builder.image == runtime.image == BASE_IMAGE


def test_builder_builds_wheels_that_the_runtime_installs_offline(stages: list[Stage]) -> None:
    builder, runtime = stages
    (wheel,) = [run for run in builder.args("RUN") if "pip wheel" in run]
    wheel_dir = re.search(r"--wheel-dir[= ](\S+)", wheel)
    assert wheel_dir and shlex.split(wheel)[-1] == ".", wheel  # the project and its dependencies
    assert "--constraint constraints.txt" in wheel  # at the versions the tests pass with
    (install,) = [run for run in runtime.args("RUN") if "pip install" in run]
    mount = re.search(r"--mount=(\S+)", install)
    assert mount, "the wheels are mounted, so they never become a layer"
    options = dict(part.split("=", 1) for part in mount.group(1).split(","))
    assert options["type"] == "bind" and options["from"] == "builder"
    assert options["source"] == wheel_dir.group(1)
    assert "--no-index" in install  # nothing is fetched or compiled in the runtime stage
    assert f"--find-links={options['target']}" in install
    assert re.search(r"\bllmgw\b", install.split("pip install", 1)[1])


def test_runtime_has_no_build_tools(runtime: Stage) -> None:
    commands = " ".join(runtime.args("RUN"))
    for tool in ("apt-get", "apk", "gcc", "build-essential", "pip wheel"):
        assert tool not in commands, tool
    assert "pip uninstall --yes setuptools wheel" in commands
    assert not runtime.args("COPY") or all(
        not args.startswith("--from=builder") for args in runtime.args("COPY")
    )  # wheels are bind-mounted, never copied in


def test_runtime_runs_as_a_numeric_non_root_user(runtime: Stage) -> None:
    users = runtime.args("USER")
    assert users, "no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0, users[-1]  # numeric: runAsNonRoot can check it
    assert not gid or (gid.isdigit() and int(gid) > 0), users[-1]
    keywords = [kw for kw, _ in runtime.instructions]
    last_user = len(keywords) - 1 - keywords[::-1].index("USER")
    assert "RUN" not in keywords[last_user:]  # nothing after USER switches back or runs as root
    (useradd,) = [run for run in runtime.args("RUN") if "useradd" in run]
    assert f"--uid {uid}" in useradd


def test_llmgw_is_the_entrypoint_and_up_the_default(runtime: Stage) -> None:
    (entrypoint,) = runtime.args("ENTRYPOINT")
    assert _exec_form(entrypoint) == ["llmgw"]
    (cmd,) = runtime.args("CMD")
    command = _exec_form(cmd)
    assert command == ["up"]
    args = build_parser().parse_args(command)
    # `llmgw up`'s default config is relative to the working directory: it must be in the image.
    assert (REPO / args.config).is_file()
    assert args.config.startswith("config/")


def _workdir(runtime: Stage) -> str:
    (workdir,) = runtime.args("WORKDIR")
    return workdir


def test_config_directory_is_copied_into_the_working_directory(runtime: Stage) -> None:
    assert "config ./config" in runtime.args("COPY")
    assert _workdir(runtime).startswith("/")


def test_compose_commands_are_llmgw_arguments_reading_the_image_config(runtime: Stage) -> None:
    """compose.yaml's commands go to this entrypoint: each must parse as `llmgw` arguments, and
    read its config where the image (and compose's mount over it) keeps config/."""
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    config_dir = f"{_workdir(runtime)}/config/"
    built = {name: svc for name, svc in compose["services"].items() if "build" in svc}
    assert built
    for name, service in built.items():
        args = build_parser().parse_args(service["command"])
        assert args.config.startswith(config_dir), name
        assert (REPO / "config" / args.config.removeprefix(config_dir)).is_file(), name
        assert f"./config:{config_dir.rstrip('/')}:ro" in service["volumes"], name


def test_exposed_ports_are_the_services_ports(runtime: Stage) -> None:
    exposed = {int(port) for args in runtime.args("EXPOSE") for port in args.split()}
    config = load_config(REPO / "config" / "compose.yaml", env={})
    ports = {
        address.port
        for spec in plan_cluster(config, "c.yaml")
        if not spec.kind.startswith("sim")
        for address in spec.listens
    }
    assert ports == {8080, 9090, 9091, 9092, 9093}  # the layout the docs describe
    assert exposed == ports


def test_no_healthcheck_in_the_image(runtime: Stage) -> None:
    assert not runtime.args("HEALTHCHECK")  # orchestrators probe: compose and Kubernetes do


# --- the build context ------------------------------------------------------------------------


def _dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _in_context(top_level: str) -> bool:
    """Whether a top-level file or folder is sent to the builder (the last matching rule wins)."""
    included = True
    for rule in _dockerignore():
        negated = rule.startswith("!")
        pattern = rule.removeprefix("!").rstrip("/")
        if fnmatch.fnmatchcase(top_level, pattern):
            included = negated
    return included


def test_build_context_holds_what_the_stages_copy(stages: list[Stage]) -> None:
    sources = []
    for stage in stages:
        for args in stage.args("COPY"):
            if not args.startswith("--from"):
                sources += args.split()[:-1]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), source
        assert _in_context(source), f"{source} is copied but .dockerignore leaves it out"


@pytest.mark.parametrize("path", [".git", ".venv", ".env", "tests", "docs", "benchmarks", "deploy"])
def test_build_context_leaves_out_everything_else(path: str) -> None:
    assert not _in_context(path)


def test_build_context_leaves_out_bytecode() -> None:
    assert "**/__pycache__" in _dockerignore()
