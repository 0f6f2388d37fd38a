"""NATS users per service role (llmgw.nats_auth): the table's invariants, and the grants
enforced by a real nats-server started with the generated config.

Denials are the server's: a write outside a role's grants is answered with a permissions
violation (the client's error callback gets it, and the server logs it), never just a timeout
we interpret.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS

from llmgw import wire
from llmgw.config import Config, load_config
from llmgw.core.apikeys import ApiKey, digest_of
from llmgw.nats_auth import ROLES, SERVICE_ROLES, render_server_config, role_permissions
from llmgw.nats_embedded import EmbeddedNats
from llmgw.prefix_stream import ensure_prefix_stream
from llmgw.state.apikeys import open_key_bucket
from llmgw.state.nats_kv import NatsKV
from llmgw.state.setup import open_load_bucket, open_routing_store

REPO = Path(__file__).resolve().parents[2]
PASSWORDS = {role: f"test-password-{role}" for role in ROLES}
# Who may write each bucket; every other role is refused.
WRITERS = {
    "routing": {"admission", "reaper"},
    "load": {"scraper"},
    "keys": {"keys"},
}
_DENIAL_WAIT = 5.0  # seconds a violation may take to come back (it comes in milliseconds)


@pytest.fixture(scope="module")
def config() -> Config:
    return load_config(REPO / "config" / "local.yaml", env={})


def _bucket(config: Config, name: str) -> str:
    return {
        "routing": config.pinning.bucket,
        "load": config.router.load_bucket,
        "keys": config.auth.bucket,
    }[name]


# --- the table ------------------------------------------------------------------------------


def test_only_the_keys_role_may_write_the_key_bucket(config: Config) -> None:
    writes = f"$KV.{config.auth.bucket}.>"
    may = {role for role, grants in role_permissions(config).items() if writes in grants.publish}
    assert may == {"keys"}


def test_the_edge_writes_and_creates_only_the_response_bucket(config: Config) -> None:
    """It cannot write a pin, a lease, a quota, a key or a spend record; the Responses API's
    stored responses are its own (docs/adr/0003)."""
    edge = role_permissions(config)["edge"]
    responses = config.responses.bucket
    assert [s for s in edge.publish if s.startswith("$KV.")] == [f"$KV.{responses}.>"]
    created = [s for s in edge.publish if ".STREAM.CREATE." in s or ".STREAM.UPDATE." in s]
    assert created == [
        f"$JS.API.STREAM.CREATE.KV_{responses}",
        f"$JS.API.STREAM.UPDATE.KV_{responses}",
    ]


@pytest.mark.parametrize("role", ROLES)
def test_no_role_is_granted_everything(config: Config, role: str) -> None:
    grants = role_permissions(config)[role]
    for subject in (*grants.publish, *grants.subscribe):
        assert subject not in (">", "*", "$JS.API.>", "$KV.>", "llmgw.>", "llmgw.v1.>"), subject


def test_every_wire_subject_has_a_role_that_publishes_it_and_one_that_listens(
    config: Config,
) -> None:
    """A subject added to llmgw.wire without a grant would fail in --secure only: caught here."""
    table = role_permissions(config)
    published = {s for grants in table.values() for s in grants.publish}
    subscribed = {s for grants in table.values() for s in grants.subscribe}
    subjects = [
        value + ("*" if name.endswith("_PREFIX") else "")
        for name, value in vars(wire).items()
        if name.endswith(("_SUBJECT", "_PREFIX")) and isinstance(value, str)
    ]
    assert subjects
    for subject in subjects:
        assert subject in published, f"no role may publish {subject}"
        assert subject in subscribed, f"no role may subscribe to {subject}"
    # The prefix stream's subjects are published, and read through the stream (a consumer).
    stream = config.prefix_stream
    for subject in (wire.prefix_sent_subject(stream, "*"), wire.prefix_held_subject(stream, "*")):
        assert subject in published, f"no role may publish {subject}"
    assert f"$JS.API.CONSUMER.CREATE.{stream}" in published, "no role may read the prefix stream"


def test_the_bucket_names_come_from_the_config(config: Config) -> None:
    renamed = config.model_copy(
        update={"auth": config.auth.model_copy(update={"bucket": "other_keys"})}
    )
    assert "$KV.other_keys.>" in role_permissions(renamed)["keys"].publish
    assert "$KV.llmgw_keys.>" not in render_server_config(renamed)


def test_every_service_has_a_role() -> None:
    assert set(SERVICE_ROLES) == {"edge", "admission", "reaper", "scraper"}
    assert set(SERVICE_ROLES.values()) <= set(ROLES)


# --- on a real server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secured(config: Config, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    conf = tmp_path_factory.mktemp("nats-auth") / "auth.conf"
    conf.write_text(render_server_config(config, PASSWORDS))
    server = EmbeddedNats(extra_args=("-c", str(conf)), client_auth=("state", PASSWORDS["state"]))
    with server:
        yield server


class RoleClient:
    """A connection as one role that records the server's permission violations."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self._seen = asyncio.Event()
        self.nc: NATS | None = None

    async def on_error(self, exc: Exception) -> None:
        if "permissions violation" in str(exc).lower():
            self.violations.append(str(exc))
            self._seen.set()

    async def denied(self, within: float = _DENIAL_WAIT) -> str:
        await asyncio.wait_for(self._seen.wait(), within)
        self._seen.clear()
        return self.violations[-1]


