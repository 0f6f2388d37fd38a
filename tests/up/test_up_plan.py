"""What `llmgw up` plans to start, its --dry-run, and the checks it makes before starting."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from up_harness import LOCAL_CONFIG, UpProcess

from llmgw.config import config_from_dict, load_config
from llmgw.services.up.main import run
from llmgw.services.up.plan import (
    ListenAddress,
    ServiceSpec,
    duplicate_listens,
    edge_env,
    plan_cluster,
)


def test_plans_simulators_then_services_then_the_edge_for_the_local_config() -> None:
    """The local config colocates admission: the edge is the admission instance, and no
    separate admission process runs (the admin ports keep their offsets)."""
    plan = plan_cluster(load_config(LOCAL_CONFIG, env={}), "config/local.yaml")
    assert [(s.name, s.kind, s.tier) for s in plan] == [
        ("engine-1", "sim-engine", 0),
        ("engine-2", "sim-engine", 0),
        ("tensorx-east", "sim-provider", 0),
        ("tensorx-west", "sim-provider", 0),
        ("reaper", "reaper", 1),
        ("scraper", "scraper", 1),
        ("edge", "edge", 2),
    ]
    by_name = {s.name: s for s in plan}
    assert by_name["engine-1"].argv == (
        "sim",
        "engine",
        "--config",
        "config/local.yaml",
        "--endpoint",
        "engine-1",
    )
    assert by_name["tensorx-west"].argv[:2] == ("sim", "provider")
    # Admin ports follow the edge's 9090: (admission), reaper, scraper.
    for offset, name in ((2, "reaper"), (3, "scraper")):
        address = f"127.0.0.1:{9090 + offset}"
        assert by_name[name].argv == (
            name,
            "--config",
            "config/local.yaml",
            "--admin-listen",
            address,
        )
        assert [str(a) for a in by_name[name].listens] == [address]
    assert by_name["edge"].argv == ("edge", "--config", "config/local.yaml")
    assert by_name["edge"].admission_instance == "up-edge"  # named per start by the supervisor
    assert [str(a) for a in by_name["edge"].listens] == ["127.0.0.1:8080", "127.0.0.1:9090"]
    assert [str(a) for a in by_name["engine-2"].listens] == ["127.0.0.1:8102"]


def test_a_separate_admission_process_runs_unless_admission_is_colocated() -> None:
    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    data["admission"]["colocated"] = False
    plan = plan_cluster(config_from_dict(data, source="<test>", env={}), "c.yaml")
    assert [(s.name, s.tier) for s in plan if s.tier == 1] == [
        ("admission", 1),
        ("reaper", 1),
        ("scraper", 1),
    ]
    admission = next(s for s in plan if s.kind == "admission")
    assert admission.argv == ("admission", "--config", "c.yaml", "--admin-listen", "127.0.0.1:9091")
    assert next(s for s in plan if s.kind == "edge").admission_instance is None


def test_a_config_that_does_not_name_the_field_runs_admission_in_the_edge() -> None:
    """admission.colocated is true by default: `llmgw up` with a user's own config starts no
    admission process, as with config/local.yaml."""
    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    del data["admission"]
    plan = plan_cluster(config_from_dict(data, source="<test>", env={}), "c.yaml")
    assert [s.kind for s in plan if s.tier == 1] == ["reaper", "scraper"]
    assert next(s for s in plan if s.kind == "edge").admission_instance == "up-edge"


def test_the_edge_drains_at_once_unless_the_config_or_the_environment_sets_a_delay() -> None:
    assert edge_env(load_config(LOCAL_CONFIG, env={})) == {"LLMGW_ROUTER__DRAIN_DELAY": "0s"}
    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    data.setdefault("router", {})["drain_delay"] = "2s"
    assert edge_env(config_from_dict(data, source="test", env={})) == {}
    env = {"LLMGW_ROUTER__DRAIN_DELAY": "5s"}
    assert edge_env(load_config(LOCAL_CONFIG, env=env)) == {}


def test_endpoints_without_simulate_are_not_started() -> None:
    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    for endpoint in data["endpoints"]:
        if endpoint["provider"] == "tensorx":
            del endpoint["simulate"]
    plan = plan_cluster(config_from_dict(data, env={}), "c.yaml")
    assert [s.name for s in plan] == [
        "engine-1",
        "engine-2",
        "reaper",
        "scraper",
        "edge",
    ]


@pytest.mark.parametrize(
    ("line", "kind", "ready"),
    [
        ("llmgw sim engine ready on http://127.0.0.1:8101", "sim-engine", True),
        ("llmgw sim provider ready on http://127.0.0.1:8201", "sim-provider", True),
        ("llmgw admission ready (adm-1)", "admission", True),
        ("llmgw reaper ready (reaper-1, bucket llmgw_routing, every 1s)", "reaper", True),
        ("llmgw admission ready", "reaper", False),
        (
            "llmgw scraper ready (scraper-h-1, bucket llmgw_load, 2 endpoints every 2s)",
            "scraper",
            True,
        ),
        ("llmgw reaper ready", "scraper", False),
        ("llmgw edge ready on http://127.0.0.1:8080 (admin http://127.0.0.1:9090)", "edge", True),
        ("INFO waiting until llmgw edge is ready", "edge", False),
        ("llmgw admission ready", "edge", False),
    ],
)
def test_ready_lines(line: str, kind: str, ready: bool) -> None:
    spec = ServiceSpec("x", (), kind)  # type: ignore[arg-type]
    assert spec.is_ready_line(line) is ready


def test_duplicate_ports_in_the_plan_are_reported() -> None:
    specs = [
        ServiceSpec("a", (), "sim-engine", (ListenAddress("127.0.0.1", 8101, "endpoint a"),)),
        ServiceSpec("b", (), "sim-engine", (ListenAddress("127.0.0.1", 8101, "endpoint b"),)),
        ServiceSpec("c", (), "edge", (ListenAddress("127.0.0.1", 0, "edge `listen`"),)),
    ]
    assert duplicate_listens(specs) == ["port 8101 is used twice: endpoint a and endpoint b"]


def test_dry_run_prints_the_plan_and_starts_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    code = run(argparse.Namespace(config=str(LOCAL_CONFIG), dry_run=True))
    out = capsys.readouterr().out
    assert code == 0
    assert "embedded nats-server on 127.0.0.1:4222" in out
    assert f"llmgw sim engine --config {LOCAL_CONFIG} --endpoint engine-1" in out
    assert f"llmgw edge --config {LOCAL_CONFIG}" in out


def test_an_invalid_config_exits_2_naming_the_field(tmp_path: Path) -> None:
    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    data["router"] = {"retries": -1}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(SystemExit) as excinfo:
        run(argparse.Namespace(config=str(bad), dry_run=False))
    assert excinfo.value.code == 2


def _port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.mark.parametrize("taken", ["listen", "endpoint", "nats"])
def test_a_port_in_use_is_reported_before_anything_starts(
    taken: str, cluster_config: Path, start_up: Callable[..., UpProcess]
) -> None:
    data = yaml.safe_load(cluster_config.read_text())
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        if taken == "listen":
            data["listen"] = f"127.0.0.1:{port}"
            expected = f"port 127.0.0.1:{port} (edge `listen`) is already in use"
        elif taken == "endpoint":
            data["endpoints"][1]["url"] = f"http://127.0.0.1:{port}"
            expected = f"port 127.0.0.1:{port} (simulated endpoint engine-2) is already in use"
        else:
            data["nats"]["embedded_port"] = port
            expected = f"port 127.0.0.1:{port} (nats.embedded_port) is already in use"
        cluster_config.write_text(yaml.safe_dump(data))

        up = start_up(cluster_config)
        assert up.process.wait(30) == 1
    up.wait_for("nothing was started", timeout=5)
    assert expected in up.output()
    assert not up.pids()  # neither NATS nor any service was started


def test_an_admin_port_of_zero_gives_the_other_services_none() -> None:
    data = yaml.safe_load(LOCAL_CONFIG.read_text())
    data["admin_listen"] = "127.0.0.1:0"
    plan = plan_cluster(config_from_dict(data, source="<test>", env={}), "c.yaml")
    for spec in plan:
        if spec.kind in ("admission", "reaper", "scraper"):
            assert "--admin-listen" not in spec.argv and spec.listens == ()
