"""Routing-state design options measured on this machine (evidence for the routing-state ADR).

    python benchmarks/kv_options.py [--rounds 3] [--seconds 3]

One nats-server (CPU 1, every thread) and this client (CPU 0), loopback. Each round runs:

(a) one ledger key per provider/model: 8 asyncio tasks take and give back capacity by
    read-modify-CAS (get, +1 or -1, update at the read revision) on ONE key;
(b) one key per slot: 8 tasks take a random slot among G slot keys (get; if free, CAS it to
    taken) and free it again (CAS from the revision they wrote), G = 8, 16, 64;
    (a) and (b) go through llmgw's own KV adapter (NatsKV), as the product does;
(c) ADR-50 atomic batch (server >= 2.12; `allow_atomic` switched on with js.update_stream): a
    2-message batch writing two keys, each message with Nats-Expected-Last-Subject-Sequence,
    the first sent with a plain publish, the commit with a request. Latency per commit alone,
    and commits/s with 8 tasks racing on the same two keys (read both, commit, retry on a
    rejected batch), for file and memory storage; plus a single CAS and two sequential CAS
    as the reference;
(d) per-message TTL (nats-py creates KV streams with allow_msg_ttl): create with msg_ttl vs a
    plain create, and renewing by a raw publish with the expected-sequence header and a TTL
    vs a plain CAS update; and a check that a renewed key then expires on time.

Every contended scenario ends with an invariant check (no lost update, no double grant, both
batch keys equal). Rounds interleave the scenarios; results are median [min..max] over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import uvloop
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyNotFoundError

from llmgw.nats_embedded import EmbeddedNats
from llmgw.state.kv import CasConflict
from llmgw.state.nats_kv import NatsKV

CLIENT_CPUS = {0}
SERVER_CPUS = {1}
TASKS = 8
SLOT_COUNTS = (8, 16, 64)
LATENCY_SAMPLES = 400
EXPECTED_SEQ = "Nats-Expected-Last-Subject-Sequence"


def pin_all_threads(pid: int, cpus: set[int]) -> None:
    """Pin every thread of `pid` (affinity is per thread; a running Go server has many)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


@dataclass
class Contended:
    successes: int = 0
    conflicts: int = 0
    calls: int = 0  # KV round trips (or batch commits) made
    seconds: float = 0.0
    busy: int = 0  # (b) only: reads that found the slot taken

    @property
    def rate(self) -> float:
        return self.successes / self.seconds

    @property
    def conflicts_per_success(self) -> float:
        return self.conflicts / max(1, self.successes)


async def run_tasks(
    seconds: float, body: Callable[[Contended, float], Awaitable[None]]
) -> Contended:
    """TASKS copies of `body(result, deadline)`, sharing one result."""
    result = Contended()
    started = time.perf_counter()
    deadline = started + seconds
    await asyncio.gather(*(body(result, deadline) for _ in range(TASKS)))
    result.seconds = time.perf_counter() - started
    return result


async def latency(
    call: Callable[[], Awaitable[Any]], samples: int = LATENCY_SAMPLES
) -> list[float]:
    for _ in range(20):
        await call()
    out = []
    for _ in range(samples):
        started = time.perf_counter()
        await call()
        out.append(time.perf_counter() - started)
    return out


async def new_bucket(js: Any, storage: StorageType = StorageType.FILE) -> tuple[str, NatsKV]:
    name = f"kvopt_{uuid.uuid4().hex[:10]}"
    await js.create_key_value(KeyValueConfig(bucket=name, history=1, storage=storage, direct=True))
    return name, NatsKV(js, name)


# ---- (a) one ledger key ---------------------------------------------------------------------