@pytest_asyncio.fixture(loop_scope="module")
async def connect(secured: EmbeddedNats) -> AsyncIterator:  # type: ignore[type-arg]
    opened: list[NATS] = []

    async def as_role(role: str) -> RoleClient:
        client = RoleClient()
        client.nc = await nats.connect(
            secured.url, user=role, password=PASSWORDS[role], error_cb=client.on_error
        )
        opened.append(client.nc)
        return client

    yield as_role
    for nc in opened:
        with contextlib.suppress(Exception):
            await nc.close()


pytestmark_async = pytest.mark.asyncio(loop_scope="module")


async def _open_buckets(connect, config: Config) -> None:  # type: ignore[no-untyped-def]
    """The buckets exist, each created by a role that may create it (as at a real start)."""
    await open_routing_store((await connect("admission")).nc, config)
    await open_load_bucket((await connect("scraper")).nc, config)
    await open_key_bucket((await connect("keys")).nc, config)


@pytestmark_async
@pytest.mark.parametrize("bucket", sorted(WRITERS))
async def test_only_a_buckets_writers_may_write_it(connect, config: Config, bucket: str) -> None:
    await _open_buckets(connect, config)
    for role in ROLES:
        client = await connect(role)
        kv = NatsKV(client.nc.jetstream(timeout=0.25), _bucket(config, bucket))
        if role in WRITERS[bucket]:
            assert await kv.put(f"test.{role}", b"x") > 0, role
            assert client.violations == [], (role, client.violations)
        else:
            with pytest.raises(nats.errors.TimeoutError):  # no ack: the server dropped it
                await kv.put(f"test.{role}", b"x")
            violation = await client.denied()
            assert f"$kv.{_bucket(config, bucket)}.test.{role}" in violation.lower(), role


@pytestmark_async
async def test_an_edge_cannot_write_a_pin_or_a_key_but_reads_the_keys(
    connect, config: Config
) -> None:
    await _open_buckets(connect, config)
    operator = await connect("keys")
    keys = await open_key_bucket(operator.nc, config)
    secret = "sk-llmgw-" + "ab" * 24
    await keys.put(ApiKey(digest=digest_of(secret), tenant="t", prefix=secret[:15]))

    edge = await connect("edge")
    mirror_side = await open_key_bucket(edge.nc, config)  # what the edge's mirror opens
    assert digest_of(secret) in {k.digest for k in await mirror_side.list()}
    assert edge.violations == []

    routing = NatsKV(edge.nc.jetstream(timeout=0.25), config.pinning.bucket)
    with pytest.raises(nats.errors.TimeoutError):
        await routing.put("pin.0123456789abcdef", b"{}")
    assert "pin.0123456789abcdef" in await edge.denied()
    forged = ApiKey(digest=digest_of("sk-llmgw-" + "cd" * 24), tenant="x")
    keys_as_edge = NatsKV(edge.nc.jetstream(timeout=0.25), config.auth.bucket)
    with pytest.raises(nats.errors.TimeoutError):
        await keys_as_edge.create(forged.kv_key, forged.to_json())
    assert f"$kv.{config.auth.bucket}." in (await edge.denied()).lower()


@pytestmark_async
async def test_an_edge_cannot_listen_to_other_edges_admission_requests(connect) -> None:
    edge = await connect("edge")
    await edge.nc.subscribe(f"{wire.ADMISSION_REQUEST_PREFIX}*")
    assert "subscription" in (await edge.denied()).lower()


@pytestmark_async
async def test_a_wrong_password_is_refused(secured: EmbeddedNats) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(
            secured.url, user="keys", password="guess", allow_reconnect=False, connect_timeout=2
        )


@pytestmark_async
async def test_the_events_role_taps_the_public_subjects_live(connect) -> None:
    reader, edge = await connect("events"), await connect("edge")
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def keep(msg) -> None:  # type: ignore[no-untyped-def]
        await got.put(msg.data)

    await reader.nc.subscribe(wire.REQUEST_STATS_SUBJECT, cb=keep)
    await reader.nc.flush()
    await edge.nc.publish(wire.REQUEST_STATS_SUBJECT, b"{}")
    await edge.nc.flush()  # the server has the message once this returns
    try:
        assert await asyncio.wait_for(got.get(), _DENIAL_WAIT) == b"{}"
    except TimeoutError:  # say what each side saw: one such failure in many runs, unexplained
        pytest.fail(
            f"no message in {_DENIAL_WAIT}s; violations: reader {reader.violations}, edge "
            f"{edge.violations}; connected: reader {reader.nc.is_connected}, edge "
            f"{edge.nc.is_connected}; reader stats {reader.nc.stats}, edge stats {edge.nc.stats}"
        )
    assert reader.violations == [] and edge.violations == []
    await reader.nc.publish(wire.REQUEST_STATS_SUBJECT, b"{}")  # a reader, not a publisher
    assert wire.REQUEST_STATS_SUBJECT in await reader.denied()


@pytestmark_async
async def test_the_scraper_creates_the_prefix_stream_and_publishes_only_held_updates(
    connect, config: Config
) -> None:
    scraper = await connect("scraper")
    js = scraper.nc.jetstream(timeout=2)
    assert await ensure_prefix_stream(js, config)  # created, then found as configured
    assert await ensure_prefix_stream(js, config)
    stream = config.prefix_stream
    ack = await js.publish(wire.prefix_held_subject(stream, "engine-1"), b"{}")
    assert ack.stream == stream and scraper.violations == []
    await scraper.nc.publish(wire.prefix_sent_subject(stream, "engine-1"), b"{}")  # admission's
    assert wire.prefix_sent_subject(stream, "engine-1") in await scraper.denied()
