"""`llmgw sim engine|provider`: settings resolution and the real command as a subprocess."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from llmgw.config import load_config
from llmgw.services.sim.main import UsageError, resolve_settings
from llmgw.services.sim.params import EngineParams, ProviderParams

LOCAL_CONFIG = Path(__file__).resolve().parents[2] / "config" / "local.yaml"


def sim_args(**values: object) -> argparse.Namespace:
    defaults = dict(config=None, endpoint=None, host=None, port=None, model=None, seed=None, set=[])
    defaults.update(values)
    return argparse.Namespace(**defaults)


def test_defaults_and_command_line_overrides() -> None:
    settings = resolve_settings(
        sim_args(port=9001, model=["m1", "m2"], seed=4, set=["max_num_seqs=2", "itl_base=1ms"]),
        "engine",
    )
    assert isinstance(settings.params, EngineParams)
    assert (settings.host, settings.port, settings.models) == ("127.0.0.1", 9001, ["m1", "m2"])
    assert (settings.params.max_num_seqs, settings.params.itl_base, settings.params.seed) == (
        2,
        pytest.approx(0.001),
        4,
    )


@pytest.mark.skipif(not LOCAL_CONFIG.exists(), reason="no config/local.yaml")
def test_endpoint_from_config_gives_params_address_and_models() -> None:
    config = load_config(LOCAL_CONFIG)
    engine = next(
        e for e in config.endpoints if e.simulate is not None and e.simulate.kind == "engine"
    )
    settings = resolve_settings(
        sim_args(config=str(LOCAL_CONFIG), endpoint=engine.id, set=["max_num_seqs=3"]), "engine"
    )
    assert settings.port == int(engine.url.rsplit(":", 1)[1])
    assert settings.models == [engine.upstream_model.get(m, m) for m in engine.models]
    assert settings.params.max_num_seqs == 3
    assert settings.params.itl_base == engine.simulate.itl_base
    provider = next(e for e in config.endpoints if isinstance(e.simulate, ProviderParams))
    with pytest.raises(UsageError, match="llmgw sim provider"):
        resolve_settings(sim_args(config=str(LOCAL_CONFIG), endpoint=provider.id), "engine")
    with pytest.raises(UsageError, match="no endpoint"):
        resolve_settings(sim_args(config=str(LOCAL_CONFIG), endpoint="nope"), "engine")


@pytest.mark.skipif(not LOCAL_CONFIG.exists(), reason="no config/local.yaml")
def test_scheduling_policy_comes_from_the_simulate_block_or_set(tmp_path: Path) -> None:
    text = LOCAL_CONFIG.read_text(encoding="utf-8")
    marker = "    simulate:\n      kind: engine\n"
    assert marker in text
    config = tmp_path / "config.yaml"
    config.write_text(
        text.replace(marker, marker + "      scheduling_policy: priority\n", 1), encoding="utf-8"
    )
    engine = next(e for e in load_config(config).endpoints if e.simulate is not None)
    assert engine.simulate.scheduling_policy == "priority"
    settings = resolve_settings(sim_args(config=str(config), endpoint=engine.id), "engine")
    assert settings.params.scheduling_policy == "priority"
    settings = resolve_settings(
        sim_args(config=str(config), endpoint=engine.id, set=["scheduling_policy=fcfs"]), "engine"
    )
    assert settings.params.scheduling_policy == "fcfs"
    assert resolve_settings(sim_args(), "engine").params.scheduling_policy == "fcfs"
    with pytest.raises(UsageError, match="scheduling_policy"):
        resolve_settings(sim_args(set=["scheduling_policy=lifo"]), "engine")


def test_bad_override_is_a_usage_error_naming_the_key() -> None:
    with pytest.raises(UsageError, match="tokens_per_second"):
        resolve_settings(sim_args(set=["tokens_per_second=-1"]), "provider")


@pytest.mark.parametrize("kind", ["engine", "provider"])
def test_command_serves_until_sigterm_and_exits_cleanly(kind: str) -> None:
    command = [
        sys.executable,
        "-m",
        "llmgw",
        "sim",
        kind,
        "--port",
        "0",
        "--model",
        "m",
        "--set",
        "seed=3",
    ]
    with serving(command) as line:
        assert line.startswith(f"llmgw sim {kind} ready on http://127.0.0.1:"), line
        url = line.split()[5]
        request = urllib.request.Request(
            f"{url}/v1/completions",
            method="POST",
            data=json.dumps(
                {"model": "m", "prompt": "x", "max_tokens": 2, "ignore_eos": True}
            ).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.load(response)["usage"]["completion_tokens"] == 2


@contextlib.contextmanager
def serving(command: list[str]) -> Iterator[str]:
    """Run a simulator command and yield its first line; then SIGTERM must end it cleanly."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None and process.stderr is not None
        yield process.stdout.readline()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        assert "Traceback" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_kv_events_parameters_come_from_set_and_bad_addresses_name_the_field() -> None:
    settings = resolve_settings(
        sim_args(
            set=[
                "kv_events_endpoint=tcp://127.0.0.1:5557",
                "kv_events_replay_endpoint=tcp://127.0.0.1:5558",
                "kv_events_topic=kv@engine-1@m",
                "kv_events_encoding=positional",
                "kv_events_buffer_steps=50",
            ]
        ),
        "engine",
    )
    params = settings.params
    assert isinstance(params, EngineParams)
    assert (params.kv_events_endpoint, params.kv_events_replay_endpoint) == (
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
    )
    assert (params.kv_events_topic, params.kv_events_encoding) == ("kv@engine-1@m", "positional")
    assert params.kv_events_buffer_steps == 50
    assert EngineParams().kv_events_endpoint is None  # off by default
    with pytest.raises(UsageError, match="kv_events_endpoint"):
        resolve_settings(sim_args(set=["kv_events_endpoint=http://127.0.0.1:5557"]), "engine")
    with pytest.raises(UsageError, match="needs kv_events_endpoint"):
        resolve_settings(sim_args(set=["kv_events_replay_endpoint=tcp://127.0.0.1:1"]), "engine")
    with pytest.raises(UsageError, match="kv_events_encoding"):
        resolve_settings(sim_args(set=["kv_events_encoding=json"]), "engine")