async def ledger(js: Any, seconds: float) -> Contended:
    name, kv = await new_bucket(js)
    key = "ledger.local.bench"
    await kv.create(key, b'{"v":1,"in_flight":0}')
    net = 0

    async def task(result: Contended, deadline: float) -> None:
        nonlocal net
        delta = 1
        while time.perf_counter() < deadline:
            entry = await kv.get(key)
            assert entry is not None
            value = json.loads(entry.value)
            value["in_flight"] += delta
            result.calls += 2
            try:
                await kv.update(key, json.dumps(value).encode(), entry.revision)
            except CasConflict:
                result.conflicts += 1
                continue
            result.successes += 1
            net += delta
            delta = -delta  # take, give back, take...

    result = await run_tasks(seconds, task)
    final = json.loads((await kv.get(key)).value)["in_flight"]
    if final != net:
        raise AssertionError(f"lost update: ledger says {final}, tasks applied {net}")
    await js.delete_key_value(name)
    return result


# ---- (b) one key per slot -------------------------------------------------------------------


async def slots(js: Any, seconds: float, count: int) -> Contended:
    name, kv = await new_bucket(js)
    free = b'{"v":1,"state":"free"}'
    for index in range(count):
        await kv.create(f"slot.{index}", free)
    rng = random.Random(count)

    async def task(result: Contended, deadline: float) -> None:
        me = id(asyncio.current_task())
        while time.perf_counter() < deadline:
            index = rng.randrange(count)
            key = f"slot.{index}"
            entry = await kv.get(key)
            result.calls += 1
            assert entry is not None
            if json.loads(entry.value)["state"] != "free":
                result.busy += 1
                continue
            taken = json.dumps({"v": 1, "state": "taken", "owner": me}).encode()
            result.calls += 1
            try:
                revision = await kv.update(key, taken, entry.revision)
            except CasConflict:
                result.conflicts += 1
                continue
            result.successes += 1
            result.calls += 1
            await kv.update(key, free, revision)  # the holder's revision: never conflicts
            result.successes += 1

    result = await run_tasks(seconds, task)
    for index in range(count):  # every take was followed by its free
        entry = await kv.get(f"slot.{index}")
        if entry is None or json.loads(entry.value)["state"] != "free":
            raise AssertionError(f"slot {index} left taken")
    await js.delete_key_value(name)
    return result


# ---- (c) ADR-50 atomic batch ----------------------------------------------------------------


class BatchRejected(Exception):
    pass


async def commit_batch(nc: Any, bucket: str, writes: list[tuple[str, bytes, int]]) -> int:
    """Write every (key, value, expected revision) atomically; the last revision written."""
    batch_id = uuid.uuid4().hex
    *first, last = writes
    for number, (key, value, expected) in enumerate(first, start=1):
        await nc.publish(
            f"$KV.{bucket}.{key}",
            value,
            headers={
                "Nats-Batch-Id": batch_id,
                "Nats-Batch-Sequence": str(number),
                EXPECTED_SEQ: str(expected),
            },
        )
    key, value, expected = last
    reply = await nc.request(
        f"$KV.{bucket}.{key}",
        value,
        timeout=5,
        headers={
            "Nats-Batch-Id": batch_id,
            "Nats-Batch-Sequence": str(len(writes)),
            "Nats-Batch-Commit": "1",
            EXPECTED_SEQ: str(expected),
        },
    )
    ack = json.loads(reply.data)
    if "error" in ack:
        raise BatchRejected(ack["error"].get("description", ""))
    return int(ack["seq"])


async def atomic_bucket(js: Any, storage: StorageType) -> tuple[str, NatsKV]:
    name, kv = await new_bucket(js, storage)
    info = await js.stream_info(f"KV_{name}")
    config = info.config
    config.allow_atomic = True
    updated = await js.update_stream(config)
    if not updated.config.allow_atomic:
        raise RuntimeError("the server did not enable allow_atomic (needs nats-server >= 2.12)")
    return name, kv


@dataclass
class BatchResults:
    single_cas: list[float] = field(default_factory=list)
    two_cas: list[float] = field(default_factory=list)
    commit: list[float] = field(default_factory=list)
    contended: Contended | None = None


