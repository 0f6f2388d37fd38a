"""docs/events.md's example subscriber, run as written against `llmgw up` (the shipped config on
free ports, shorter timers), sees every kind of event the doc lists, each from a service the doc
names as its publisher; then its replay example reads every kind back from the events stream.

The situations are made as an operator would meet them: sessions fill a small pin table (created,
evicted), both managed engines report unhealthy and recover (endpoint health, a pin moved away
and back home), a second admission process joins (a member joins, shards are handed to it), the
edge is killed while streams hold leases at that process (the edge's successor expires the dead
member, whose shards are claimed and quota reclaimed by the instances that adopt them; the
leases expire), the second process hands the edge's new instance its share and stops (a member
left), and idle pins expire meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from event_doc import example_replay, example_subscriber

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "up"))
from test_up_operability import NATS, READY
from timing import eventually
from up_harness import UpProcess, WatchedProcess, write_cluster_config

from llmgw.core.requests import Feature
from llmgw.core.sessions import session_id
from llmgw.core.shards import shard_of
from llmgw.events import EVENT_KINDS, EventName, Publisher

pytestmark = pytest.mark.e2e

MODEL = "llama-3.3-70b"
ENGINES = ("engine-1", "engine-2")
TIMERS = {
    "pinning": {
        "pin_inactivity_timeout": "8s",  # pins of the first phase expire during the later ones
        "lease_timeout": "3s",
        "return_home_after": "0s",
    },
    "router": {"scrape_interval": "0.5s"},
}
LINE = re.compile(r"^(\S+) (\S+) ?(.*)$")  # the example's "<kind> <instance> <what>"


def _config(tmp_path: Path) -> tuple[Path, dict[str, str], int]:
    """The shipped config on free ports, the timers above and four pins for iris' llama; the
    engines' URLs and the number of shards."""
    path = write_cluster_config(tmp_path / "cluster.yaml", **TIMERS)
    data = yaml.safe_load(path.read_text())
    (iris,) = [p for p in data["providers"] if p["id"] == "iris"]
    (llama,) = [m for m in iris["models"] if m["name"] == MODEL]
    llama["limits"]["max_pinned_sessions"] = 4
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    urls = {e["id"]: e["url"] for e in data["endpoints"] if e["id"] in ENGINES}
    shards = int(data.get("admission", {}).get("shards", 32))
    return path, urls, shards


def _events(watched: WatchedProcess, kind: str, what: str = "") -> list[re.Match[str]]:
    found = [LINE.match(line) for line in list(watched.lines)]
    return [m for m in found if m and m.group(1) == kind and what in m.group(3)]


def _wait_events(
    watched: WatchedProcess, kind: str, what: str = "", count: int = 1, timeout: float = 20.0
) -> list[re.Match[str]]:
    watched.wait_for(rf"^{re.escape(kind)} \S+ .*{re.escape(what)}", timeout, count)
    return _events(watched, kind, what)


def _faults(urls: dict[str, str], **knobs: object) -> None:
    for url in urls.values():
        httpx.post(f"{url}/sim/faults", json=knobs, timeout=5).raise_for_status()


def _served_by(http: httpx.Client, api: str, session: str, provider: str) -> None:
    """Send the session's requests until `provider` serves one (the admission instances follow
    the scraper's reports a moment after the subscriber sees them)."""
    served: list[tuple[int, str | None]] = []

    def served_there() -> bool:
        response = _chat(http, api, session)
        served.append((response.status_code, response.headers.get("x-llmgw-provider")))
        return served[-1] == (200, provider)

    try:
        asyncio.run(eventually(served_there, 15, interval=0.1))
    except AssertionError as failure:
        raise AssertionError(f"{failure}: {session} served by {served}") from None


def _chat(http: httpx.Client, api: str, session: str) -> httpx.Response:
    return http.post(f"{api}/chat/completions", json=_body(), headers={"x-session-id": session})


def _body(stream: bool = False) -> dict[str, object]:
    return {
        "model": "llama",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "stream": stream,
    }


def _sessions_in(shards: set[int], count: int, total: int) -> dict[str, str]:
    """Session header values whose sessions fall into `shards`, with those sessions' ids."""
    found = {}
    for n in range(10_000):
        key = f"lease-{n}"
        session = session_id(Feature.CHAT, MODEL, {}, header_key=key)
        assert session is not None
        if shard_of(session, total) in shards:
            found[key] = session
            if len(found) == count:
                return found
    raise AssertionError(f"no session in shards {shards}")


def _role(instance: str) -> Publisher:
    for role in (Publisher.SCRAPER, Publisher.REAPER):
        if instance.startswith(f"{role}-"):
            return role
    return Publisher.ADMISSION  # `up-edge-…` (the edge's own instance) or `admission-…`


