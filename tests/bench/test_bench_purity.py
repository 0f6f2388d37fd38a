"""The bench's core stays pure: its modules import no I/O, clock or event-loop library."""

import ast
from pathlib import Path

import pytest

import llmgw.services.bench

PURE = ["distributions", "workload", "stats", "sweep", "protocol", "report", "options"]
FORBIDDEN = {"aiohttp", "asyncio", "httpx", "socket", "time", "nats", "uvicorn", "matplotlib"}
BENCH = Path(llmgw.services.bench.__file__).parent


@pytest.mark.parametrize("module", PURE)
def test_core_module_imports_no_io_library(module):
    tree = ast.parse((BENCH / f"{module}.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
            if node.module.startswith("llmgw.services.bench."):
                assert node.module.rsplit(".", 1)[1] in PURE, f"{module} imports {node.module}"
    assert imported & FORBIDDEN == set()
