"""Layers that only point down, read from the source with `ast` (nothing is imported).

The rule (docs/architecture.md, "Layers"):

- **The library** is every `llmgw.*` module outside `llmgw.services` (shared/: config, core,
  state, wire, natsconn, broadcast, runtime, ...). It never imports a service: a helper two
  services need lives in the library, not in one of them.
- **The command line** (`llmgw.cli`, and `llmgw.__main__` which runs it) sits above every
  service: it names each subcommand's entry point as a string and imports nothing of a
  service but its argparse `options` module (so `llmgw config check` does not load FastAPI).
- **Services** (`llmgw.services.<name>`) use the library freely. One service imports another
  only to run or serve a part of it in its own process; each such dependency is listed in
  `ALLOWED` with its reason, so a new one is a decision a reviewer sees. Services import each
  other without a cycle, counting every import: at module level, inside a function, under
  `TYPE_CHECKING`, relative, and `importlib.import_module` of a constant name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = {"llmgw": REPO / "shared", "llmgw.services": REPO / "services"}
SERVICES = "llmgw.services"
COMMAND_LINE = frozenset({"llmgw.cli", "llmgw.__main__"})

# (importer, imported) service -> why the importer runs or serves a part of the imported one.
ALLOWED: dict[tuple[str, str], str] = {
    ("edge", "admission"): "the edge runs an admission instance in its process "
    "(admission.colocated)",
    ("edge", "fleet"): "the edge's admin port serves the fleet's admin API beside its "
    "colocated admission instance",
    ("admission", "fleet"): "admission's admin port serves the fleet's admin API",
    ("reaper", "fleet"): "the reaper runs the fleet's heartbeat janitor, model-list follower "
    "and Kubernetes watcher",
    ("up", "fleet"): "`llmgw up` applies the config file on SIGHUP as `llmgw config apply` does",
    ("keys", "spend"): "`llmgw keys list` reads today's spend per key with `llmgw spend`'s reader",
}


@dataclass(frozen=True)
class Import:
    importer: str  # the module whose source holds the import
    target: str  # the module imported (relative imports resolved), or a name in it
    where: str  # file:line


def modules(sources: Mapping[str, Path]) -> Iterator[tuple[str, Path, str]]:
    """(module name, file, file as shown) of every Python file under the source folders."""
    for package, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join([package, *parts]), path, str(path.relative_to(folder.parent))


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in `importer`."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    base = base[: len(base) - level + (1 if is_package else 0)]
    return ".".join([*base, module] if module else base)


def imports_in(path: Path, importer: str, shown: str) -> Iterator[Import]:
    """Every import in one file, wherever it stands. ``from M import n`` yields M and M.n (n may
    be a module); a constant ``importlib.import_module("M")`` / ``__import__("M")`` yields M."""
    tree = ast.parse(path.read_text(), shown)
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        where = f"{shown}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(importer, alias.name, where)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(importer, is_package, node.level, node.module)
            yield Import(importer, base, where)
            for alias in node.names:
                if alias.name != "*":
                    yield Import(importer, f"{base}.{alias.name}", where)
        elif isinstance(node, ast.Call) and node.args:
            func, first = node.func, node.args[0]
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and isinstance(first, ast.Constant):
                if isinstance(first.value, str):
                    yield Import(importer, first.value, where)


def all_imports(sources: Mapping[str, Path] = SOURCES) -> list[Import]:
    return [
        found
        for module, path, shown in modules(sources)
        for found in imports_in(path, module, shown)
    ]


def service_of(module: str) -> str | None:
    """`x` for `llmgw.services.x` and its modules; None for the library and the bare package."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["llmgw", "services"] else None


def library_violations(found: list[Import]) -> list[str]:
    """Imports of a service from the library; of anything but an `options` module (or a name
    in one) from the command line."""
    problems = []
    for imp in found:
        if imp.importer == SERVICES or service_of(imp.importer) is not None:
            continue
        if imp.target != SERVICES and not imp.target.startswith(SERVICES + "."):
            continue
        if imp.importer in COMMAND_LINE and imp.target.split(".")[3:4] == ["options"]:
            continue
        problems.append(f"{imp.where}: {imp.importer} imports {imp.target}")
    return sorted(set(problems))