def test_the_doc_subscriber_sees_every_documented_kind_from_its_publishers(
    tmp_path: Path,
) -> None:
    config, engines, shard_count = _config(tmp_path)
    started: list[WatchedProcess] = []
    up = UpProcess(config)
    try:
        api, key = up.wait_for(READY, timeout=90).groups()
        nats_env = {"NATS_URL": up.wait_for(NATS).group(1)}
        subscriber = WatchedProcess("-c", example_subscriber(), env=nats_env)
        started.append(subscriber)
        subscriber.wait_for(r"^listening on llmgw\.v1\.events\.>$", timeout=30)
        headers = {"authorization": f"Bearer {key}"}
        with httpx.Client(timeout=30, headers=headers) as http:
            # A full pin table of one-shot sessions evicts the least recently used one.
            for n in range(5):
                assert _chat(http, api, f"pin-{n}").status_code == 200
            first = _wait_events(subscriber, "pin.created", count=5)[0].group(2)  # the edge's
            _wait_events(subscriber, "pin.evicted")

            # Both engines unhealthy: iris is degraded, the pinned session moves to tensorx;
            # healthy again, it returns home.
            _faults(engines, unhealthy=True)
            for engine in ENGINES:
                _wait_events(subscriber, "endpoint.unhealthy", f"{engine} healthy=False")
            _served_by(http, api, "pin-4", "tensorx")
            _wait_events(subscriber, "pin.moved", "-> tensorx (degraded)")
            _faults(engines, reset=True)
            for engine in ENGINES:
                _wait_events(subscriber, "endpoint.healthy", f"{engine} healthy=True")
            _served_by(http, api, "pin-4", "iris")
            _wait_events(subscriber, "pin.moved", "-> iris (return_home)")

            # A second admission instance joins: the edge's instance hands it shards.
            second = WatchedProcess(
                "-m",
                "llmgw",
                "admission",
                "--config",
                str(config),
                env={"LLMGW_NATS__URL": nats_env["NATS_URL"]},
            )
            started.append(second)
            joined = second.wait_for(r"llmgw admission ready \((\S+),", timeout=30).group(1)
            _wait_events(subscriber, "member.joined", joined)
            handed = _wait_events(subscriber, "shard.handed", f"-> {joined}")
            theirs = {int(s) for m in handed for s in re.findall(r"\d+", m.group(3).split(":")[0])}

            # Streams whose leases the second instance granted, stalled on the engines; the
            # edge is killed under them and never renews them.
            _faults(engines, stall_after_headers=60)
            stalled = _sessions_in(theirs, 2, shard_count)
            with contextlib.ExitStack() as streams:
                for session in stalled:
                    response = streams.enter_context(
                        http.stream(
                            "POST",
                            f"{api}/chat/completions",
                            json=_body(stream=True),
                            headers={"x-session-id": session},
                        )
                    )
                    assert response.status_code == 200
                os.kill(up.pids()["edge"], signal.SIGKILL)
                with contextlib.suppress(httpx.HTTPError):
                    streams.close()
            _faults(engines, reset=True)
            up.wait_for(r"^\[edge\] ready again$", timeout=30)
            _wait_events(subscriber, "member.expired", first)
            _wait_events(subscriber, "shard.claimed")
            _wait_events(subscriber, "quota.reclaimed")
            expired = _wait_events(subscriber, "lease.expired", count=2)
            assert {m.group(3).split()[0] for m in expired} == set(stalled.values())

            # The edge's new instance, settled in, is handed its share by the second one, which
            # then stops and leaves.
            _wait_events(subscriber, "shard.handed", f"{joined} -> up-edge-")
            assert second.stop(signal.SIGTERM) == 0
            _wait_events(subscriber, "member.left", joined)
            _wait_events(subscriber, "pin.expired")
            _wait_events(subscriber, "pool.measured")
            _wait_events(subscriber, "endpoint.scraped")

        seen = [m for m in map(LINE.match, list(subscriber.lines)[1:]) if m]
        assert not [m.group(0) for m in seen if m.group(1) not in set(EventName)]  # none skipped
        assert {m.group(1) for m in seen} == set(EventName)
        wrong = {
            (m.group(1), m.group(2))
            for m in seen
            if _role(m.group(2)) not in EVENT_KINDS[EventName(m.group(1))].publishers
        }
        assert not wrong  # each kind comes from a publisher the doc names

        # The replay example reads the same kinds back from the events stream, then ends.
        replay = WatchedProcess("-c", example_replay(), env=nats_env)
        started.append(replay)
        assert replay.process.wait(60) == 0, replay.output()
        replayed = {line.split()[1] for line in replay.lines if line.strip()}
        assert replayed == set(EventName), replay.output()
    finally:
        for watched in started:
            with contextlib.suppress(ProcessLookupError):
                watched.process.kill()
        up.kill_everything()