def engine_command(*settings: str) -> list[str]:
    command = [sys.executable, "-m", "llmgw", "sim", "engine", "--port", "0", "--model", "m"]
    for setting in settings:
        command += ["--set", setting]
    return command


def test_engine_command_says_where_it_publishes_kv_events() -> None:
    command = engine_command(
        "kv_events_endpoint=tcp://127.0.0.1:*", "kv_events_replay_endpoint=tcp://127.0.0.1:*"
    )
    with serving(command) as line:
        assert re.search(
            r"; KV events on tcp://127\.0\.0\.1:\d+, replay on tcp://127\.0\.0\.1:\d+$", line
        ), line


def test_engine_command_exits_when_its_kv_events_address_is_taken() -> None:
    taken = zmq.Context.instance().socket(zmq.PUB)
    try:
        taken.bind("tcp://127.0.0.1:*")
        address = taken.getsockopt_string(zmq.LAST_ENDPOINT)
        result = subprocess.run(
            engine_command(f"kv_events_endpoint={address}"),
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        taken.close(linger=0)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == (
        f"llmgw sim engine: cannot bind the KV events socket to {address}: Address already in use\n"
    )


@pytest.mark.skipif(not LOCAL_CONFIG.exists(), reason="no config/local.yaml")
def test_an_engine_publishes_kv_events_where_its_endpoint_says_the_gateway_subscribes(
    tmp_path: Path,
) -> None:
    text = LOCAL_CONFIG.read_text(encoding="utf-8")
    marker = "    simulate:\n      kind: engine\n"
    source = (
        "    kv_events: {endpoint: 'tcp://127.0.0.1:5557', "
        "replay_endpoint: 'tcp://127.0.0.1:5558', topic: kv@engine}\n"
    )
    config = tmp_path / "config.yaml"
    config.write_text(text.replace(marker, source + marker, 1), encoding="utf-8")
    engine = next(e for e in load_config(config).endpoints if e.kv_events is not None)
    params = resolve_settings(sim_args(config=str(config), endpoint=engine.id), "engine").params
    assert isinstance(params, EngineParams)
    assert (
        params.kv_events_endpoint,
        params.kv_events_replay_endpoint,
        params.kv_events_topic,
    ) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "kv@engine")
    own = marker + "      kv_events_endpoint: tcp://127.0.0.1:6557\n"
    config.write_text(text.replace(marker, source + own, 1), encoding="utf-8")
    params = resolve_settings(sim_args(config=str(config), endpoint=engine.id), "engine").params
    assert isinstance(params, EngineParams)
    assert (params.kv_events_endpoint, params.kv_events_replay_endpoint) == (
        "tcp://127.0.0.1:6557",
        None,
    )
    other = next(
        e
        for e in load_config(config).endpoints
        if e.simulate is not None and e.simulate.kind == "engine" and e.id != engine.id
    )
    plain = resolve_settings(sim_args(config=str(config), endpoint=other.id), "engine").params
    assert isinstance(plain, EngineParams) and plain.kv_events_endpoint is None
