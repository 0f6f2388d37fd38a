"""Per-key rpm and tpm, cluster-wide: every edge counts its own and hears everybody else's.

Each edge counts, per API key id, the requests it let in and the tokens their usage reported in
the current fixed window (`llmgw.core.apikeys.RateWindow`, 60 s aligned to the epoch), and
publishes its totals (`KeyUsage` on ``llmgw.v1.keys.usage``) every ``auth.usage_interval``
when they changed, and every second while the window has any. It keeps the latest totals of every other edge for the same window. A request
is let in while the sum over all edges is below the key's limit; no round trip on the request
path (a dict lookup and two additions).

Tolerance (docs/keys.md, "Limits"): what other edges let in during the last interval has not
reached this edge yet, so across E edges a key can get up to (E - 1) x (its requests per
interval per edge) past its rpm in a window. A request's tokens are estimated when it is let in
(prompt from its text, output from max_tokens or `spend.default_output_tokens`) and count at
once (`hold_tokens`); when it ends its usage replaces the estimate, so a burst of large
requests passes tpm by at most one request per edge (plus what other edges let in during the
last interval). Totals are
idempotent, so a lost message is repaired by the next one; an edge that stops publishing is
forgotten when the window turns.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from llmgw.clock import Clock, TimeSource, wall_of
from llmgw.core.apikeys import ApiKey, RateWindow
from llmgw.tasks import cancel_and_wait
from llmgw.wire import KEYS_USAGE_SUBJECT, KeyUsage, KeyWindowUse

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

log = logging.getLogger("llmgw.edge.limits")


@dataclass(slots=True)
class _Use:
    requests: int = 0
    tokens: int = 0


class Verdict(NamedTuple):
    """Whether a request may run, and the x-ratelimit-* headers its response carries (a tuple:
    one is made per request)."""

    allowed: bool
    headers: dict[str, str]
    retry_after: float = 0.0
    exhausted: str = ""  # "requests" or "tokens" when refused


class KeyLimiter:
    def __init__(
        self,
        nc: NATS | None,
        edge_id: str,
        *,
        interval: float,
        clock: Clock | TimeSource,
        window: RateWindow | None = None,
    ) -> None:
        self._nc = nc
        self.edge_id = edge_id
        self.interval = interval
        self._clock = wall_of(clock)
        self.window = window or RateWindow()
        self._index = self.window.index(self._clock())
        self._mine: dict[str, _Use] = {}
        self._others: dict[str, dict[str, KeyWindowUse]] = {}  # edge -> key id -> use
        self._dirty = False
        self._reset_tenths = -1
        self._reset_formatted = ""
        self._task: asyncio.Task[None] | None = None
        self._sub: Subscription | None = None

    async def start(self) -> None:
        if self._nc is None:
            return
        self._sub = await self._nc.subscribe(KEYS_USAGE_SUBJECT, cb=self._on_usage)
        self._task = asyncio.create_task(self._publish_loop(), name="key-usage")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    # ---- the request path -----------------------------------------------------------------------

    def _turn(self, now: float) -> None:
        index = self.window.index(now)
        if index != self._index:
            self._index = index
            self._mine = {}
            self._others = {}
            self._dirty = False

    def used(self, key_id: str, now: float) -> tuple[int, int]:
        """(requests, tokens) of the key in the current window, over every edge heard from."""
        self._turn(now)
        mine = self._mine.get(key_id)
        requests = mine.requests if mine else 0
        tokens = mine.tokens if mine else 0
        for use in self._others.values():
            theirs = use.get(key_id)
            if theirs is not None:
                requests += theirs.requests
                tokens += theirs.tokens
        return requests, tokens

    def admit(self, key: ApiKey) -> Verdict:
        """Count one request of `key` if its rpm and tpm allow it; the headers either way."""
        if key.rpm is None and key.tpm is None:  # counted for `llmgw keys usage`, no headers
            self._turn(self._clock())
            self._count(key.key_id)
            return _UNLIMITED
        now = self._clock()
        requests, tokens = self.used(key.key_id, now)
        reset = self.window.reset_in(now)
        reset_text = self._reset_text(reset)
        refused = ""
        if key.rpm is not None and requests >= key.rpm:
            refused = "requests"
        elif key.tpm is not None and tokens >= key.tpm:
            refused = "tokens"
        if not refused:
            self._count(key.key_id)
            requests += 1
        headers = {}
        if key.rpm is not None:
            headers["x-ratelimit-limit-requests"] = str(key.rpm)
            headers["x-ratelimit-remaining-requests"] = str(max(0, key.rpm - requests))
            headers["x-ratelimit-reset-requests"] = reset_text
        if key.tpm is not None:
            headers["x-ratelimit-limit-tokens"] = str(key.tpm)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, key.tpm - tokens))
            headers["x-ratelimit-reset-tokens"] = reset_text
        return Verdict(not refused, headers, reset if refused else 0.0, refused)

    def _reset_text(self, reset: float) -> str:
        """`_duration(reset)`, formatted once per tenth of a second (it is on every response)."""
        tenths = int(reset * 10)
        if tenths != self._reset_tenths:
            self._reset_tenths, self._reset_formatted = tenths, _duration(tenths / 10)
        return self._reset_formatted

    def _count(self, key_id: str) -> None:
        use = self._mine.get(key_id)
        if use is None:
            use = self._mine[key_id] = _Use()
        use.requests += 1
        self._dirty = True

    def hold_tokens(self, key_id: str, tokens: int) -> int:
        """Count a request's estimated tokens at once (so a burst sees them before the request
        ends); the window they count in, for `release_tokens`."""
        self._turn(self._clock())
        if tokens > 0:
            self._mine.setdefault(key_id, _Use()).tokens += tokens
            self._dirty = True
        return self._index

    def release_tokens(self, key_id: str, tokens: int, window: int) -> None:
        """The request of `hold_tokens` ended: its estimate no longer counts (its real tokens
        were added by `add_tokens`). Nothing to do once the window has turned."""
        self._turn(self._clock())
        use = self._mine.get(key_id)
        if window != self._index or use is None or tokens <= 0:
            return
        use.tokens = max(0, use.tokens - tokens)
        self._dirty = True

    def add_tokens(self, key_id: str, tokens: int) -> None:
        """Tokens of an ended request of `key_id` (from its usage), in the current window."""
        if tokens <= 0:
            return
        self._turn(self._clock())
        self._mine.setdefault(key_id, _Use()).tokens += tokens
        self._dirty = True

    # ---- gossip ---------------------------------------------------------------------------------

    async def _publish_loop(self) -> None:
        quiet = 0.0  # seconds since the last publication
        while True:
            await asyncio.sleep(self.interval)
            quiet += self.interval
            self._turn(self._clock())
            # On change, and at least every second while this window has use (a listener that
            # joins late, `llmgw keys usage`, hears every edge's totals within a second).
            due = self._dirty or (self._mine and quiet >= _REFRESH)
            if not due or self._nc is None:
                continue
            quiet = 0.0
            self._dirty = False
            message = KeyUsage(
                edge=self.edge_id,
                window=self._index,
                keys={
                    k: KeyWindowUse(requests=u.requests, tokens=u.tokens)
                    for k, u in self._mine.items()
                },
            )
            try:
                await self._nc.publish(KEYS_USAGE_SUBJECT, message.model_dump_json().encode())
            except Exception as exc:
                self._dirty = True
                log.debug("key usage not published: %s", exc)

    async def _on_usage(self, msg: Msg) -> None:
        try:
            usage = KeyUsage.model_validate_json(msg.data)
        except ValueError:
            return
        if usage.edge == self.edge_id:
            return
        self._turn(self._clock())
        if usage.window == self._index:
            self._others[usage.edge] = usage.keys


_UNLIMITED = Verdict(True, {})
_REFRESH = 1.0  # seconds between publications of unchanged totals


def _duration(seconds: float) -> str:
    """OpenAI's reset format: "1s", "6m0s", "59.4s"."""
    if seconds >= 60:
        minutes, rest = divmod(int(seconds), 60)
        return f"{minutes}m{rest}s"
    return f"{seconds:.1f}s".replace(".0s", "s")
