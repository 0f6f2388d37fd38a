"""The `fleet` section: where the live fleet (endpoints, and the applied config) is kept.

The config file's `endpoints` seed the fleet bucket; from then on the bucket is the truth every
service follows (docs/architecture.md, "Live fleet"; docs/adr/0005-live-fleet.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from llmgw.config.common import StrictModel
from llmgw.config.durations import PositiveDuration

if TYPE_CHECKING:
    from llmgw.config.schema import Config


class FleetConfig(StrictModel):
    # The JetStream KV bucket (file storage) of the live fleet: one key per endpoint, the
    # applied config document, and the seed marks of the config files that seeded it.
    # Unset: `router.load_bucket` + "_fleet" (llmgw_load_fleet), so a gateway that names its
    # own load bucket gets its own fleet too.
    bucket: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]+$")
    # Seed the bucket from this file's `endpoints` (once per distinct list: a restart with the
    # same file does not bring back endpoints removed since). Off: the bucket alone decides.
    seed: bool = True
    # How long `llmgw endpoints remove` (and the admin API) waits for a draining endpoint's
    # leases to end before it refuses; `--force` removes at once.
    drain_timeout: PositiveDuration = 60.0


def fleet_bucket(config: Config) -> str:
    """The fleet bucket's name (`fleet.bucket`, else named after `router.load_bucket`)."""
    return config.fleet.bucket or f"{config.router.load_bucket}_fleet"
