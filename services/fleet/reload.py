"""`llmgw up` on SIGHUP: the config file applied to the running cluster, as `llmgw config apply`
does (validated first: an invalid file is reported and nothing is stored)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmgw import natsconn
from llmgw.config import ConfigError, load_config
from llmgw.services.fleet.apply import apply_file, file_values

if TYPE_CHECKING:
    from llmgw.config import Config

__all__ = ["Reloader"]

log = logging.getLogger("llmgw.up")


class Reloader:
    """Applies `path` on every call (the SIGHUP handler); one reload at a time."""

    def __init__(
        self, path: str, config: Config, nats_url: str, say: Callable[[str], None]
    ) -> None:
        self.path = path
        self.config = config  # its NATS settings reach the cluster (a role's user with --secure)
        self.nats_url = nats_url
        self.say = say
        self._task: asyncio.Task[None] | None = None

    def __call__(self) -> None:
        if self._task is not None and not self._task.done():
            self.say("llmgw up: SIGHUP: a reload is already running")
            return
        self._task = asyncio.get_running_loop().create_task(self._reload())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _reload(self) -> None:
        try:
            await asyncio.to_thread(load_config, self.path)
            values = await asyncio.to_thread(file_values, self.path)
        except ConfigError as exc:
            self.say(f"llmgw up: SIGHUP: {self.path} is not valid, nothing applied:\n{exc}")
            return
        cfg = self.config.nats.model_copy(update={"url": self.nats_url})
        options = natsconn.connect_options(cfg, "llmgw-up-reload")
        options.update(max_reconnect_attempts=1)
        try:
            nc = await natsconn.open_connection(**options)
            try:
                applied = await apply_file(nc, self.config, values, self.path, wait=10)
            finally:
                await nc.close()
        except Exception as exc:  # NATS down: the supervisor keeps running
            self.say(f"llmgw up: SIGHUP: could not apply {self.path}: {exc!r}")
            return
        self.say(
            f"llmgw up: SIGHUP: applied {self.path} (revision {applied.revision}); "
            f"{applied.on_it} of {applied.answering} admission instances run on it"
        )
