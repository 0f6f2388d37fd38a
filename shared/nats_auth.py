"""NATS users per service role: who may publish and subscribe to what (least privilege).

One table decides it (`role_permissions`), built from the config's bucket and stream names and
the subjects of `llmgw.wire` and `llmgw.events`. `llmgw up --secure`, compose's NATS config
(`llmgw config nats-auth FILE`, checked in as deploy/nats/llmgw-auth.conf), the NATS Helm chart's
values (`--helm`, deploy/kubernetes/nats-values.yaml) and docs/keys.md ("NATS permissions") all
come from it, and tests keep the checked-in files verbatim, so they cannot drift.

Roles (`ROLES`): one per service (`edge`, `admission`, `reaper`, `scraper`) and one per
operator tool (`keys`: the only writer of the key bucket; `state`: reads the routing and load buckets;
`events`: reads the events stream, and the public subjects, events and request stats, live;
`fleet`: `llmgw endpoints`, writes the fleet bucket and asks admission how many leases each
endpoint holds). Admission and the scraper seed and follow the fleet bucket; the edge only
reads it, for the applied config (admission tells it where each request goes).
A service connects as its role with `nats.user` and `nats.password` (LLMGW_NATS__USER /
LLMGW_NATS__PASSWORD).

How JetStream maps onto subjects (what the table grants):
- A KV write is a publish on `$KV.<bucket>.<key>`: only the bucket's writers may publish there.
  The edge writes one bucket, the Responses API's stored responses (`responses.bucket`): it
  cannot write a pin, a lease or a key.
- Reading a bucket is JetStream API requests on `$JS.API.…` naming its stream `KV_<bucket>`:
  STREAM.INFO, DIRECT.GET / STREAM.MSG.GET (get), CONSUMER.CREATE / DELETE / INFO (list and
  watch), and the flow-control replies on `$JS.FC.<stream>.>` of an ordered consumer.
- Creating a bucket or stream (STREAM.CREATE / UPDATE) is granted to the services that create
  it at start, for that stream's name only.
- Replies come back on `_INBOX.>`; a responder publishes its answers there (admission answers
  several times per request: QUEUED, then the decision, so the one-reply `allow_responses`
  does not fit).

Invariant: every role's grants name subjects only; nothing grants `>` or `$JS.API.>` whole, and
no role but `keys` may publish on `$KV.<auth.bucket>.>`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmgw.config.fleet import fleet_bucket
from llmgw.events import ALL_EVENTS_SUBJECT
from llmgw.wire import (
    ADMISSION_CANCEL_SUBJECT,
    ADMISSION_FLOW_SUBJECT,
    ADMISSION_HANDOVER_PREFIX,
    ADMISSION_HEALTH_SUBJECT,
    ADMISSION_LEASES_PREFIX,
    ADMISSION_LOAD_SUBJECT,
    ADMISSION_LOAN_PREFIX,
    ADMISSION_REQUEST_PREFIX,
    ADMISSION_ROLLCALL_SUBJECT,
    ADMISSION_STATE_SUBJECT,
    BUDGET_GRANT_SUBJECT,
    BUDGET_LEND_PREFIX,
    EDGE_CONFIG_SUBJECT,
    KEYS_USAGE_SUBJECT,
    MODELS_STALE_SUBJECT,
    REQUEST_STATS_SUBJECT,
    RESPONSES_ASK_PREFIX,
    RESPONSES_DELETED_SUBJECT,
    SPEND_TOTALS_SUBJECT,
    prefix_held_subject,
    prefix_sent_subject,
)

if TYPE_CHECKING:
    from llmgw.config.schema import Config

__all__ = [
    "NATS_USERS_SECRET",
    "ROLES",
    "SERVICE_ROLES",
    "Permissions",
    "helm_values",
    "password_variable",
    "render_helm_values",
    "render_server_config",
    "role_permissions",
]

ROLES = ("edge", "admission", "reaper", "scraper", "keys", "state", "events", "fleet")
# The role each `llmgw` service connects as.
SERVICE_ROLES = {"edge": "edge", "admission": "admission", "reaper": "reaper", "scraper": "scraper"}
INBOX = "_INBOX.>"
# The Kubernetes Secret holding every role's password (key: the role), deploy/kubernetes.
NATS_USERS_SECRET = "llmgw-nats-users"
_API = "$JS.API"


@dataclass(frozen=True, slots=True)
class Permissions:
    """What one role may publish and subscribe to (nats-server `allow` lists)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def _read_stream(stream: str) -> list[str]:
    """Get, list and watch a stream (KV bucket `KV_<name>` or the events stream)."""
    return [
        f"{_API}.STREAM.INFO.{stream}",
        f"{_API}.DIRECT.GET.{stream}",
        f"{_API}.DIRECT.GET.{stream}.>",
        f"{_API}.STREAM.MSG.GET.{stream}",
        f"{_API}.CONSUMER.CREATE.{stream}",
        f"{_API}.CONSUMER.CREATE.{stream}.>",
        f"{_API}.CONSUMER.INFO.{stream}.*",
        f"{_API}.CONSUMER.DELETE.{stream}.*",
        f"$JS.FC.{stream}.>",
    ]


