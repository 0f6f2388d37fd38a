"""A whole cluster under `llmgw up` with the shipped config (free ports), a second edge beside it
(every edge runs an admission instance: two edges, two instances), API keys per tenant, and the
third party's own bill (`GET /sim/usage` of each simulated deployment)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "up"))
from up_harness import REPO, UpProcess, write_cluster_config

from llmgw.serving import free_port

READY = (
    r"^llmgw is ready: OpenAI API at (http://\S+/v1), API key (sk-llmgw-\w+) \(Ctrl-C to stop\)$"
)
NATS_READY = r"^\[nats\] nats-server \S+ ready on (nats://\S+)"
EDGE_READY = re.compile(r"llmgw edge ready on (http://\S+)")


@dataclass
class SpendCluster:
    config_path: Path
    config: dict[str, Any]
    up: UpProcess
    apis: list[str]
    dev_key: str
    nats_url: str
    edges: list[subprocess.Popen[str]] = field(default_factory=list)

    # ---- tools -----------------------------------------------------------------------------

    def cli(self, command: str, *args: str) -> Any:
        """`llmgw COMMAND --config C --json ARGS` against this cluster's NATS; its JSON."""
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLMGW_")}
        env["LLMGW_NATS__URL"] = self.nats_url
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "llmgw",
                command,
                "--config",
                str(self.config_path),
                "--json",
                *args,
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def chat(self, key: str, edge: int = 0, **body: Any) -> httpx.Response:
        """One non-streamed chat request through edge number `edge`."""
        request = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], **body}
        return httpx.post(
            f"{self.apis[edge]}/chat/completions",
            json=request,
            headers={"authorization": f"Bearer {key}"},
            timeout=30,
        )

    def key_for(self, tenant: str) -> str:
        return self.cli("keys", "create", "--tenant", tenant)["secret"]

    def third_parties(self) -> list[dict[str, Any]]:
        return [e for e in self.config["endpoints"] if e["provider"] == "tensorx"]

    def engines(self) -> list[dict[str, Any]]:
        return [e for e in self.config["endpoints"] if e["provider"] == "iris"]

    def prices(self) -> dict[str, dict[str, Decimal]]:
        """Per model: the third party's prices per million tokens, as configured."""
        return {
            p["model"]: {k: Decimal(str(p[k])) for k in ("input", "cached_input", "output")}
            for p in self.config["spend"]["prices"]
            if p["provider"] == "tensorx"
        }

    def third_party_bill(self) -> dict[str, dict[str, int]]:
        """The third party's own count, per model, summed over its deployments."""
        return self.bill(self.third_parties())

    def bill(self, endpoints: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
        """What `endpoints` counted they served (`GET /sim/usage`), per model, summed."""
        total: dict[str, dict[str, int]] = {}
        for endpoint in endpoints:
            bill = httpx.get(endpoint["url"] + "/sim/usage", timeout=10).json()["models"]
            for model, row in bill.items():
                mine = total.setdefault(model, dict.fromkeys(row, 0))
                for name, value in row.items():
                    mine[name] += value
        return total

    def third_party_cost(self, models: list[str] | None = None) -> Decimal:
        """What the third party's bill comes to at the configured prices (exact)."""
        prices = self.prices()
        cost = Decimal(0)
        for model, row in self.third_party_bill().items():
            if models is not None and model not in models:
                continue
            price = prices[model]
            uncached = row["prompt_tokens"] - row["cached_tokens"]
            cost += (
                price["input"] * uncached
                + price["cached_input"] * row["cached_tokens"]
                + price["output"] * row["completion_tokens"]
            ) / 1_000_000
        return cost

    def set_faults(self, endpoint: dict[str, Any], **knobs: Any) -> None:
        answer = httpx.post(endpoint["url"] + "/sim/faults", json=knobs, timeout=10)
        assert answer.status_code == 200, answer.text

    def add_edge(self) -> str:
        """A second `llmgw edge` process joining the cluster (and its admission instance)."""
        data = dict(self.config)
        data["nats"] = {"url": self.nats_url}
        path = self.config_path.with_name("second-edge.yaml")
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLMGW_")}
        env["PYTHONUNBUFFERED"] = "1"
        # No load balancer in front of it either: it drains at once on SIGTERM, as `llmgw up`
        # has its own edge do (router.drain_delay 0 unless set), instead of serving 2 s more.
        env["LLMGW_ROUTER__DRAIN_DELAY"] = "0s"
        listen, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmgw",
                "edge",
                "--config",
                str(path),
                "--listen",
                listen,
                "--admin-listen",
                admin,
            ],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.edges.append(process)
        deadline = time.monotonic() + 60
        assert process.stdout is not None
        for line in process.stdout:
            if EDGE_READY.search(line):
                break
            if time.monotonic() > deadline:
                raise AssertionError("the second edge did not start")
        else:
            raise AssertionError("the second edge exited")
        # Keep draining its output, so it never blocks on a full pipe.
        import threading

        threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()  # type: ignore[union-attr]
        api = f"http://{listen}/v1"
        self.apis.append(api)
        return api

    def stop(self) -> None:
        for process in self.edges:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
        self.up.stop(signal.SIGTERM, timeout=60)


def start_cluster(
    tmp_path: Path,
    spend: dict[str, Any] | None = None,
    edit: Callable[[dict[str, Any]], None] | None = None,
) -> SpendCluster:
    """`llmgw up` with config/local.yaml on free ports; `spend` replaces keys of its spend,
    `edit` changes the rest of the config (in place) before it starts."""
    path = write_cluster_config(tmp_path / "cluster.yaml")
    data = yaml.safe_load(path.read_text())
    data["spend"] = {**data["spend"], **(spend or {})}
    if edit is not None:
        edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    up = UpProcess(path)
    try:
        api, key = up.wait_for(READY, timeout=120).groups()
        nats_url = up.wait_for(NATS_READY, timeout=5).group(1)
    except BaseException:
        up.kill_everything()
        raise
    return SpendCluster(path, data, up, [api], key, nats_url)
