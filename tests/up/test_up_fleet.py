"""The live fleet through `llmgw up` with the shipped config, under Poisson load at 70% of the
engines' capacity: an engine added takes work within 2 s, an engine drained takes no new work
while what runs on it finishes, and is removed with no lease left; no client sees an error."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import nats
import pytest
import yaml
from poisson_load import PoissonLoad, Sent
from prometheus_client.parser import text_string_to_metric_families
from test_up_operability import NATS, READY
from timing import eventually
from up_harness import REPO, UpProcess, config_apply, llmgw_cli, write_cluster_config

from llmgw.config import load_config
from llmgw.services.fleet.ops import admission_leases
from llmgw.serving import free_port
from llmgw.state.fleet import open_fleet

pytestmark = pytest.mark.e2e

SLOTS_PER_ENGINE = 16  # config/local.yaml's engines: max_num_seqs 16
MAX_TOKENS = 24


@pytest.fixture
def extra_engine(tmp_path: Path) -> Iterator[Callable[[Path], str]]:
    """Factory: a simulated engine like the config's engine-1 (or, with `models`, one with the
    simulator's defaults serving those names), on a port of its own; its URL."""
    started: list[subprocess.Popen[str]] = []

    def start(config: Path | None, *models: str) -> str:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLMGW_")}
        like = ["--config", str(config), "--endpoint", "engine-1"] if config else []
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "llmgw", "sim", "engine", *like),
                *(arg for model in models for arg in ("--model", model)),
                *("--port", str(port), "--seed", "7"),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started.append(process)
        assert process.stdout is not None
        for line in process.stdout:
            if "ready on" in line:
                break
        else:
            raise AssertionError("the extra engine did not start")
        return f"http://127.0.0.1:{port}"

    yield start
    for process in started:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