def _create_stream(stream: str) -> list[str]:
    return [f"{_API}.STREAM.CREATE.{stream}", f"{_API}.STREAM.UPDATE.{stream}"]


def _read_bucket(bucket: str) -> list[str]:
    return _read_stream(f"KV_{bucket}")


def _own_bucket(bucket: str) -> list[str]:
    """Create, read and write the bucket `bucket`."""
    return [*_create_stream(f"KV_{bucket}"), *_read_bucket(bucket), f"$KV.{bucket}.>"]


def _ensure_stream(stream: str) -> list[str]:
    """Create or update the stream `stream` at start (`llmgw.state.streams.ensure_stream`)."""
    return [*_create_stream(stream), f"{_API}.STREAM.INFO.{stream}"]


def _events_stream(config: Config) -> list[str]:
    """Create the events stream at start and publish events (a service's part)."""
    return _ensure_stream(config.events.stream)


def role_permissions(config: Config) -> dict[str, Permissions]:
    """Every role's grants for `config`'s buckets and stream (the module's one table)."""
    routing = config.pinning.bucket
    load = config.router.load_bucket
    keys = config.auth.bucket
    events = config.events.stream
    spend = config.spend.bucket
    fleet = fleet_bucket(config)
    table = {
        "edge": Permissions(
            publish=(
                f"{ADMISSION_REQUEST_PREFIX}*",
                f"{ADMISSION_LEASES_PREFIX}*",
                ADMISSION_HEALTH_SUBJECT,
                ADMISSION_CANCEL_SUBJECT,
                REQUEST_STATS_SUBJECT,
                KEYS_USAGE_SUBJECT,
                SPEND_TOTALS_SUBJECT,  # its spend totals; admission writes them down
                BUDGET_GRANT_SUBJECT,  # budget grants: admission writes the account
                f"{BUDGET_LEND_PREFIX}*",  # asks another edge to lend budget it holds idle
                MODELS_STALE_SUBJECT,  # an engine's 404 for a model it lists: read its list again
                INBOX,  # answers to admission's roll calls, and to loans asked of it
                *_read_bucket(keys),  # the key mirror's watch: read only
                *_read_bucket(fleet),  # the applied config's watch: read only
                *_own_bucket(config.responses.bucket),  # the Responses API's stored responses
                f"{RESPONSES_ASK_PREFIX}*",  # asks the edge that wrote a response for it
                RESPONSES_DELETED_SUBJECT,  # tells every edge a stored response is deleted
            ),
            # roll calls, and config apply asking which revision it runs on
            subscribe=(
                INBOX,
                ADMISSION_ROLLCALL_SUBJECT,
                KEYS_USAGE_SUBJECT,
                EDGE_CONFIG_SUBJECT,
                f"{BUDGET_LEND_PREFIX}*",  # budget loans other edges ask of this one
                f"{RESPONSES_ASK_PREFIX}*",  # the responses it wrote, asked by other edges
                RESPONSES_DELETED_SUBJECT,
            ),
        ),
        "admission": Permissions(
            publish=(
                INBOX,  # decisions, renewals' and handovers' answers, health and state
                f"{ADMISSION_HANDOVER_PREFIX}*",
                f"{ADMISSION_LOAN_PREFIX}*",
                ADMISSION_ROLLCALL_SUBJECT,
                ADMISSION_FLOW_SUBJECT,
                ADMISSION_LOAD_SUBJECT,
                ALL_EVENTS_SUBJECT,
                *_own_bucket(routing),
                *_create_stream(f"KV_{load}"),  # whoever of admission and scraper starts first
                *_read_bucket(load),
                *_own_bucket(fleet),  # seeds and follows it; the admin API writes it
                *_events_stream(config),
                *_own_bucket(spend),  # the edges' spend totals, written down
                # Cache-aware placement: its placements on the prefix stream, which it creates
                # (as the scraper does) and reads back from the start (an ordered consumer).
                prefix_sent_subject(config.prefix_stream, "*"),
                *_create_stream(config.prefix_stream),
                *_read_stream(config.prefix_stream),
            ),
            subscribe=(
                INBOX,
                f"{ADMISSION_REQUEST_PREFIX}*",
                f"{ADMISSION_LEASES_PREFIX}*",
                f"{ADMISSION_HANDOVER_PREFIX}*",
                f"{ADMISSION_LOAN_PREFIX}*",
                ADMISSION_HEALTH_SUBJECT,
                ADMISSION_STATE_SUBJECT,
                ADMISSION_CANCEL_SUBJECT,
                ADMISSION_FLOW_SUBJECT,
                ADMISSION_LOAD_SUBJECT,
                REQUEST_STATS_SUBJECT,
                SPEND_TOTALS_SUBJECT,
                BUDGET_GRANT_SUBJECT,
            ),
        ),
        "reaper": Permissions(
            publish=(
                INBOX,
                ALL_EVENTS_SUBJECT,
                *_own_bucket(routing),
                # Registered endpoints that stopped heartbeating: drained, then removed once
                # no admission instance holds a lease on them (a state request says).
                *_own_bucket(fleet),
                ADMISSION_STATE_SUBJECT,
                *_events_stream(config),
            ),
            # The edges' notices of engines that no longer serve a model they list.
            subscribe=(INBOX, MODELS_STALE_SUBJECT),
        ),
        "scraper": Permissions(
            publish=(
                INBOX,
                ALL_EVENTS_SUBJECT,
                *_own_bucket(load),
                *_own_bucket(fleet),  # seeds and follows it
                *_events_stream(config),
                # Engines' KV cache events, republished into the prefix stream (acked on
                # _INBOX); it creates the stream when it starts first.
                prefix_held_subject(config.prefix_stream, "*"),
                *_ensure_stream(config.prefix_stream),
            ),
            subscribe=(INBOX,),
        ),
        "keys": Permissions(
            # Reads the spend bucket: `llmgw keys usage` shows each key's spend today.
            publish=(*_own_bucket(keys), *_read_bucket(spend)),
            subscribe=(INBOX, KEYS_USAGE_SUBJECT),
        ),
        "state": Permissions(
            # $JS.API.INFO: account usage (read only); `llmgw up` probes readiness with it.
            # Reads the load bucket too: each endpoint's latest scraper report (its dialect).
            publish=(
                ADMISSION_STATE_SUBJECT,
                f"{_API}.INFO",
                *_read_bucket(routing),
                *_read_bucket(load),
                *_read_bucket(spend),  # `llmgw spend`
            ),
            subscribe=(INBOX,),
        ),
        "events": Permissions(
            publish=(*_read_stream(events), f"{_API}.CONSUMER.MSG.NEXT.{events}.*"),
            # The public subjects, live: a reader of usage and cost (request stats) or events.
            subscribe=(INBOX, ALL_EVENTS_SUBJECT, REQUEST_STATS_SUBJECT),
        ),
        "fleet": Permissions(
            publish=(ADMISSION_STATE_SUBJECT, EDGE_CONFIG_SUBJECT, *_own_bucket(fleet)),
            subscribe=(INBOX,),
        ),
    }
    return {role: table[role] for role in ROLES}


