"""`admission.colocated` is on unless a config turns it off: `llmgw edge` with a config that does
not name the field runs an admission instance in its own process and decides there. An edge
whose NATS user may not write the routing bucket (one user per role) refuses to start, naming
the field, instead of failing later.

Real parts: `llmgw edge` as a process (its composition root decides the topology), a
nats-server (the session's, and one with a user per role for the refusal), a simulated engine,
and the admission state subject, which every instance answers.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
import pytest_asyncio
import yaml

from llmgw.config import config_from_dict
from llmgw.nats_auth import ROLES, render_server_config
from llmgw.nats_embedded import EmbeddedNats
from llmgw.services.sim.apps import create_engine_app
from llmgw.services.sim.params import EngineParams
from llmgw.serving import free_port, start_server
from llmgw.state.setup import open_routing_store
from llmgw.wire import ADMISSION_STATE_SUBJECT, StateReply

pytestmark = pytest.mark.e2e

MODEL = "m1"
SHARDS = 8
PASSWORDS = {role: f"test-password-{role}" for role in ROLES}


def config_without_the_field(nats_url: str, engine_url: str, bucket: str) -> dict[str, Any]:
    """A user's own config: nothing about admission at all."""
    return {
        "listen": f"127.0.0.1:{free_port()}",
        "admin_listen": f"127.0.0.1:{free_port()}",
        "nats": {"url": nats_url},
        "router": {"load_bucket": f"load_{bucket}"},
        "pinning": {"bucket": bucket},
        "models": [{"name": MODEL}],
        "providers": [{"id": "p", "kind": "managed", "models": [{"name": MODEL}]}],
        "endpoints": [{"id": "e1", "url": engine_url, "provider": "p", "models": [MODEL]}],
    }


