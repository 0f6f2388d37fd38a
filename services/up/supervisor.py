"""Runs the plan of `llmgw up` as child processes and keeps them alive.

Concurrency model: one asyncio task per child pumps its merged stdout/stderr,
prefixing every line with "[name] " and watching for the ready line; one task
per ready child waits for its exit and restarts it per `RestartPolicy`. The
supervisor owns every process it spawned and, on every way out of `run()`
(signal, startup failure, crash loop, cancellation), stops them in reverse tier
order: SIGTERM to the child's process group, SIGKILL after `grace` seconds.

Startup: tiers start in order (simulators, admission, edge); the children of a
tier start together and the next tier starts when all of them printed their
ready line. A child that exits or stays silent past `ready_timeout` during
startup fails the whole start (restarting cannot fix a bad port or config).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from llmgw.clock import SYSTEM, Clock, TimeSource, monotonic_of
from llmgw.nats_embedded import die_with_parent
from llmgw.services.up.plan import ServiceSpec, url_in_line
from llmgw.services.up.restart import RestartPolicy

_LINE_LIMIT = 1 << 20  # longest child output line read as one line


@dataclass(eq=False)
class _Child:
    spec: ServiceSpec
    policy: RestartPolicy
    process: asyncio.subprocess.Process | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    ready_url: str | None = None
    pump: asyncio.Task[None] | None = None
    keeper: asyncio.Task[None] | None = None
    spawns: int = 0  # processes started for this child so far

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None


class StartupError(RuntimeError):
    """A child could not be brought up; the message names it and says why."""


class ClusterSupervisor:
    """Starts `specs` as `[python, -m, llmgw, *spec.argv]` and supervises them."""

    def __init__(
        self,
        specs: Sequence[ServiceSpec],
        env: Mapping[str, str],
        *,
        out: TextIO | None = None,
        ready_timeout: float = 60.0,
        grace: float = 10.0,
        policy_factory: Callable[[], RestartPolicy] = RestartPolicy,
        clock: Clock | TimeSource = SYSTEM,
        command_prefix: Sequence[str] = (sys.executable, "-m", "llmgw"),
        spec_env: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self._children = [_Child(spec, policy_factory()) for spec in specs]
        self._env = dict(env)
        # Per child (by spec name), over `env`: e.g. its NATS role's credentials (--secure).
        self._spec_env = {name: dict(extra) for name, extra in (spec_env or {}).items()}
        self._out = out or sys.stdout
        self._ready_timeout = ready_timeout
        self._grace = grace
        self._clock = monotonic_of(clock)
        self._command_prefix = tuple(command_prefix)
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._failure = asyncio.Event()
        self._failure_reason = ""
        self._stopping = False
        self._run = secrets.token_hex(3)  # tells this start's instance names from an earlier's

    def incarnation_args(self, child: _Child) -> list[str]:
        """Arguments of the child's next process beyond its spec's. An admission process, or
        an edge with admission in process, gets its instance's name, and from its second
        process on the name of the one before, which has exited (this supervisor waited for it
        and killed its process group): the new instance takes its shards and quota over at once
        (`--supersedes`), instead of waiting ``admission.member_ttl`` for its key to expire and
        the reaper's grace for its quota."""
        base = child.spec.admission_instance
        if base is None:
            return []
        flag = "--instance" if child.spec.kind == "admission" else "--admission-instance"
        args = [flag, f"{base}-{self._run}-{child.spawns}"]
        if child.spawns > 0:
            args += ["--supersedes", f"{base}-{self._run}-{child.spawns - 1}"]
        return args

    # -- control --------------------------------------------------------------------------

    def request_stop(self) -> None:
        """First call: graceful stop. Second call: kill what is left right away."""
        if self._stop.is_set():
            self._force.set()
        self._stop.set()

    def fail(self, reason: str) -> None:
        """Stop everything with exit code 1 for a failure outside the children (a NATS node)."""
        if not self._failure.is_set():
            self._failure_reason = reason
            self._failure.set()

    def say(self, line: str) -> None:
        # A closed terminal or pipe must not take the cluster down with it.
        with contextlib.suppress(BrokenPipeError, ValueError):
            self._out.write(line + "\n")
            self._out.flush()

    def ready_url(self, name: str) -> str | None:
        return next((c.ready_url for c in self._children if c.name == name), None)

    def pids(self) -> dict[str, int]:
        return {c.name: c.process.pid for c in self._children if c.process and c.alive}

    async def run(self, on_ready: Callable[[], None] | None = None) -> int:
        """Start everything, call `on_ready`, supervise until a stop request or a crash loop.

        Returns the exit code: 0 after a requested stop, 1 after a failure.
        """
        try:
            try:
                await self._start_all()
            except StartupError as exc:
                self.say(f"llmgw up: {exc}; stopping")
                return 1
            if self._stop.is_set():
                return 0
            if on_ready is not None:
                on_ready()
            await _first_of(self._stop.wait(), self._failure.wait())
            if self._failure.is_set():
                self.say(f"llmgw up: {self._failure_reason}; stopping the cluster")
                return 1
            return 0
        finally:
            await self._shutdown()

    # -- startup --------------------------------------------------------------------------

    async def _start_all(self) -> None:
        tiers = sorted({c.spec.tier for c in self._children})
        for tier in tiers:
            members = [c for c in self._children if c.spec.tier == tier]
            for child in members:
                await self._spawn(child)
            await self._wait_tier_ready(members)
            if self._stop.is_set():
                return
            for child in members:
                child.keeper = asyncio.create_task(self._keep_alive(child))
            if self._failure.is_set():
                raise StartupError(self._failure_reason)

    async def _wait_tier_ready(self, members: list[_Child]) -> None:
        """Return when every member is ready; raise at the first one that cannot be."""
        waits = {asyncio.create_task(self._wait_ready(c)): c for c in members}
        pending = set(waits)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    problem = task.result()
                    if problem is not None and not self._stop.is_set():
                        raise StartupError(f"[{waits[task].name}] {problem}")
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _spawn(self, child: _Child) -> None:
        child.ready = asyncio.Event()
        child.ready_url = None
        argv = [*self._command_prefix, *child.spec.argv, *self.incarnation_args(child)]
        child.spawns += 1
        try:
            child.process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env={**self._env, **self._spec_env.get(child.name, {})},
                limit=_LINE_LIMIT,
                # Own process group: a terminal Ctrl-C reaches only us, so we stop the
                # children in order; die_with_parent covers our own sudden death.
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        except OSError as exc:
            raise StartupError(f"[{child.name}] cannot start {argv[0]}: {exc}") from exc
        self.say(
            f"[{child.name}] started pid {child.process.pid}: llmgw {' '.join(child.spec.argv)}"
        )
        child.pump = asyncio.create_task(self._pump_output(child, child.process))

    async def _wait_ready(self, child: _Child) -> str | None:
        """None when ready; otherwise why not (the child is then stopped)."""
        assert child.process is not None
        process = child.process
        await _first_of(
            child.ready.wait(), process.wait(), self._stop.wait(), timeout=self._ready_timeout
        )
        if child.ready.is_set():
            return None
        if self._stop.is_set():
            return "stopped before it was ready"
        if process.returncode is not None:
            await self._drain_output(child)
            return f"exited with code {process.returncode} before it was ready"
        await self._terminate(child)
        return f"printed no ready line within {self._ready_timeout:g}s"

    async def _pump_output(self, child: _Child, process: asyncio.subprocess.Process) -> None:
        stream = process.stdout
        assert stream is not None
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line longer than the limit: pass it on in pieces
                raw = await stream.read(_LINE_LIMIT)
            if not raw:
                return
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self.say(f"[{child.name}] {line}")
            if not child.ready.is_set() and child.spec.is_ready_line(line):
                child.ready_url = url_in_line(line)
                child.ready.set()

    async def _drain_output(self, child: _Child) -> None:
        # Print the child's last words before our own verdict on its exit.
        if child.pump is not None:
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(child.pump), 2.0)

    # -- supervision ----------------------------------------------------------------------

    async def _keep_alive(self, child: _Child) -> None:
        while True:
            assert child.process is not None
            code = await child.process.wait()
            await self._drain_output(child)
            if self._stopping or self._stop.is_set():
                return
            _kill_group(child.process.pid, signal.SIGKILL)  # leftovers of the dead child
            decision = child.policy.record_exit(self._clock())
            window = f"{child.policy.window:g}s"
            if not decision.restart:
                self._failure_reason = (
                    f"[{child.name}] exited with code {code}; "
                    f"{decision.exits_in_window} exits within {window}, giving up"
                )
                self.say(self._failure_reason)
                self._failure.set()
                return
            self.say(
                f"[{child.name}] exited with code {code}; restarting "
                f"({decision.exits_in_window}/{decision.max_exits}) in {decision.delay:g}s"
            )
            if await _first_of(self._stop.wait(), timeout=decision.delay) is not None:
                return
            try:
                await self._spawn(child)
            except StartupError as exc:
                self._failure_reason = str(exc)
                self._failure.set()
                return
            problem = await self._wait_ready(child)
            if problem is None:
                self.say(f"[{child.name}] ready again")
            elif not self._stop.is_set():
                self.say(f"[{child.name}] {problem}")

    # -- shutdown -------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        self._stopping = True
        self._stop.set()
        # Keepers first: none may spawn a replacement while we stop the children.
        keepers = [c.keeper for c in self._children if c.keeper is not None]
        for task in keepers:
            task.cancel()
        await asyncio.gather(*keepers, return_exceptions=True)
        for tier in sorted({c.spec.tier for c in self._children}, reverse=True):
            members = [c for c in self._children if c.spec.tier == tier]
            await asyncio.gather(*(self._terminate(c) for c in members))
        pumps = [c.pump for c in self._children if c.pump is not None]
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)

    async def _terminate(self, child: _Child) -> None:
        process = child.process
        if process is None:
            return
        if process.returncode is None:
            self.say(f"[{child.name}] stopping (pid {process.pid})")
            _kill_group(process.pid, signal.SIGTERM)
            await _first_of(process.wait(), self._force.wait(), timeout=self._grace)
            if process.returncode is None:
                self.say(f"[{child.name}] did not stop within {self._grace:g}s; killing it")
                _kill_group(process.pid, signal.SIGKILL)
                await process.wait()
        # Anything the child left in its group (it ran in its own session) goes too.
        _kill_group(process.pid, signal.SIGKILL)
        await self._drain_output(child)


def _kill_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def _first_of(*awaitables: Awaitable[Any], timeout: float | None = None) -> Any:
    """Wait for the first awaitable to finish; cancel the rest. None on timeout."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if not done:
        return None
    return next(iter(done)).result()