def password_variable(role: str) -> str:
    """The environment variable a generated config reads `role`'s password from."""
    return f"LLMGW_NATS_PASSWORD_{role.upper()}"


class _Var(str):
    """A nats-server config variable (`$NAME`, resolved from the environment): unquoted."""


def _value(value: object, indent: str) -> str:
    if isinstance(value, _Var):
        return f"${value}"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        inner = indent + "  "
        items = ",\n".join(inner + _value(item, inner) for item in value)
        return f"[\n{items}\n{indent}]"
    if isinstance(value, Mapping):
        inner = indent + "  "
        items = "\n".join(f"{inner}{key}: {_value(item, inner)}" for key, item in value.items())
        return f"{{\n{items}\n{indent}}}"
    raise TypeError(f"cannot render {value!r}")


def _users(config: Config, password_of: Callable[[str], object]) -> list[dict[str, object]]:
    """The nats-server `users` list, each role's password as `password_of(role)` gives it."""
    return [
        {
            "user": role,
            "password": password_of(role),
            "permissions": {
                "publish": {"allow": list(grants.publish)},
                "subscribe": {"allow": list(grants.subscribe)},
            },
        }
        for role, grants in role_permissions(config).items()
    ]


def _header(command: str, what: str = "nats-server authorization for llmgw") -> str:
    return (
        f"# {what}: one user per service role (llmgw.nats_auth).\n"
        f"# Generated by `{command}`; do not edit (docs/keys.md, NATS permissions).\n"
    )


