"""Start a measured llmgw topology as separate processes, pinned to CPUs.

Shared by the benchmarks: an embedded nats-server, one zero-delay engine
simulator, the admission service and the edge, each a real process started
through the `llmgw` CLI with a generated config file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from llmgw.nats_embedded import EmbeddedNats
from llmgw.serving import free_port

ZERO_DELAY = ["prefill_base=0", "prefill_per_token=0", "itl_base=0", "itl_per_running_seq=0"]
# The engine's model always wants 1024 tokens (its output_len_max), more than any benchmark
# request allows: every answer is exactly its max_tokens (max_output_tokens), a fixed amount of
# work per request whatever the API, as it would otherwise end earlier on its own now and then.
WRITES_MAX_TOKENS = ["output_len_distribution=fixed", "output_len_mean=1024"]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid


@dataclass
class Cluster:
    edge_url: str
    engine_url: str
    procs: dict[str, Proc] = field(default_factory=dict)
    nats: EmbeddedNats | None = None
    api_key: str | None = None  # with auth: the key every request sends
    admin_url: str | None = None  # the edge's admin port (/metrics, /admin)

    def gateway_pids(self) -> list[int]:
        """The processes that make up the gateway (not the engine)."""
        pids = [p.pid for name, p in self.procs.items() if name.startswith(("edge", "admission"))]
        if self.nats is not None:
            pids.append(self.nats.pid)
        return pids


def cpu_seconds(pids: list[int]) -> float:
    """CPU time consumed so far by `pids`, in seconds to the nanosecond: the scheduler's
    on-CPU time of every thread of each process (/proc/<pid>/task/<tid>/schedstat). The
    utime + stime of /proc/<pid>/stat count 10 ms ticks: a 300-request run at c=64 uses ~6 of
    them, so one tick more or less moved its figure by a sixth. Those ticks, where schedstat is
    missing."""
    total = 0.0
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
            total += sum(int((task / "schedstat").read_text().split()[0]) for task in tasks) / 1e9
        except (FileNotFoundError, ValueError, IndexError):
            total += _stat_seconds(pid)
    return total


def _stat_seconds(pid: int) -> float:
    """utime + stime of `pid` (all its threads, also the ended ones), in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _config(
    nats_url: str,
    engine_url: str,
    edge_port: int,
    admin_port: int,
    flow: bool,
    auth: bool,
    colocated: bool = False,
    spend: dict | None = None,
    apis: list[str] | None = None,
    prefix: dict | None = None,
    capacity: int | None = 64,
) -> dict:
    provider_apis = {"apis": apis} if apis is not None else {}
    config = {
        "auth": {"mode": "keys" if auth else "none"},
        "listen": f"127.0.0.1:{edge_port}",
        "admin_listen": f"127.0.0.1:{admin_port}",
        "nats": {"url": nats_url},
        "router": {"scrape_interval": "500ms"},
        # Flow control needs the scraper's load reports; without it, it is off. With it on, the
        # shipped default bands and ceilings apply (every request passes through the gate, the
        # reservation, the gossip and the end notice).
        "admission": {"enabled": flow, "colocated": colocated},
        "models": [{"name": "bench-model"}],
        "providers": [
            {
                "id": "local",
                "kind": "managed",
                **provider_apis,
                "models": [
                    {
                        "name": "bench-model",
                        "limits": {
                            "max_pinned_sessions": 1000,
                            "max_global_in_flight_request_slots": 256,
                            "global_in_flight_request_slots_reserved_for_pinned_sessions": 32,
                            "max_per_session_in_flight_request_slots": 4,
                        },
                    }
                ],
            }
        ],
        "endpoints": [
            # The simulated engine runs 64 requests at once (its max_num_seqs), configured as
            # for a real engine (`capacity` None: not configured, as users often write it).
            {
                "id": "engine-1",
                "url": engine_url,
                "provider": "local",
                "models": ["bench-model"],
                **({"capacity": capacity} if capacity is not None else {}),
            }
        ],
    }
    if spend is not None:  # prices and budgets (benchmarks/spend_cost.py)
        config["spend"] = spend
    if prefix is not None:  # cache-aware placement (benchmarks/prefix_overhead.py)
        config["prefix"] = prefix
    return config