def service_graph(found: list[Import]) -> dict[tuple[str, str], list[str]]:
    """(importer, imported) service -> where, for every import from one service into another."""
    edges: dict[tuple[str, str], list[str]] = {}
    for imp in found:
        source, target = service_of(imp.importer), service_of(imp.target)
        if source is not None and target is not None and source != target:
            edges.setdefault((source, target), []).append(imp.where)
    return edges


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The shortest cycle through each service that imports itself through others, as a path
    that ends where it starts, one per group of services that import each other."""
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
        graph.setdefault(target, set())
    found: list[list[str]] = []
    covered: set[str] = set()
    for start in sorted(graph):
        if start in covered:
            continue
        came_from: dict[str, str] = {}  # breadth first from `start`, back to it
        todo = [start]
        while todo and start not in came_from:
            here = todo.pop(0)
            for step in sorted(graph[here]):
                if step not in came_from:
                    came_from[step] = here
                    todo.append(step)
        if start not in came_from:
            continue
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(came_from[path[-1]])
        path.reverse()
        covered |= set(path)
        found.append(path)
    return found


# -- the repository ---------------------------------------------------------------------------


def test_the_library_imports_no_service() -> None:
    assert library_violations(all_imports()) == []


def test_services_import_each_other_only_where_allowed() -> None:
    edges = service_graph(all_imports())
    unlisted = [
        f"{a} -> {b} ({', '.join(where[:3])})"
        for (a, b), where in sorted(edges.items())
        if (a, b) not in ALLOWED
    ]
    assert unlisted == [], (
        "a service imports another without a listed reason: move the shared helper into the "
        "library, or list the dependency in ALLOWED (no cycle) and docs/architecture.md"
    )
    stale = sorted(set(ALLOWED) - set(edges))
    assert stale == [], "ALLOWED lists dependencies the code no longer has: remove them"


def test_no_import_cycle_between_services() -> None:
    edges = service_graph(all_imports())
    assert cycles(set(edges)) == []
    assert cycles(set(ALLOWED)) == []


# -- the checks themselves, on a made-up tree -------------------------------------------------


def _tree(root: Path, files: Mapping[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"llmgw": root / "shared", "llmgw.services": root / "services"}


def test_the_checks_see_imports_anywhere_and_every_cycle(tmp_path: Path) -> None:
    sources = _tree(
        tmp_path,
        {
            "shared/__init__.py": "",
            "shared/config.py": "def f():\n    from llmgw.services.sim import params\n",
            "shared/wire.py": "from llmgw import services\n",
            "shared/cli.py": "from llmgw.services.keys.options import add\n"
            "from llmgw.services.keys import main\n",
            "shared/state/__init__.py": "import importlib\n"
            "importlib.import_module('llmgw.services.a.m')\n",
            "services/__init__.py": "",
            "services/a/__init__.py": "",
            "services/a/m.py": "from llmgw.services.b.m import x\n",
            "services/b/__init__.py": "",
            "services/b/m.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from ..c import m\n",
            "services/c/__init__.py": "",
            "services/c/m.py": "async def g():\n    import llmgw.services.a.m\n",
            "services/d/__init__.py": "from ..a import m\n",
        },
    )
    found = all_imports(sources)
    assert [problem.split(": ", 1)[1] for problem in library_violations(found)] == [
        "llmgw.cli imports llmgw.services.keys",
        "llmgw.cli imports llmgw.services.keys.main",
        "llmgw.config imports llmgw.services.sim",
        "llmgw.config imports llmgw.services.sim.params",
        "llmgw.state imports llmgw.services.a.m",
        "llmgw.wire imports llmgw.services",
    ]
    edges = service_graph(found)
    assert set(edges) == {("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")}
    assert cycles(set(edges)) == [["a", "b", "c", "a"]]
    assert cycles({("a", "b"), ("d", "a"), ("b", "e")}) == []
