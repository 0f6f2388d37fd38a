"""`llmgw sim engine|provider`: settings resolution and the real command as a subprocess."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

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
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = process.stdout.readline()
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
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        assert "Traceback" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