def pin_process(pid: int, cpus: set[int]) -> None:
    """Pin every thread of a running process (sched_setaffinity on a pid pins one thread)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


def start_process(name: str, argv: list[str], cpus: set[int], logdir: Path, env: dict) -> Proc:
    log = logdir / f"{name}.log"
    popen = subprocess.Popen(
        argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    os.sched_setaffinity(popen.pid, cpus)
    return Proc(name, popen, log)


def wait_ready(proc: Proc, marker: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if marker in proc.log.read_text():
            return
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited: {proc.log.read_text()[-2000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"{proc.name} not ready in {timeout}s: {proc.log.read_text()[-2000:]}")


@contextmanager
def running_cluster(
    gateway_cpus: set[int],
    engine_cpus: set[int],
    *,
    flow: bool = False,
    admissions: int = 1,
    colocated: bool = False,
    auth: bool = False,
    key_options: tuple[str, ...] = (),
    python: str | None = None,
    spend: dict | None = None,
    apis: list[str] | None = None,
    prefix: dict | None = None,
    env: dict[str, str] | None = None,
    capacity: int | None = 64,
):
    """Yield a Cluster; everything is stopped afterwards.

    ``python``: the interpreter whose installed llmgw runs the services (another code tree's
    virtualenv, to compare two versions side by side: benchmarks/code_ab.py); this one's else.

    ``flow``: admission runs flow control (every request passes an unsaturated queue) and a
    scraper feeds it; otherwise flow control is off and no scraper runs. ``auth``: API keys
    required (auth.mode keys); one key is made with `llmgw keys create` and ``key_options``
    (tenant ``bench``). ``spend``: the config's `spend` section (prices, budgets); ``prefix``:
    its `prefix` section (cache-aware placement). ``env``: more environment for every service
    (config overrides such as ``LLMGW_RESPONSES__CACHE_BYTES``). ``capacity``: the engine
    endpoint's configured batch capacity (None: not configured, so the engine's own or a learned
    one counts).
    ``colocated``: the edge runs its own admission instance (``admission.colocated``); with
    ``admissions=0`` it owns every shard.
    """
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        logdir = Path(tmp)
        nats = EmbeddedNats()
        nats.start()
        pin_process(nats.pid, gateway_cpus)
        engine_port, edge_port, admin_port = free_port(), free_port(), free_port()
        engine_url = f"http://127.0.0.1:{engine_port}"
        config_path = logdir / "bench.yaml"
        config_path.write_text(
            yaml.safe_dump(
                _config(
                    nats.url,
                    engine_url,
                    edge_port,
                    admin_port,
                    flow,
                    auth,
                    colocated,
                    spend,
                    apis,
                    prefix,
                    capacity,
                )
            )
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        cli = [python or sys.executable, "-m", "llmgw"]
        cluster = Cluster(
            edge_url=f"http://127.0.0.1:{edge_port}",
            engine_url=engine_url,
            nats=nats,
            admin_url=f"http://127.0.0.1:{admin_port}",
        )
        try:
            sim_args = [f"--set={s}" for s in (*ZERO_DELAY, *WRITES_MAX_TOKENS)]
            cluster.procs["engine"] = start_process(
                "engine",
                [
                    *cli,
                    "sim",
                    "engine",
                    "--port",
                    str(engine_port),
                    "--model",
                    "bench-model",
                    *sim_args,
                ],
                engine_cpus,
                logdir,
                env,
            )
            wait_ready(cluster.procs["engine"], "ready")
            if flow:
                cluster.procs["scraper"] = start_process(
                    "scraper",
                    [*cli, "scraper", "--config", str(config_path)],
                    gateway_cpus,
                    logdir,
                    env,
                )
                wait_ready(cluster.procs["scraper"], "ready")
            for index in range(admissions):  # "admission", then "admission-1", ...
                name = "admission" if index == 0 else f"admission-{index}"
                cluster.procs[name] = start_process(
                    name,
                    [*cli, "admission", "--config", str(config_path)],
                    gateway_cpus,
                    logdir,
                    env,
                )
                wait_ready(cluster.procs[name], "ready")
            if auth:
                made = subprocess.run(
                    [
                        *cli,
                        "keys",
                        "--config",
                        str(config_path),
                        "--json",
                        "create",
                        "--tenant",
                        "bench",
                        *key_options,
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                cluster.api_key = json.loads(made.stdout)["secret"]
            cluster.procs["edge"] = start_process(
                "edge", [*cli, "edge", "--config", str(config_path)], gateway_cpus, logdir, env
            )
            wait_ready(cluster.procs["edge"], "ready")
            auth_header = {"authorization": f"Bearer {cluster.api_key}"} if auth else {}
            httpx.get(cluster.edge_url + "/v1/models", headers=auth_header).raise_for_status()
            yield cluster
        finally:
            for proc in reversed(list(cluster.procs.values())):
                if proc.popen.poll() is None:
                    proc.popen.send_signal(signal.SIGTERM)
            for proc in cluster.procs.values():
                try:
                    proc.popen.wait(10)
                except subprocess.TimeoutExpired:
                    proc.popen.kill()
            nats.stop()
