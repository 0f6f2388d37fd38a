"""docs/architecture.md's module map names every module of the source, and nothing else.

The map ("Module map") has one paragraph per folder, led by the folder's package and path in
bold (**`llmgw.core`** (`shared/core/`)), and under it one line per module (- `flow.py`: ...).
Every ``.py`` file under shared/ and services/ but a package's ``__init__.py`` (the paragraph
itself speaks for it) must be listed under its folder, and every module listed must exist
there: a module added, removed, moved or renamed without the map fails here, naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = "docs/architecture.md"
SECTION = "## Module map"
TOPS = {"shared": "llmgw", "services": "llmgw.services"}

ROOM = re.compile(r"^\*\*`(?P<package>[\w.]+)`\*\* \(`(?P<folder>[\w/]+)/`\)")
MODULE = re.compile(r"^- `(?P<module>\w+\.py)`")


def module_map(text: str) -> tuple[dict[str, list[str]], dict[str, str], list[str]]:
    """(folder -> modules listed, folder -> package named, problems) read from the map."""
    lines = text.splitlines()
    if SECTION not in lines:
        return {}, {}, [f"{DOC} has no '{SECTION}' section"]
    listed: dict[str, list[str]] = {}
    packages: dict[str, str] = {}
    problems: list[str] = []
    folder: str | None = None
    for line in lines[lines.index(SECTION) + 1 :]:
        if line.startswith("## "):
            break
        if room := ROOM.match(line):
            folder = room["folder"]
            if folder in packages:
                problems.append(f"the map has two paragraphs for {folder}/")
            packages[folder] = room["package"]
            listed.setdefault(folder, [])
        elif module := MODULE.match(line):
            if folder is None:
                problems.append(f"the map lists {module['module']} before any folder's paragraph")
            else:
                listed[folder].append(module["module"])
    return listed, packages, problems


def source_modules(root: Path) -> dict[str, set[str]]:
    """folder -> its modules (but ``__init__.py``), for every folder under the source tops."""
    found: dict[str, set[str]] = {}
    for top in TOPS:
        for path in (root / top).rglob("*.py"):
            if path.name != "__init__.py":
                found.setdefault(path.parent.relative_to(root).as_posix(), set()).add(path.name)
    return found


def package_of(folder: str) -> str:
    top, *rest = folder.split("/")
    return ".".join([TOPS[top], *rest]) if top in TOPS else "?"


def _sorted(items: Iterable[str]) -> list[str]:
    return sorted(set(items))


def map_problems(text: str, present: dict[str, set[str]]) -> list[str]:
    """What the map lacks or names wrongly, one line each."""
    listed, packages, problems = module_map(text)
    if SECTION not in text.splitlines():
        return problems
    for folder in _sorted(present):
        if folder not in listed:
            problems.append(
                f"{folder}/ has no paragraph in the map: add '**`{package_of(folder)}`** "
                f"(`{folder}/`): ...' with its modules"
            )
            continue
        for module in _sorted(present[folder] - set(listed[folder])):
            problems.append(f"{folder}/{module} is missing from the map (under {folder}/)")
    for folder, modules in sorted(listed.items()):
        if packages[folder] != package_of(folder):
            problems.append(
                f"the map's paragraph for {folder}/ names {packages[folder]}, "
                f"not {package_of(folder)}"
            )
        if folder not in present:
            problems.append(f"the map has a paragraph for {folder}/, a folder with no module")
        for module in _sorted(set(modules) - present.get(folder, set())):
            problems.append(f"the map lists {folder}/{module}, which does not exist")
        for module in _sorted(m for m in modules if modules.count(m) > 1):
            problems.append(f"the map lists {folder}/{module} twice")
    return problems


# -- the repository ---------------------------------------------------------------------------


def test_the_module_map_names_every_module_and_only_those() -> None:
    problems = map_problems((REPO / DOC).read_text(), source_modules(REPO))
    assert problems == [], f"{DOC}, '{SECTION}' is out of date:\n" + "\n".join(problems)


# -- the check itself, on a made-up tree ------------------------------------------------------

MAP = """# Architecture

## Module map

**`llmgw`** (`shared/`): the library.

- `wire.py`: messages.

**`llmgw.core`** (`shared/core/`): pure.

- `flow.py`: when.
- `placement.py`: where.

**`llmgw.services.edge`** (`services/edge/`): the edge.

- `app.py`: the ingress.

## The request path

- `later.py`: a list item of another section, not the map's.
"""


def _tree(root: Path, files: Iterable[str]) -> dict[str, set[str]]:
    for name in files:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('"""A module."""\n')
    return source_modules(root)


TREE = [
    "shared/__init__.py",
    "shared/wire.py",
    "shared/core/__init__.py",
    "shared/core/flow.py",
    "shared/core/placement.py",
    "services/__init__.py",
    "services/edge/__init__.py",
    "services/edge/app.py",
]


def test_the_check_passes_a_map_that_matches(tmp_path: Path) -> None:
    assert map_problems(MAP, _tree(tmp_path, TREE)) == []


def test_the_check_names_a_module_added_removed_or_moved(tmp_path: Path) -> None:
    present = _tree(tmp_path, TREE)
    present["shared"].add("clock.py")  # added
    present["shared/core"].discard("flow.py")  # removed
    del present["services/edge"]  # its one module moved to a new folder
    present["services/admission"] = {"intake.py"}
    assert map_problems(MAP, present) == [
        "services/admission/ has no paragraph in the map: add '**`llmgw.services.admission`** "
        "(`services/admission/`): ...' with its modules",
        "shared/clock.py is missing from the map (under shared/)",
        "the map has a paragraph for services/edge/, a folder with no module",
        "the map lists services/edge/app.py, which does not exist",
        "the map lists shared/core/flow.py, which does not exist",
    ]


def test_the_check_reads_the_map_strictly(tmp_path: Path) -> None:
    present = _tree(tmp_path, TREE)
    text = MAP.replace("**`llmgw.core`**", "**`llmgw.kernel`**").replace(
        "- `placement.py`: where.", "- `placement.py`: where.\n- `flow.py`: again."
    )
    assert map_problems(text, present) == [
        "the map's paragraph for shared/core/ names llmgw.kernel, not llmgw.core",
        "the map lists shared/core/flow.py twice",
    ]
    assert map_problems("# Architecture\n", present) == [f"{DOC} has no '{SECTION}' section"]