def _cli(config: Path, nats_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return llmgw_cli(config, *args, env={"LLMGW_NATS__URL": nats_url})


async def _load_at(api: str, key: str, share: float, engines: int) -> PoissonLoad:
    """Poisson load at `share` of what `engines` engines serve per second: their capacity is
    their batch slots over the service time of a request with every slot taken (a burst of
    one request per slot, measured here)."""
    slots = engines * SLOTS_PER_ENGINE
    probe = PoissonLoad(api, key, rate=1.0, max_tokens=MAX_TOKENS, seed=1)
    await probe.one()  # connections warm
    burst = await asyncio.gather(*(probe.one() for _ in range(slots)))
    await probe.stop()
    assert all(p.status == 200 for p in burst), burst
    service = sorted(p.ended_at - p.sent_at for p in burst)[slots // 2]
    load = PoissonLoad(api, key, rate=share * slots / service, max_tokens=MAX_TOKENS, seed=2)
    load.start()
    return load


# Answered requests before a step under load: two full batches of both engines, several
# service times at the load's full rate (the engines' batches in their steady state).
WARM_ANSWERS = 2 * 2 * SLOTS_PER_ENGINE


async def _warmed(records: list[Sent], timeout: float = 60.0) -> None:
    """Until the load has had `WARM_ANSWERS` requests answered (however long this host takes)."""
    try:
        await eventually(lambda: len(records) >= WARM_ANSWERS, timeout, interval=0.05)
    except AssertionError:
        raise AssertionError(f"{len(records)} requests answered in {timeout:g}s") from None


def _errors(records: list[Sent]) -> list[Sent]:
    return [r for r in records if r.status != 200]


def test_an_engine_added_under_load_serves_within_2s_and_no_client_sees_an_error(
    tmp_path: Path, start_up: Callable[..., UpProcess], extra_engine: Callable[[Path], str]
) -> None:
    config = write_cluster_config(tmp_path / "cluster.yaml")  # the shipped config
    admin = yaml.safe_load(config.read_text())["admin_listen"]
    up = start_up(config)
    api, key = up.wait_for(READY, timeout=90).groups()
    nats_url = up.wait_for(NATS).group(1)
    url = extra_engine(config)
    spec = ["--url", url, "--provider", "iris", "--models", "llama-3.3-70b,qwen2.5-32b"]
    taken = _cli(config, nats_url, "endpoints", "add", "engine-1", *spec)
    assert taken.returncode == 2 and "already in the fleet" in taken.stderr

    async def scenario() -> tuple[list[Sent], float]:
        load = await _load_at(api, key, 0.7, engines=2)
        await _warmed(load.records)
        body = {"id": "engine-3", "url": url, "provider": "iris"}
        body["models"] = ["llama-3.3-70b", "qwen2.5-32b"]
        issued = time.monotonic()
        async with httpx.AsyncClient(timeout=10, headers=up.admin_headers()) as client:
            added = await client.post(f"http://{admin}/admin/endpoints", json=body)
        assert added.status_code == 201, added.text
        await asyncio.sleep(8)  # the load runs on through the change
        return await load.stop(), issued

    records, issued = asyncio.run(scenario())
    assert not _errors(records), _errors(records)[:5]
    on_new = [r for r in records if r.endpoint == "engine-3"]
    assert on_new, "the new engine never served"
    first = on_new[0].sent_at - issued
    assert first < 2.0, f"the new engine's first request was sent {first:.2f}s after the add"
    assert _listed(config, nats_url)["engine-3"] == "active"
    later = [r for r in records if r.sent_at > issued + 2.0]
    share = sum(r.endpoint == "engine-3" for r in later) / len(later)
    # No capacity given: it starts from scoring.target_inflight and learns the engine's 16.
    assert share > 0.1, f"the new engine took {share:.0%} of the requests after it was added"
    offloaded = sum(r.endpoint is not None and r.endpoint.startswith("tensorx") for r in records)
    print(
        f"\nadd under load: {len(records)} requests, 0 errors, {offloaded} offloaded; engine-3's "
        f"first request {first * 1000:.0f} ms after the add was sent (admin API), "
        f"{share:.0%} of those sent 2 s later"
    )


def test_an_engine_drained_under_load_finishes_its_requests_and_is_removed_with_no_lease(
    tmp_path: Path, start_up: Callable[..., UpProcess]
) -> None:
    config = write_cluster_config(tmp_path / "cluster.yaml")
    data = yaml.safe_load(config.read_text())
    third = dict(data["endpoints"][1], id="engine-3", url=f"http://127.0.0.1:{free_port()}")
    third["simulate"] = dict(third["simulate"], seed=3)
    data["endpoints"].insert(2, third)
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    admin = data["admin_listen"]
    up = start_up(config)
    api, key = up.wait_for(READY, timeout=90).groups()
    nats_url = up.wait_for(NATS).group(1)

    async def scenario() -> tuple[list[Sent], float, float]:
        # 70% of what is left once engine-3 is out: the two other engines.
        load = await _load_at(api, key, 0.7, engines=2)
        await _warmed(load.records)
        async with httpx.AsyncClient(timeout=10, headers=up.admin_headers()) as client:
            drained = await client.post(f"http://{admin}/admin/endpoints/engine-3/drain")
        acknowledged = time.monotonic()
        assert drained.status_code == 200, drained.text
        assert drained.json()["state"] == "draining"
        await asyncio.sleep(6)  # the load runs on through the drain
        records = await load.stop()
        removed = await asyncio.to_thread(
            _cli, config, nats_url, "endpoints", "remove", "engine-3", "--wait", "30"
        )
        assert removed.returncode == 0, removed.stderr
        removed_at = time.monotonic()
        nc = await nats.connect(nats_url)
        try:
            leases = await admission_leases(nc)
        finally:
            await nc.close()
        assert leases is not None and leases.get("engine-3", 0) == 0, leases
        return records, acknowledged, removed_at

    records, acknowledged, removed_at = asyncio.run(scenario())
    assert not _errors(records), _errors(records)[:5]
    running_at_drain = [
        r for r in records if r.endpoint == "engine-3" and r.sent_at < acknowledged < r.ended_at
    ]
    assert running_at_drain, "nothing ran on engine-3 when it was drained: the test proves little"
    # A request sent after the drain took effect (within a second) never went to engine-3.
    late = [r for r in records if r.endpoint == "engine-3" and r.sent_at > acknowledged + 1.0]
    assert not late, late[:3]
    listed = _cli(config, nats_url, "endpoints", "--json", "list")
    assert listed.returncode == 0, listed.stderr
    assert "engine-3" not in listed.stdout
    print(
        f"\ndrain under load: {len(records)} requests, 0 errors, {len(running_at_drain)} running "
        f"on engine-3 at the drain all completed, removed {removed_at - acknowledged:.1f}s "
        "after the drain with 0 leases"
    )


async def _engines_in_flight(urls: list[str], samples: list[tuple[float, int]], stop) -> None:  # type: ignore[no-untyped-def]
    """Sample running + waiting at every engine (their own metrics) until `stop` is set."""
    async with httpx.AsyncClient(timeout=5) as http:
        while not stop.is_set():
            total = 0
            for url in urls:
                text = (await http.get(f"{url}/metrics")).text
                for line in text.splitlines():
                    if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                        total += int(float(line.rsplit(" ", 1)[1]))
            samples.append((time.monotonic(), total))
            await asyncio.sleep(0.02)


def test_halving_a_limit_on_sighup_under_load_keeps_the_engines_within_the_new_limit(
    tmp_path: Path, start_up: Callable[..., UpProcess]
) -> None:
    old, new = 24, 12
    config = write_cluster_config(tmp_path / "cluster.yaml")
    data = yaml.safe_load(config.read_text())
    limits = data["providers"][0]["models"][0]["limits"]  # iris / llama-3.3-70b
    limits.update(
        max_global_in_flight_request_slots=old,
        global_in_flight_request_slots_reserved_for_pinned_sessions=0,
    )
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    engines = [e["url"] for e in data["endpoints"] if e["provider"] == "iris"]
    up = start_up(config)
    api, key = up.wait_for(READY, timeout=90).groups()
    nats_url = up.wait_for(NATS).group(1)
    broken = tmp_path / "broken.yaml"
    limits["max_global_in_flight_request_slots"] = 0
    broken.write_text(yaml.safe_dump(data, sort_keys=False))
    refused = config_apply(broken, nats_url)
    assert refused.returncode == 2 and "max_global_in_flight_request_slots" in refused.stderr

    async def scenario() -> tuple[list[Sent], list[tuple[float, int]], float]:
        samples: list[tuple[float, int]] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(_engines_in_flight(engines, samples, stop))
        load = PoissonLoad(api, key, rate=1.0, max_tokens=MAX_TOKENS, seed=3)
        records: list[Sent] = []

        async def worker() -> None:
            while not stop.is_set():
                records.append(await load.one())

        workers = [asyncio.create_task(worker()) for _ in range(40)]
        await _warmed(records)
        limits["max_global_in_flight_request_slots"] = new
        config.write_text(yaml.safe_dump(data, sort_keys=False))
        up.process.send_signal(signal.SIGHUP)
        applied = await asyncio.to_thread(up.wait_for, r"SIGHUP: applied .*; (\d+) of (\d+)", 20)
        acknowledged = time.monotonic()
        assert applied.group(1) == applied.group(2) != "0", applied.group(0)
        await asyncio.sleep(6)  # the load runs on under the new limit
        stop.set()
        await asyncio.gather(*workers, sampler)
        await load.stop()
        return records, samples, acknowledged

    records, samples, acknowledged = asyncio.run(scenario())
    assert not _errors(records), _errors(records)[:5]
    before = max(n for at, n in samples if at < acknowledged)
    assert before > new, f"at most {before} ran at the engines before: the change proves little"
    # Requests granted before the change run to their end (never revoked): the longest took
    # this long, after which only grants under the new limit can be running.
    longest = max(r.ended_at - r.sent_at for r in records)
    settled = [n for at, n in samples if at > acknowledged + longest]
    assert settled and max(settled) <= new, (max(settled), new)
    print(
        f"\nhalving G {old} -> {new} on SIGHUP under load: {len(records)} requests, 0 errors; "
        f"at the engines up to {before} before, at most {max(settled)} in {len(settled)} "
        f"samples from {longest:.1f}s after the acknowledgement (the longest request)"
    )


def _listed(config: Path, nats_url: str) -> dict[str, str]:
    done = _cli(config, nats_url, "endpoints", "--json", "list")
    assert done.returncode == 0, done.stderr
    return {e["id"]: e["state"] for e in json.loads(done.stdout)}


def _states(admin: str, headers: dict[str, str]) -> dict[str, str]:
    """The fleet's endpoints and their states, as the admin HTTP API lists them."""
    listed = httpx.get(f"http://{admin}/admin/endpoints", timeout=10, headers=headers)
    assert listed.status_code == 200, listed.text
    return {e["id"]: e["state"] for e in listed.json()["data"]}


def test_an_engine_that_registers_itself_serves_and_is_drained_then_removed_once_silent(
    tmp_path: Path, start_up: Callable[..., UpProcess], extra_engine: Callable[[Path], str]
) -> None:
    ttl = 3.0
    config = write_cluster_config(tmp_path / "cluster.yaml")
    admin = yaml.safe_load(config.read_text())["admin_listen"]
    up = start_up(config)
    api, key = up.wait_for(READY, timeout=90).groups()
    nats_url = up.wait_for(NATS).group(1)
    url = extra_engine(config)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLMGW_")}
    sidecar = subprocess.Popen(
        [
            *(sys.executable, "-m", "llmgw", "register", "engine-3", "--config", str(config)),
            *("--url", url, "--provider", "iris", "--models", "llama-3.3-70b", "--capacity"),
            *("16", "--ttl", str(ttl)),
        ],
        cwd=REPO,
        env={**env, "LLMGW_NATS__URL": nats_url},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert sidecar.stdout is not None
        assert "registered" in sidecar.stdout.readline()
        served: set[str] = set()
        with httpx.Client(timeout=30, headers={"authorization": f"Bearer {key}"}) as http:
            for n in range(60):
                response = http.post(
                    f"{api}/chat/completions",
                    json={"model": "llama", "messages": [{"role": "user", "content": f"r{n}"}]},
                )
                assert response.status_code == 200, response.text
                served.add(response.headers["x-llmgw-endpoint"])
                if "engine-3" in served:
                    break
        assert "engine-3" in served
        time.sleep(2 * ttl)  # heartbeats keep it: still active after its ttl
        assert _listed(config, nats_url)["engine-3"] == "active"
        headers = up.admin_headers()
        sidecar.kill()  # the engine's sidecar dies: no more heartbeats
        silent = time.monotonic()
        # Read through the admin API (a CLI run costs a second of imports on this host).
        while _states(admin, headers).get("engine-3") == "active":
            assert time.monotonic() - silent < ttl + 3, "not drained after its ttl"
        drained = time.monotonic() - silent
        while "engine-3" in _states(admin, headers):
            assert time.monotonic() - silent < 2 * ttl + 4, "not removed after twice its ttl"
        removed = time.monotonic() - silent
    finally:
        sidecar.kill()
        sidecar.wait(10)
    print(
        f"\nregistered engine-3 served; killed: drained after {drained:.1f}s, removed {removed:.1f}s"
    )


def test_a_lora_adapter_loaded_on_a_running_engine_is_served_through_the_gateway_and_unloaded_leaves(
    tmp_path: Path, start_up: Callable[..., UpProcess], extra_engine: Callable[[Path], str]
) -> None:
    """The shipped config with one more model, `sql-assistant` (alias `sql-lora`, the
    adapter's name), that iris offers and no engine of the file serves, and the reaper reading
    engines' model lists every second: an engine added without models serves what its
    `/v1/models` lists; the adapter loaded there through vLLM's runtime LoRA API is served
    through the gateway within a refresh, on that engine; unloaded, it is no longer placed."""
    values = yaml.safe_load((REPO / "config" / "local.yaml").read_text())
    values["models"].append({"name": "sql-assistant", "aliases": ["sql-lora"]})
    iris = next(p for p in values["providers"] if p["id"] == "iris")
    iris["models"].append({"name": "sql-assistant", "features": ["chat", "completions"]})
    config = write_cluster_config(
        tmp_path / "cluster.yaml",
        models=values["models"],
        providers=values["providers"],
        fleet={"models_refresh": "1s"},
    )
    up = start_up(config)
    api, key = up.wait_for(READY, timeout=90).groups()
    nats_url = up.wait_for(NATS).group(1)
    url = extra_engine(config)
    added = _cli(
        config,
        nats_url,
        "endpoints",
        "--json",
        "add",
        "engine-3",
        "--url",
        url,
        "--provider",
        "iris",
    )
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["models"] == ["llama-3.3-70b", "qwen2.5-32b"]
    chat = {"model": "sql-lora", "max_tokens": 8, "messages": [{"role": "user", "content": "q"}]}
    with httpx.Client(timeout=30, headers={"authorization": f"Bearer {key}"}) as http:
        before = http.post(f"{api}/chat/completions", json=chat)
        assert before.status_code != 200
        lora = {"lora_name": "sql-lora", "lora_path": "/adapters/sql"}
        assert http.post(f"{url}/v1/load_lora_adapter", json=lora).status_code == 200
        loaded = time.monotonic()
        while (answer := http.post(f"{api}/chat/completions", json=chat)).status_code != 200:
            assert time.monotonic() - loaded < 5, f"not served 5 s after the load: {answer.text}"
            time.sleep(0.05)
        served_after = time.monotonic() - loaded
        assert answer.headers["x-llmgw-endpoint"] == "engine-3"
        assert answer.json()["model"] == "sql-lora"
        shown = json.loads(_cli(config, nats_url, "endpoints", "--json", "show", "engine-3").stdout)
        assert shown["models"] == ["llama-3.3-70b", "qwen2.5-32b", "sql-assistant"]
        assert http.post(f"{url}/v1/unload_lora_adapter", json=lora).status_code == 200
        unloaded = time.monotonic()
        # Until the next refresh the gateway still places it there, and the engine answers
        # 404 (docs/architecture.md, "Model discovery"); then the gateway refuses it as before.
        passed_on = []
        while (after := http.post(f"{api}/chat/completions", json=chat)).status_code != (
            before.status_code
        ):
            assert after.status_code == 404, after.text
            assert after.json()["error"]["code"] == "model_not_found", after.text
            passed_on.append(after)
            assert time.monotonic() - unloaded < 5, "still placed there 5 s after the unload"
            time.sleep(0.05)
        left_after = time.monotonic() - unloaded
        assert after.json()["error"]["type"] == before.json()["error"]["type"]
        base = http.post(f"{api}/chat/completions", json={**chat, "model": "llama"})
        assert base.status_code == 200, base.text
    print(
        f"\nLoRA adapter loaded on engine-3: served through the gateway {served_after:.2f}s "
        f"later; unloaded: no longer placed {left_after:.2f}s later ({len(passed_on)} requests "
        f"got the engine's 404 meanwhile); unserved: {before.status_code}"
    )


def _metric(url: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples with `labels` in the exposition at `url`."""
    text = httpx.get(url, timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def _model_left(
    config: Path, nats_url: str, endpoint: str, model: str, since: float, limit: float = 5.0
) -> float:
    """Seconds from `since` until `endpoint`'s record in the fleet bucket no longer lists
    `model` (read every 5 ms); fails after `limit`."""
    nc = await nats.connect(nats_url)
    try:
        bucket = await open_fleet(nc, load_config(config, env={"LLMGW_NATS__URL": nats_url}))

        async def left() -> bool:
            return model not in (await bucket.get(endpoint))[0].endpoint.models

        await eventually(
            left,
            limit - (time.monotonic() - since),
            f"{endpoint} no longer lists {model}",
            interval=0.005,
        )
        return time.monotonic() - since
    finally:
        await nc.close()


# Its config names a model only an adapter loaded at run time serves: warned of, as expected.
@pytest.mark.filterwarnings("ignore::llmgw.config.ConfigWarning")
def test_an_adapter_unloaded_from_one_of_two_engines_is_served_by_the_other_and_leaves_its_list(
    tmp_path: Path, start_up: Callable[..., UpProcess], extra_engine: Callable[[Path], str]
) -> None:
    """Two engines joined serving the adapter `sql-lora`; the reaper reads engines' model lists
    every hour only. The adapter is unloaded from engine-3 while sessions live there: their next
    requests (a burst) get engine-3's 404, are retried on engine-4 and succeed; engine-3's
    breaker stays closed (no endpoint failure), and its list loses the model at once: the
    edge's notice has the reaper read it, once for the burst."""
    values = yaml.safe_load((REPO / "config" / "local.yaml").read_text())
    values["models"].append({"name": "sql-assistant", "aliases": ["sql-lora"]})
    iris = next(p for p in values["providers"] if p["id"] == "iris")
    iris["models"].append({"name": "sql-assistant", "features": ["chat", "completions"]})
    config = write_cluster_config(
        tmp_path / "cluster.yaml",
        models=values["models"],
        providers=values["providers"],
        fleet={"models_refresh": "1h"},
    )
    host, port = yaml.safe_load(config.read_text())["admin_listen"].rsplit(":", 1)
    edge_metrics = f"http://{host}:{port}/metrics"  # the edge's, and its admission instance's
    reaper_metrics = f"http://{host}:{int(port) + 2}/metrics"
    up = start_up(config)
    api, key = up.wait_for(READY, timeout=90).groups()
    nats_url = up.wait_for(NATS).group(1)
    headers = up.admin_headers()
    lora = {"lora_name": "sql-lora", "lora_path": "/adapters/sql"}
    urls = {}
    for name in ("engine-3", "engine-4"):
        urls[name] = extra_engine(config)
        assert httpx.post(f"{urls[name]}/v1/load_lora_adapter", json=lora).status_code == 200
        added = _cli(
            config, nats_url, "endpoints", "--json", "add", name, "--url", urls[name],
            "--provider", "iris",
        )  # fmt: skip
        assert added.returncode == 0, added.stderr
        assert "sql-assistant" in json.loads(added.stdout)["models"]

    auth = {"authorization": f"Bearer {key}"}

    def ask(user: str) -> httpx.Response:  # a client of its own: called from threads too
        chat = {"model": "sql-lora", "max_tokens": 4, "user": user,
                "messages": [{"role": "user", "content": f"query for {user}"}]}  # fmt: skip
        return httpx.post(f"{api}/chat/completions", json=chat, headers=auth, timeout=30)

    with httpx.Client(timeout=30) as http:
        on_3 = []  # sessions that live on engine-3
        for n in range(40):
            answer = ask(f"u{n}")
            assert answer.status_code == 200, answer.text
            if answer.headers["x-llmgw-endpoint"] == "engine-3":
                on_3.append(f"u{n}")
            if len(on_3) == 4:
                break
        assert len(on_3) == 4, "four sessions never lived on engine-3"
        assert _metric(reaper_metrics, "llmgw_reaper_model_list_reads_total") == 0
        assert http.post(f"{urls['engine-3']}/v1/unload_lora_adapter", json=lora).status_code == 200
        unloaded = time.monotonic()
        with ThreadPoolExecutor(len(on_3)) as pool:  # the sessions' next turns, at once
            turns = [pool.submit(ask, user) for user in on_3]
            # Meanwhile: when does engine-3's record in the fleet bucket lose the model?
            left_after = asyncio.run(
                _model_left(config, nats_url, "engine-3", "sql-assistant", unloaded)
            )
            burst = [turn.result() for turn in turns]
        assert [(b.status_code, b.headers["x-llmgw-endpoint"]) for b in burst] == [
            (200, "engine-4")
        ] * len(on_3), [b.text for b in burst]
        shown = http.get(f"http://{host}:{port}/admin/endpoints/engine-3", headers=headers)
        assert shown.json()["models"] == ["llama-3.3-70b", "qwen2.5-32b"]
        retried = _metric(edge_metrics, "llmgw_edge_retries_total", outcome="model_unloaded")
        assert retried >= 1  # at least the first of the burst went to engine-3
        breaker = _metric(
            edge_metrics, "llmgw_admission_endpoint_breaker", endpoint="engine-3", state="closed"
        )
        assert breaker == 1
        reads = _metric(
            reaper_metrics, "llmgw_reaper_model_list_reads_total", trigger="model_unloaded"
        )
        assert reads == 1  # one read for the burst
        assert (
            _metric(reaper_metrics, "llmgw_reaper_model_list_reads_total", trigger="interval") == 0
        )
        fresh = ask("a-new-session")  # no longer placed on engine-3: no retry
        assert (fresh.status_code, fresh.headers["x-llmgw-endpoint"]) == (200, "engine-4")
        assert _metric(edge_metrics, "llmgw_edge_retries_total", outcome="model_unloaded") == (
            retried
        )
    print(
        f"\nsql-lora unloaded from engine-3: {len(on_3)} sessions' next turns served by engine-4 "
        f"({retried:g} retried after engine-3's 404); engine-3's list lost it {left_after:.2f}s "
        f"later ({reads:g} read)"
    )


def test_a_cluster_whose_file_has_no_endpoint_starts_and_serves_the_engines_that_join(
    tmp_path: Path, start_up: Callable[..., UpProcess], extra_engine: Callable[..., str]
) -> None:
    """The shipped config with `endpoints: []` (a fleet that Kubernetes discovery or
    registration fills): `llmgw up` starts, a request is refused with 503 while nothing serves
    it, and an engine added without models serves at once what its `/v1/models` lists."""
    config = write_cluster_config(tmp_path / "cluster.yaml", endpoints=[])
    up = start_up(config)
    api, key = up.wait_for(READY, timeout=90).groups()
    nats_url = up.wait_for(NATS).group(1)
    url = extra_engine(None, "llama-3.3-70b", "qwen2.5-32b")
    chat = {"model": "llama", "max_tokens": 4, "messages": [{"role": "user", "content": "q"}]}
    with httpx.Client(timeout=30, headers={"authorization": f"Bearer {key}"}) as http:
        empty = http.post(f"{api}/chat/completions", json=chat)
        assert empty.status_code == 503, empty.text
        assert _listed(config, nats_url) == {}
        added = _cli(
            config, nats_url, "endpoints", "add", "gpu-1", "--url", url, "--provider", "iris"
        )
        assert added.returncode == 0, added.stderr
        issued = time.monotonic()
        while (answer := http.post(f"{api}/chat/completions", json=chat)).status_code != 200:
            assert time.monotonic() - issued < 2, answer.text
            time.sleep(0.02)
        served_after = time.monotonic() - issued
        assert answer.headers["x-llmgw-endpoint"] == "gpu-1"
    print(f"\nno endpoint in the file: 503, then served by gpu-1 {served_after:.2f}s after the add")