async def batches(nc: Any, js: Any, seconds: float, storage: StorageType) -> BatchResults:
    name, kv = await atomic_bucket(js, storage)
    out = BatchResults()
    revisions = {"a": await kv.create("a", b"0"), "b": await kv.create("b", b"0")}

    async def one_cas() -> None:
        revisions["a"] = await kv.update("a", b"1", revisions["a"])

    async def two_cas() -> None:
        revisions["a"] = await kv.update("a", b"1", revisions["a"])
        revisions["b"] = await kv.update("b", b"1", revisions["b"])

    async def commit() -> None:
        seq = await commit_batch(
            nc, name, [("a", b"1", revisions["a"]), ("b", b"1", revisions["b"])]
        )
        revisions["a"], revisions["b"] = seq - 1, seq  # a batch's messages are consecutive

    out.single_cas = await latency(one_cas)
    out.two_cas = await latency(two_cas)
    out.commit = await latency(commit)
    counter = {"a": 0}
    await commit_batch(nc, name, [("a", b"0", revisions["a"]), ("b", b"0", revisions["b"])])

    async def task(result: Contended, deadline: float) -> None:
        while time.perf_counter() < deadline:
            a, b = await kv.get("a"), await kv.get("b")
            assert a is not None and b is not None
            value = str(int(a.value) + 1).encode()
            result.calls += 3
            try:
                await commit_batch(nc, name, [("a", value, a.revision), ("b", value, b.revision)])
            except BatchRejected:
                result.conflicts += 1
                continue
            result.successes += 1
            counter["a"] += 1

    out.contended = await run_tasks(seconds, task)
    a, b = await kv.get("a"), await kv.get("b")
    if a.value != b.value or int(a.value) != counter["a"]:
        raise AssertionError(
            f"batch invariant broken: a={a.value!r} b={b.value!r} commits={counter['a']}"
        )
    await js.delete_key_value(name)
    return out


# ---- (d) per-message TTL --------------------------------------------------------------------


@dataclass
class TtlResults:
    create: list[float] = field(default_factory=list)
    create_ttl: list[float] = field(default_factory=list)
    update: list[float] = field(default_factory=list)
    renew_raw: list[float] = field(default_factory=list)
    expired_on_time: bool = False


async def ttl(js: Any) -> TtlResults:
    name = f"kvopt_{uuid.uuid4().hex[:10]}"
    kv = await js.create_key_value(KeyValueConfig(bucket=name, history=1, direct=True))
    info = await js.stream_info(f"KV_{name}")
    if not info.config.allow_msg_ttl:
        raise RuntimeError("the KV stream lacks allow_msg_ttl")
    out = TtlResults()
    counter = iter(range(10**9))
    out.create = await latency(lambda: kv.create(f"c.{next(counter)}", b"x"))
    out.create_ttl = await latency(lambda: kv.create(f"t.{next(counter)}", b"x", msg_ttl=30))
    revision = {"u": await kv.create("u", b"x"), "r": await kv.create("r", b"x", msg_ttl=30)}

    async def update() -> None:
        revision["u"] = await kv.update("u", b"y", last=revision["u"])

    async def renew() -> None:
        ack = await js.publish(
            f"$KV.{name}.r", b"y", msg_ttl=30, headers={EXPECTED_SEQ: str(revision["r"])}
        )
        revision["r"] = ack.seq

    out.update = await latency(update)
    out.renew_raw = await latency(renew)
    # A key created with a 1 s TTL and renewed to 2 s must outlive 1 s and be gone after 2 s.
    created = await kv.create("e", b"x", msg_ttl=1)
    await js.publish(f"$KV.{name}.e", b"y", msg_ttl=2, headers={EXPECTED_SEQ: str(created)})
    await asyncio.sleep(1.3)
    alive_after_renew = (await kv.get("e")).value == b"y"
    await asyncio.sleep(1.4)
    try:
        await kv.get("e")
        gone = False
    except KeyNotFoundError:
        gone = True
    out.expired_on_time = alive_after_renew and gone
    await js.delete_key_value(name)
    return out


# ---- report ---------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    med = statistics.median(values) * scale
    return f"{med:.{digits}f} [{min(values) * scale:.{digits}f}..{max(values) * scale:.{digits}f}]"