def render_server_config(config: Config, passwords: Mapping[str, str] | None = None) -> str:
    """The `authorization` block of a nats-server config: one user per role.

    `passwords` maps a role to its password; without it (or for a role it leaves out) the
    password is the variable `$LLMGW_NATS_PASSWORD_<ROLE>`, which nats-server reads from its
    environment (compose, Kubernetes: the secret stays out of the file).
    """
    given = passwords or {}

    def password_of(role: str) -> object:
        return given[role] if role in given else _Var(password_variable(role))

    users = _users(config, password_of)
    return (
        _header("llmgw config nats-auth FILE")
        + "authorization "
        + _value({"users": users}, "")
        + "\n"
    )


def helm_values(config: Config, secret: str = NATS_USERS_SECRET) -> dict[str, object]:
    """Values of the official NATS Helm chart: a three-node JetStream cluster with the users.

    The chart writes `<< $NAME >>` unquoted (a variable nats-server reads from its environment),
    and the passwords reach that environment from the Secret `secret`, one key per role: the
    same Secret the llmgw Deployments read their own role's password from.
    """
    users = _users(config, lambda role: f"<< ${password_variable(role)} >>")
    env = {
        password_variable(role): {"valueFrom": {"secretKeyRef": {"name": secret, "key": role}}}
        for role in ROLES
    }
    return {
        "config": {
            "cluster": {"enabled": True, "replicas": 3},
            "jetstream": {"enabled": True},
            "merge": {"authorization": {"users": users}},
        },
        "container": {"env": env},
    }


def render_helm_values(config: Config) -> str:
    import yaml

    values: str = yaml.safe_dump(helm_values(config), sort_keys=False, width=100)
    what = "The official NATS Helm chart's values for llmgw: 3 JetStream nodes"
    return _header("llmgw config nats-auth --helm FILE", what) + values


def run(args: object) -> int:
    """`llmgw config nats-auth [--helm] FILE`: the authorization block for FILE's buckets (or
    the NATS Helm chart's values with it), on stdout.

    Passwords are `$LLMGW_NATS_PASSWORD_<ROLE>` variables: nats-server reads them from its
    environment, so the output holds no secret and may be checked in.
    """
    from llmgw.runtime import load_or_exit

    config = load_or_exit(str(args.file))  # type: ignore[attr-defined]
    helm = bool(getattr(args, "helm", False))
    sys.stdout.write(render_helm_values(config) if helm else render_server_config(config))
    return 0
