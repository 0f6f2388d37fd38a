"""The live fleet's decisions: which endpoints take new work, what an operator may change, when.

An endpoint of the live fleet is in one of two states:

- ``active``: placement may send it new work;
- ``draining``: no new work; requests already on it run to their end (their leases are never
  revoked) and a session whose home replica it is moves on its next request. It is removed
  once no lease is left on it (or by force).

Every function here is pure: the caller passes what it read (the fleet's records, the leases
counted by the admission instances, how long it has not heard from an endpoint) and acts on the
answer.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "Discovered",
    "EndpointState",
    "FleetView",
    "HeartbeatVerdict",
    "RemoveVerdict",
    "ServedModel",
    "heard",
    "heartbeat_verdict",
    "match_served",
    "placeable",
    "remove_verdict",
    "seed_missing",
    "served_change",
    "served_models",
    "slice_endpoints",
]


class EndpointState(enum.StrEnum):
    ACTIVE = "active"
    DRAINING = "draining"


@dataclass(frozen=True, slots=True)
class FleetView:
    """What the fleet holds, as placement needs it: every endpoint id with its state."""

    states: Mapping[str, EndpointState]
    revision: int = 0

    @property
    def draining(self) -> frozenset[str]:
        return frozenset(e for e, s in self.states.items() if s is EndpointState.DRAINING)


def placeable(view: FleetView, endpoint_ids: Iterable[str]) -> list[str]:
    """The endpoints, in the given order, that may take new work: active ones only."""
    return [e for e in endpoint_ids if view.states.get(e) is EndpointState.ACTIVE]


class RemoveVerdict(enum.StrEnum):
    REMOVE = "remove"  # draining and no lease left (or forced)
    NOT_DRAINING = "not_draining"  # drain it first: removing an active endpoint cuts its work
    LEASES_LEFT = "leases_left"  # still running requests: wait, or force
    UNKNOWN = "unknown"  # no such endpoint


def remove_verdict(
    state: EndpointState | None, leases: int, *, force: bool = False
) -> RemoveVerdict:
    """Whether an endpoint may be removed now. A forced removal skips the wait, never the
    accounting: leases on a removed endpoint still end and are released by id."""
    if state is None:
        return RemoveVerdict.UNKNOWN
    if force:
        return RemoveVerdict.REMOVE
    if state is not EndpointState.DRAINING:
        return RemoveVerdict.NOT_DRAINING
    if leases > 0:
        return RemoveVerdict.LEASES_LEFT
    return RemoveVerdict.REMOVE


def seed_missing(configured: Iterable[str], live: Iterable[str]) -> list[str]:
    """The configured endpoint ids the fleet lacks, in the configured order (a seeding writes
    them; the fleet's own records win for the others)."""
    present = set(live)
    return [e for e in configured if e not in present]


class HeartbeatVerdict(enum.StrEnum):
    KEEP = "keep"
    DRAIN = "drain"  # silent for its ttl: no new work, what runs on it ends
    REMOVE = "remove"  # silent for twice its ttl, drained, no lease left


def heard(
    previous: Mapping[str, tuple[Hashable, float]], tokens: Mapping[str, Hashable], now: float
) -> dict[str, tuple[Hashable, float]]:
    """When each endpoint was last heard from, on the caller's own clock: ``{id: (token, at)}``
    where `token` is what changes with each heartbeat (the time its registrant wrote, the
    record's fields a heartbeat or a hand change writes) and `at` when the caller first saw
    that token. A new token is heard
    `now`; so is an endpoint seen for the first time (after a restart the caller knows nothing
    older: it waits a whole ttl before judging it silent). Endpoints not in `tokens` are
    forgotten."""
    return {
        endpoint: kept
        if (kept := previous.get(endpoint)) is not None and kept[0] == token
        else (token, now)
        for endpoint, token in tokens.items()
    }


def heartbeat_verdict(
    state: EndpointState, silent: float, ttl: float, leases: int | None
) -> HeartbeatVerdict:
    """What becomes of a self-registered endpoint that heartbeats every so often, `silent`
    seconds after its last heartbeat was heard: drained once silent for `ttl`, removed once
    silent for 2 x `ttl` with no lease left (`leases` None: no admission instance answered, so
    nothing is removed). The caller measures `silent` on its own clock, from when it saw the
    heartbeat change, never from a time the registrant's host wrote (hosts' clocks differ). A
    heartbeat after a drain by silence does not undrain it: the registrant registers again."""
    if silent <= ttl:
        return HeartbeatVerdict.KEEP
    if state is EndpointState.ACTIVE:
        return HeartbeatVerdict.DRAIN
    if silent > 2 * ttl and leases == 0:
        return HeartbeatVerdict.REMOVE
    return HeartbeatVerdict.KEEP


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One name an engine serves (`GET /v1/models`); `parent`: a LoRA adapter's base model."""

    id: str
    parent: str | None = None


@dataclass(frozen=True, slots=True)
class Discovered:
    """What an engine's served names mean here: our models it serves, the name each goes
    upstream under where it differs, what it serves that the config does not name, and our
    models it serves through a LoRA adapter, with the adapter's base (its `parent`)."""

    models: tuple[str, ...]
    upstream_model: Mapping[str, str]
    unmatched: tuple[ServedModel, ...]
    adapters: Mapping[str, str] = field(default_factory=dict)


def served_models(body: object) -> list[ServedModel]:
    """The served names in an OpenAI-style model list (vLLM, SGLang, llama.cpp, TGI):
    ``{"data": [{"id": ..., "parent": ...}, ...]}``; anything else holds none."""
    data = body.get("data") if isinstance(body, Mapping) else None
    served = []
    for item in data if isinstance(data, list) else []:
        if isinstance(item, Mapping) and isinstance(item.get("id"), str) and item["id"]:
            parent = item.get("parent")
            served.append(ServedModel(item["id"], parent if isinstance(parent, str) else None))
    return served


def match_served(
    served: Iterable[ServedModel], canonical: Mapping[str, str], offered: Iterable[str]
) -> Discovered:
    """Our models among an engine's served names. A served name is one of ours when it is a
    model name or an alias (`canonical`: name or alias -> model name) of a model the provider
    offers; it goes upstream under the served name. A LoRA adapter counts like any served name
    (its own name or alias decides, not its base). First match wins; an exact model name beats
    an alias."""
    offered_list = list(offered)
    offered_set = set(offered_list)
    served_list = list(served)
    chosen: dict[str, str] = {}
    unmatched = []
    ordered = sorted(served_list, key=lambda s: canonical.get(s.id) != s.id)  # exact names first
    for model in ordered:
        ours = canonical.get(model.id)
        if ours is None or ours not in offered_set:
            unmatched.append(model)
        elif ours not in chosen:
            chosen[ours] = model.id
    models = tuple(m for m in offered_list if m in chosen)
    renames = {m: chosen[m] for m in models if chosen[m] != m}
    return Discovered(models, renames, tuple(unmatched), _adapters(models, renames, served_list))


def _adapters(
    models: Iterable[str], renames: Mapping[str, str], served: Iterable[ServedModel]
) -> dict[str, str]:
    """Of `models`, those whose served name (`renames`, else their own) is an adapter: its
    base."""
    parents = {s.id: s.parent for s in served}
    found = {}
    for model in models:
        parent = parents.get(renames.get(model, model))
        if parent is not None:
            found[model] = parent
    return found


def served_change(
    models: Iterable[str],
    upstream_model: Mapping[str, str],
    served: Iterable[ServedModel],
    canonical: Mapping[str, str],
    offered: Iterable[str],
    adapters: Mapping[str, str] | None = None,
) -> Discovered | None:
    """What an endpoint whose models came from its engine serves now, when that differs from
    `models` and `upstream_model` (the record's): the engine's served names read again
    (`match_served`). A model still served keeps the name it goes upstream under while the
    engine still lists that name and the config does not name another model by it (a rename
    given by hand stays; an alias an applied config moved to another model does not: it
    would send this model's requests to that one). The answer's `adapters` are those of the
    models it names (a change in them alone is no change). None: nothing changed, or the
    engine serves none of the provider's models now (an engine restarting, or one whose list
    is empty for a moment, keeps what it had: placement's health checks judge it), except
    that a model served through an adapter (`adapters`: the record's, model -> the adapter's
    base) whose base the engine still lists without the adapter was unloaded: it is left
    out, and with no model left the answer names none (the endpoint serves nothing of ours)."""
    served_list = list(served)
    found = match_served(served_list, canonical, offered)
    names = {s.id for s in served_list}
    current = list(models)
    if not found.models:
        adapters = adapters or {}
        gone = {
            m
            for m in current
            if m in adapters and adapters[m] in names and upstream_model.get(m, m) not in names
        }
        if not gone:
            return None
        left = tuple(m for m in current if m not in gone)
        return Discovered(
            left,
            {m: n for m, n in upstream_model.items() if m in left},
            found.unmatched,
            {m: p for m, p in adapters.items() if m in left},
        )
    renames = dict(found.upstream_model)
    for model in found.models:
        kept = upstream_model.get(model, model)  # the name it goes upstream under now
        if model in current and kept in names and canonical.get(kept, model) == model:
            if kept == model:
                renames.pop(model, None)
            else:
                renames[model] = kept
    now = Discovered(
        found.models, renames, found.unmatched, _adapters(found.models, renames, served_list)
    )
    unchanged = {m: n for m, n in upstream_model.items() if m in now.models and n != m}
    if list(now.models) == current and dict(now.upstream_model) == unchanged:
        return None
    return now


def slice_endpoints(
    slice_obj: Mapping[str, object], *, port_name: str | None, id_prefix: str
) -> dict[str, str]:
    """The engines a Kubernetes EndpointSlice (discovery.k8s.io/v1) lists as ready, by the
    endpoint id they get here: ``{id: "http://ADDRESS:PORT"}``. An endpoint counts when its
    `conditions.ready` is not false (unset means ready) and it is not terminating; its first
    address is used; the port is the one named `port_name` (else the slice's first). The id is
    `id_prefix` and the pod's name (else the address), as a slug."""
    ports = slice_obj.get("ports")
    port = None
    for entry in ports if isinstance(ports, list) else []:
        if isinstance(entry, Mapping) and (port_name is None or entry.get("name") == port_name):
            port = entry.get("port")
            break
    if not isinstance(port, int):
        return {}
    found = {}
    endpoints = slice_obj.get("endpoints")
    for endpoint in endpoints if isinstance(endpoints, list) else []:
        if not isinstance(endpoint, Mapping):
            continue
        conditions = endpoint.get("conditions")
        conditions = conditions if isinstance(conditions, Mapping) else {}
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        addresses = endpoint.get("addresses")
        if not isinstance(addresses, list) or not addresses or not isinstance(addresses[0], str):
            continue
        address = addresses[0]
        target = endpoint.get("targetRef")
        name = target.get("name") if isinstance(target, Mapping) else None
        token = _slug(name if isinstance(name, str) and name else address)
        host = f"[{address}]" if ":" in address else address
        found[_slug(f"{id_prefix}-{token}")[:64]] = f"http://{host}:{port}"
    return found


def _slug(text: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_" else "-" for c in text.lower())
    return cleaned.strip("-_") or "x"
