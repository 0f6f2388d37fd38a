"""The decision core stays pure: nothing in llmgw.core imports an I/O library."""

import ast
from pathlib import Path

import llmgw.core

FORBIDDEN = {
    "nats",
    "fastapi",
    "starlette",
    "httpx",
    "aiohttp",
    "uvicorn",
    "prometheus_client",
    "asyncio",
    "time",
    "random",
    "socket",
}


def test_core_modules_import_no_io_library():
    core_dir = Path(llmgw.core.__file__).parent
    offenders = []
    for path in sorted(core_dir.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            else:
                continue
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert core_dir.name == "core" and list(core_dir.glob("*.py"))
    assert offenders == []
