"""`llmgw keys`: API keys in the live key bucket (docs/keys.md).

    llmgw keys create --tenant T [--models m,glob*] [--bands a,b] [--default-band B]
                      [--band-header] [--max-parallel N] [--rpm N] [--tpm N]
                      [--expires 30d] [--label k=v] [--disabled]
    llmgw keys list | show ID | update ID [same options] | revoke ID
    llmgw keys seed FILE        # create or update the keys a YAML file lists, with their secrets
    llmgw keys usage            # requests and tokens per key this minute, from every edge,
                                # and each key's spend today (the spend bucket)

The secret is printed once, by `create`; the bucket keeps only its SHA-256 digest. `list` shows
ids and prefixes, never secrets. An ID is the key id `create` printed, or its first 6+ digits.
With `nats.url: embedded` (the local config) the CLI talks to `llmgw up`'s server on
127.0.0.1:`nats.embedded_port`.

Exit codes: 0 done; 1 NATS unreachable, or no such key; 2 bad arguments or config.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import sys
import time
from typing import Any

import nats
import yaml

from llmgw import natsconn
from llmgw.config import Config, parse_duration
from llmgw.core.apikeys import ApiKey, ApiKeyError, RateWindow, digest_of, new_secret
from llmgw.core.spend import format_money, period_of
from llmgw.runtime import load_tool_config
from llmgw.state.apikeys import KeyBucket, KeyNotFound, open_key_bucket
from llmgw.wire import KEYS_USAGE_SUBJECT, KeyUsage

__all__ = ["create_key", "key_from_spec", "run"]


def run(args: argparse.Namespace) -> int:
    config = load_tool_config(args)
    refusals = natsconn.Refusals()
    try:
        return asyncio.run(_run(config, args, refusals))
    except ApiKeyError as exc:
        print(f"llmgw keys: {exc}", file=sys.stderr)
        return 2
    except KeyNotFound as exc:
        print(f"llmgw keys: {exc.args[0]}", file=sys.stderr)
        return 1
    except natsconn.UNREACHABLE as exc:
        return refusals.report("keys", exc)


async def _run(config: Config, args: argparse.Namespace, refusals: natsconn.Refusals) -> int:
    cfg = config.nats
    if cfg.is_embedded:
        cfg = cfg.model_copy(update={"url": f"nats://127.0.0.1:{cfg.embedded_port}"})
    options: dict[str, Any] = natsconn.connect_options(cfg, "llmgw-keys")
    options.update(max_reconnect_attempts=1, reconnect_time_wait=0.1, error_cb=refusals.record)
    async with asyncio.timeout(cfg.connect_timeout * 2 + 5):
        nc = await natsconn.open_connection(**options)
    try:
        bucket = await open_key_bucket(nc, config)
        if args.keys_command == "usage":
            listen = args.listen or max(1.5, 3 * config.auth.usage_interval)
            return await _usage(
                nc, bucket, listen, as_json=bool(args.json), spend_bucket=config.spend.bucket
            )
        return await _act(bucket, args, now=time.time())
    finally:
        await nc.close()


async def _act(bucket: KeyBucket, args: argparse.Namespace, *, now: float) -> int:
    command = args.keys_command
    as_json = bool(args.json)
    if command == "create":
        secret, key = create_key(_changes(args, now), now=now)
        await bucket.create(key)
        if as_json:
            print(json.dumps({"secret": secret, **_public(key)}))
        else:
            print(f"created key {key.key_id} for tenant {key.tenant}")
            print(f"secret (shown once, store it now): {secret}")
        return 0
    if command == "list":
        keys = sorted(await bucket.list(), key=lambda k: (k.tenant, k.created_at))
        if as_json:
            print(json.dumps([_public(k) for k in keys]))
        else:
            print(f"{'ID':16}  {'PREFIX':16}  {'TENANT':16}  {'ENABLED':7}  MODELS / LIMITS")
            for k in keys:
                print(
                    f"{k.key_id:16}  {k.prefix + '…':16}  {k.tenant:16}  {k.enabled!s:7}  "
                    f"{','.join(k.models)} {_limits(k)}"
                )
        return 0
    if command == "show":
        key, _ = await bucket.find(args.id)
        print(json.dumps(_public(key), indent=None if as_json else 2))
        return 0
    if command == "update":
        changes = _changes(args, now)
        key = await bucket.update(args.id, lambda k: k.with_changes(**changes))
        print(json.dumps(_public(key)) if as_json else f"updated key {key.key_id}")
        return 0
    if command == "revoke":
        key = await bucket.revoke(args.id)
        print(json.dumps(_public(key)) if as_json else f"revoked key {key.key_id}")
        return 0
    if command == "seed":
        seeded = [await _seed_one(bucket, spec, now) for spec in _seed_specs(args.file)]
        print(json.dumps(seeded) if as_json else f"seeded {len(seeded)} keys")
        return 0
    raise ApiKeyError(f"unknown action {command!r}")


async def _usage(
    nc: Any, bucket: KeyBucket, listen: float, *, as_json: bool, spend_bucket: str = ""
) -> int:
    """Every key's requests and tokens in the current rate window, summed over the edges that
    reported during `listen` seconds (edges report while a key has use this minute), and what
    each key spent today (UTC), from the spend bucket."""
    latest: dict[str, KeyUsage] = {}

    async def keep(msg: Any) -> None:
        with contextlib.suppress(ValueError):
            usage = KeyUsage.model_validate_json(msg.data)
            latest[usage.edge] = usage

    sub = await nc.subscribe(KEYS_USAGE_SUBJECT, cb=keep)
    await asyncio.sleep(listen)  # a listening window: the edges publish on their own schedule
    await sub.unsubscribe()
    window = RateWindow().index(time.time())
    totals: dict[str, list[int]] = {}
    for usage in latest.values():
        if usage.window != window:
            continue
        for key_id, use in usage.keys.items():
            total = totals.setdefault(key_id, [0, 0])
            total[0] += use.requests
            total[1] += use.tokens
    today = await _spend_today(nc, spend_bucket) if spend_bucket else {}
    for key_id in today:
        totals.setdefault(key_id, [0, 0])
    keys = {k.key_id: k for k in await bucket.list()}
    rows = [
        {
            "id": key_id,
            "tenant": keys[key_id].tenant if key_id in keys else None,
            "requests": requests,
            "rpm": keys[key_id].rpm if key_id in keys else None,
            "tokens": tokens,
            "tpm": keys[key_id].tpm if key_id in keys else None,
            "spend_today": format_money(today.get(key_id, 0), 6),
        }
        for key_id, (requests, tokens) in sorted(totals.items())
    ]
    if as_json:
        print(json.dumps({"edges": len(latest), "keys": rows}))
        return 0
    print(f"this minute, from {len(latest)} edges (keys with rpm or tpm):")
    print(
        f"{'ID':16}  {'TENANT':16}  {'REQUESTS':>10}  {'RPM':>8}  {'TOKENS':>10}  {'TPM':>10}"
        f"  {'SPENT TODAY':>12}"
    )
    for row in rows:
        print(
            f"{row['id']:16}  {row['tenant'] or '?':16}  {row['requests']:>10}  "
            f"{row['rpm'] or '-':>8}  {row['tokens']:>10}  {row['tpm'] or '-':>10}"
            f"  {format_money(today.get(str(row['id']), 0)):>12}"
        )
    return 0


async def _spend_today(nc: Any, name: str) -> dict[str, int]:
    """Picos per key id spent today (UTC), best effort: {} without a spend bucket."""
    from llmgw.services.spend.report import open_spend_reader, read_spend

    try:
        async with asyncio.timeout(5):
            spend = await open_spend_reader(nc.jetstream(), name)
            if spend is None:
                return {}
            record = await read_spend(spend)
    except (TimeoutError, nats.errors.Error):
        return {}
    day = record.days.get(period_of(time.time()))
    if day is None:
        return {}
    return {group[0]: row.picos for group, row in day.grouped("key").items() if group[0]}


def create_key(
    changes: dict[str, Any], *, now: float, secret: str | None = None
) -> tuple[str, ApiKey]:
    """A new key (random secret unless given) and its record; the caller stores the record."""
    secret = secret or new_secret(secrets.token_bytes(24))
    key = ApiKey(
        digest=digest_of(secret), prefix=secret[:15], created_at=now, **{"tenant": "", **changes}
    )
    return secret, key


def _changes(args: argparse.Namespace, now: float) -> dict[str, Any]:
    """The ApiKey fields the options set (None: not given)."""
    changes: dict[str, Any] = {}
    if args.tenant is not None:
        changes["tenant"] = args.tenant
    if args.models is not None:
        changes["models"] = _split(args.models)
    if args.bands is not None:
        changes["bands"] = _split(args.bands)
    if args.default_band is not None:
        changes["default_band"] = args.default_band
    if args.band_header is not None:
        changes["band_header"] = args.band_header
    for option, name in (("max_parallel", "max_parallel_requests"), ("rpm", "rpm"), ("tpm", "tpm")):
        value = getattr(args, option)
        if value is not None:
            changes[name] = value if value > 0 else None  # 0 removes the limit
    for option in ("budget_period", "max_spend", "max_overflow_spend"):
        value = getattr(args, option, None)
        if value is not None:
            changes[option] = None if value == "none" else value
    if args.expires is not None:
        changes["expires_at"] = _expiry(args.expires, now)
    if args.label:
        changes["labels"] = dict(_label(item) for item in args.label)
    if args.disabled:
        changes["enabled"] = False
    if getattr(args, "enabled", None):
        changes["enabled"] = True
    return changes


def key_from_spec(spec: dict[str, Any], now: float) -> tuple[str, ApiKey]:
    """A seed file entry (`secret` or `secret_env`, plus ApiKey fields) as (secret, key)."""
    spec = dict(spec)
    secret = spec.pop("secret", None)
    env = spec.pop("secret_env", None)
    if secret is None and env is not None:
        secret = os.environ.get(env)
        if not secret:
            raise ApiKeyError(f"secret_env: environment variable {env} is not set")
    if not isinstance(secret, str) or len(secret) < 20:
        raise ApiKeyError("secret: every seeded key needs a secret of at least 20 characters")
    known = set(ApiKey.__dataclass_fields__) - {"digest", "prefix", "created_at"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ApiKeyError(f"{unknown[0]}: unknown field of a seeded key")
    if isinstance(spec.get("expires_at"), str):
        spec["expires_at"] = _expiry(spec["expires_at"], now)
    for name in ("models", "bands"):
        if name in spec:
            spec[name] = tuple(spec[name])
    return create_key(spec, now=now, secret=secret)


def _seed_specs(path: str) -> list[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as exc:
        raise ApiKeyError(f"{path}: {exc.strerror}") from None
    specs = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
        raise ApiKeyError(f"{path}: expected a mapping with a list of keys under `keys`")
    return specs


async def _seed_one(bucket: KeyBucket, spec: dict[str, Any], now: float) -> dict[str, Any]:
    _, key = key_from_spec(spec, now)
    await bucket.put(key)
    return _public(key)


def _public(key: ApiKey) -> dict[str, Any]:
    """What the CLI shows of a key: everything but the digest."""
    shown = key.as_dict()
    shown.pop("digest")
    shown.pop("v")
    return {"id": key.key_id, **shown}


def _limits(key: ApiKey) -> str:
    parts = [
        f"{name}={value}"
        for name, value in (
            ("parallel", key.max_parallel_requests),
            ("rpm", key.rpm),
            ("tpm", key.tpm),
            ("max_spend", key.max_spend),
            ("max_overflow_spend", key.max_overflow_spend),
        )
        if value is not None
    ]
    if key.budget_period is not None and (key.max_spend or key.max_overflow_spend):
        parts.append(f"budget={key.budget_period}")
    return " ".join(parts)


def _split(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _label(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep:
        raise ApiKeyError(f"--label: expected K=V, got {item!r}")
    return name.strip(), value.strip()


def _expiry(value: str, now: float) -> float | None:
    value = value.strip()
    if value == "never":
        return None
    try:
        return float(value)
    except ValueError:
        pass
    days = value[:-1] if value.endswith("d") else None
    try:
        seconds = float(days) * 86400 if days is not None else parse_duration(value)
    except ValueError as exc:
        raise ApiKeyError(f"expires: {exc}") from None
    return now + seconds