class EdgeProcess:
    """`python -m llmgw edge --config F [args]`; its output line by line."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []

    @classmethod
    async def start(cls, config: Path, *args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "llmgw", "edge", "--config", str(config), *args),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**clean, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        return cls(process)

    async def ready(self, timeout: float = 30) -> bool:
        """True once it prints its ready line, False if it exits first."""
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout):
            while line := await self.process.stdout.readline():
                self.lines.append(line.decode().rstrip())
                if "llmgw edge ready" in self.lines[-1]:
                    return True
        return False

    async def exit_code(self, timeout: float = 30) -> int:
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout):
            self.lines += (await self.process.stdout.read()).decode().splitlines()
            return await self.process.wait()

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 15)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[Any]:
    server = await start_server(create_engine_app(EngineParams.zero_delay(), [MODEL]))
    yield server
    await server.stop()


async def state_of(nc: Any, instance: str, timeout: float = 10.0) -> StateReply:
    """What `instance` holds, from its answer on the state subject (every instance answers)."""
    inbox = nc.new_inbox()
    answered: asyncio.Future[StateReply] = asyncio.get_running_loop().create_future()

    async def collect(msg: Any) -> None:
        reply = StateReply.model_validate_json(msg.data)
        if reply.instance == instance and not answered.done():
            answered.set_result(reply)

    sub = await nc.subscribe(inbox, cb=collect)
    try:
        await nc.publish(ADMISSION_STATE_SUBJECT, b"", reply=inbox)
        return await asyncio.wait_for(answered, timeout)
    finally:
        await sub.unsubscribe()


async def test_an_edge_whose_config_does_not_name_the_field_decides_in_its_own_process(
    tmp_path: Path, nats_url: str, nats_client: Any, unique_id: str, engine: Any
) -> None:
    bucket = f"colodef_{unique_id}"
    data = config_without_the_field(nats_url, engine.url, bucket)
    # The admission section, still without the field (no scraper here: flow control off).
    data["admission"] = {"shards": SHARDS, "enabled": False}
    assert config_from_dict(data).admission.colocated  # the schema's default
    config = tmp_path / "edge.yaml"
    config.write_text(yaml.safe_dump(data))
    edge = await EdgeProcess.start(config, "--admission-instance", f"edge-own-{unique_id}")
    try:
        # Ready with no `llmgw admission` anywhere: the edge's own instance answered.
        assert await edge.ready(), "\n".join(edge.lines)
        api = f"http://{data['listen']}"
        async with httpx.AsyncClient(timeout=10) as http:
            for n in range(5):
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                response = await http.post(
                    f"{api}/v1/chat/completions",
                    json=body,
                    headers={"x-session-id": f"s-{n}"},
                )
                assert response.status_code == 200, response.text
            metrics = (await http.get(f"http://{data['admin_listen']}/metrics")).text

        # The edge's instance owns every shard: every request is decided there ...
        held = await state_of(nats_client, f"edge-own-{unique_id}")
        assert sorted(held.shards) == list(range(SHARDS)), held
        # ... and its decisions are counted in the edge's own process (its admin port).
        placed = [
            line
            for line in metrics.splitlines()
            if line.startswith("llmgw_admission_placements_total{")
        ]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in placed) >= 5, placed
        # Its start's check of the grants wrote nothing (the stream refused the probe).
        keys = await (await nats_client.jetstream().key_value(bucket)).keys()
        assert not [key for key in keys if key.startswith("grants-check")], keys
    finally:
        await edge.stop()
        await nats_client.jetstream().delete_key_value(bucket)


@pytest.mark.parametrize(
    ("user", "denied"),
    [
        ("edge", "$js.api.stream.info.kv_llmgw_routing"),  # may not even read the bucket
        ("state", "$kv.llmgw_routing.grants-check."),  # reads it, may not write it
    ],
)
async def test_an_edge_whose_nats_user_may_not_write_the_routing_bucket_refuses_to_start(
    tmp_path: Path, user: str, denied: str
) -> None:
    """One NATS user per role (as compose and Kubernetes run): the edge role may not write the
    routing bucket, so an edge left on the default says which field to change and exits 2."""
    data = config_without_the_field("nats://127.0.0.1:1", "http://127.0.0.1:1", "llmgw_routing")
    conf = tmp_path / "auth.conf"
    conf.write_text(render_server_config(config_from_dict(data), PASSWORDS))
    with EmbeddedNats(
        extra_args=("-c", str(conf)), client_auth=("state", PASSWORDS["state"])
    ) as server:
        data["nats"]["url"] = server.url
        admission = await nats.connect(
            server.url, user="admission", password=PASSWORDS["admission"]
        )
        await open_routing_store(admission, config_from_dict(data))  # as a running cluster's
        await admission.close()
        config = tmp_path / "edge.yaml"
        config.write_text(yaml.safe_dump(data))
        as_user = {"LLMGW_NATS__USER": user, "LLMGW_NATS__PASSWORD": PASSWORDS[user]}
        edge = await EdgeProcess.start(config, env=as_user)
        try:
            assert await edge.exit_code() == 2, "\n".join(edge.lines)
        finally:
            await edge.stop()
    said = "\n".join(edge.lines)
    assert "admission.colocated is true (the default)" in said, said
    assert f"nats.user '{user}'" in said and "permissions violation" in said.lower(), said
    assert denied in said.lower(), said
    assert "admission.colocated: false" in said, said


async def test_the_instance_flags_need_an_instance(tmp_path: Path) -> None:
    """`--admission-instance` / `--supersedes` with admission.colocated false: a usage error,
    before anything connects."""
    data = config_without_the_field("nats://127.0.0.1:1", "http://127.0.0.1:1", "b")
    data["admission"] = {"colocated": False}
    config = tmp_path / "edge.yaml"
    config.write_text(yaml.safe_dump(data))
    edge = await EdgeProcess.start(config, "--admission-instance", "x")
    assert await edge.exit_code() == 2
    assert "admission.colocated is false" in "\n".join(edge.lines)
