"""The development key `llmgw up` creates at start when `auth.mode` is keys.

So the quickstart works as written: the ready line prints the key, and the README's examples
read it from ``OPENAI_API_KEY``. One development key at a time: the ones earlier runs left in a
persistent store are revoked first (they carry the label ``created-by: llmgw-up``). Its tenant
is ``dev``, it may use every model and choose its band with the band header, and has no limits.
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING

from llmgw import natsconn
from llmgw.core.apikeys import ApiKey, digest_of, new_secret
from llmgw.state.apikeys import open_key_bucket

if TYPE_CHECKING:
    from llmgw.config import Config

__all__ = ["DEV_LABEL", "create_dev_key"]

DEV_LABEL = ("created-by", "llmgw-up")
DEV_TENANT = "dev"


async def create_dev_key(config: Config, nats_url: str, secret: str | None = None) -> str:
    """Store a development key (random unless `secret` is given) and return its secret."""
    secret = secret or new_secret(secrets.token_bytes(24))
    options = natsconn.connect_options(config.nats.model_copy(update={"url": nats_url}), "llmgw-up")
    nc = await natsconn.open_connection(**options)
    try:
        bucket = await open_key_bucket(nc, config)
        for old in await bucket.list():
            if old.labels.get(DEV_LABEL[0]) == DEV_LABEL[1]:
                await bucket.revoke(old.key_id)
        await bucket.put(
            ApiKey(
                digest=digest_of(secret),
                tenant=DEV_TENANT,
                prefix=secret[:15],
                band_header=True,
                labels=dict([DEV_LABEL]),
                created_at=time.time(),
            )
        )
    finally:
        await nc.close()
    return secret