def report(args: argparse.Namespace, rounds: list[dict[str, Any]]) -> None:
    print(
        f"\n{args.rounds} rounds, {args.seconds:g} s per contended run, {TASKS} tasks; "
        "median [min..max] over rounds\n"
    )
    print("Contended capacity bookkeeping (NatsKV, file storage):\n")
    print("| layout | successes/s | conflicts per success | KV calls per success |")
    print("|---|---|---|---|")
    layouts = [("ledger", "(a) one ledger key, read-modify-CAS")] + [
        (f"slots{g}", f"(b) one key per slot, G={g} (take + free)") for g in SLOT_COUNTS
    ]
    for key, label in layouts:
        runs: list[Contended] = [r[key] for r in rounds]
        print(
            f"| {label} | {spread([c.rate for c in runs], digits=0)} "
            f"| {spread([c.conflicts_per_success for c in runs])} "
            f"| {spread([c.calls / max(1, c.successes) for c in runs])} |"
        )
    print("\nADR-50 atomic batch (2 keys per batch) vs plain CAS:\n")
    print(
        "| storage | 1 CAS p50 ms | 2 sequential CAS p50 ms | 2-key batch commit p50 ms "
        "| commit p99 ms | 8-way contended commits/s | rejected per commit |"
    )
    print("|---|---|---|---|---|---|---|")
    for storage in ("file", "memory"):
        runs_b: list[BatchResults] = [r[f"batch_{storage}"] for r in rounds]
        contended = [b.contended for b in runs_b if b.contended is not None]
        print(
            f"| {storage} | {spread([pct(b.single_cas, 0.5) for b in runs_b], 1e3)} "
            f"| {spread([pct(b.two_cas, 0.5) for b in runs_b], 1e3)} "
            f"| {spread([pct(b.commit, 0.5) for b in runs_b], 1e3)} "
            f"| {spread([pct(b.commit, 0.99) for b in runs_b], 1e3)} "
            f"| {spread([c.rate for c in contended], digits=0)} "
            f"| {spread([c.conflicts_per_success for c in contended])} |"
        )
    print("\nPer-message TTL (file storage, p50 ms):\n")
    print(
        "| create | create with msg_ttl | CAS update | renew: raw publish with expected "
        "sequence + TTL | renewed key expired on time |"
    )
    print("|---|---|---|---|---|")
    runs_t: list[TtlResults] = [r["ttl"] for r in rounds]
    print(
        f"| {spread([pct(t.create, 0.5) for t in runs_t], 1e3)} "
        f"| {spread([pct(t.create_ttl, 0.5) for t in runs_t], 1e3)} "
        f"| {spread([pct(t.update, 0.5) for t in runs_t], 1e3)} "
        f"| {spread([pct(t.renew_raw, 0.5) for t in runs_t], 1e3)} "
        f"| {sum(t.expired_on_time for t in runs_t)}/{len(runs_t)} rounds |"
    )


async def amain(args: argparse.Namespace, url: str) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    scenarios: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
        ("ledger", lambda: ledger(js, args.seconds)),
        *((f"slots{g}", lambda g=g: slots(js, args.seconds, g)) for g in SLOT_COUNTS),
        ("batch_file", lambda: batches(nc, js, args.seconds, StorageType.FILE)),
        ("batch_memory", lambda: batches(nc, js, args.seconds, StorageType.MEMORY)),
        ("ttl", lambda: ttl(js)),
    ]
    rounds: list[dict[str, Any]] = []
    try:
        for round_no in range(args.rounds):
            shift = round_no % len(scenarios)
            results: dict[str, Any] = {}
            for name, run in scenarios[shift:] + scenarios[:shift]:
                results[name] = await run()
            rounds.append(results)
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        await nc.close()
    report(args, rounds)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="per contended run")
    args = parser.parse_args()
    os.sched_setaffinity(0, CLIENT_CPUS)
    with EmbeddedNats() as server:
        pin_all_threads(server.pid, SERVER_CPUS)
        print(
            f"nats-server {'.'.join(map(str, server.version or ()))}, nats-py "
            f"{importlib.metadata.version('nats-py')}",
            file=sys.stderr,
        )
        uvloop.run(amain(args, server.url))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
