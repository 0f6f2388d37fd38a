"""Versioned wire messages and the NATS subjects they travel on.

Every message carries `v` (the schema version, 2 since admission at memory speed). A receiver
rejects a version it does not know instead of guessing, and ignores fields it does not know.
Core values travel as themselves: a lease is `llmgw.core.ledger.LeaseRecord`, a shard's state
`llmgw.core.ledger.ShardState`, a refusal `llmgw.core.outcomes.Refusal`; pydantic is the one
codec (no mirror classes, no JSON inside JSON). Request bodies never cross NATS: only a few
hundred bytes of metadata do. docs/architecture.md lists the subjects; the internal ones
(admission requests, leases, gossip) are not a public interface, the events and request
stats are.
"""

from __future__ import annotations

import enum
import functools
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from llmgw.core.ledger import LeaseRecord, ShardState
from llmgw.core.outcomes import Refusal

WIRE_VERSION = 2

# ---- subjects: one vocabulary, `llmgw.v1.<service>.<verb>[.<token>]` -------------------------

# Edge -> the owner of a shard (request/reply): may this request run now, and where?
ADMISSION_REQUEST_PREFIX = "llmgw.v1.admission.request."
# Edge -> the owner of a shard (request/reply): the edge's complete list of its live leases there.
ADMISSION_LEASES_PREFIX = "llmgw.v1.admission.leases."
# Admission instance -> one instance (request/reply): a shard handed over with its state.
ADMISSION_HANDOVER_PREFIX = "llmgw.v1.admission.handover."
# Admission instance -> one instance (request/reply): lend me quota of a pair you hold idle.
ADMISSION_LOAN_PREFIX = "llmgw.v1.admission.loan."
# A new shard owner -> every edge (request, many replies): which leases do you hold in these shards?
ADMISSION_ROLLCALL_SUBJECT = "llmgw.v1.admission.rollcall"
# Request/reply, every instance answers: liveness, and what it holds (`llmgw state`).
ADMISSION_HEALTH_SUBJECT = "llmgw.v1.admission.health"
ADMISSION_STATE_SUBJECT = "llmgw.v1.admission.state"
# Request/reply, every edge answers: the applied config's revision it runs on (config apply).
EDGE_CONFIG_SUBJECT = "llmgw.v1.edge.config"
# Edge -> every admission instance: the client of a queued request has gone.
ADMISSION_CANCEL_SUBJECT = "llmgw.v1.admission.cancel"
# Admission instance -> the others: its queue depths, and its inflight per endpoint.
ADMISSION_FLOW_SUBJECT = "llmgw.v1.admission.flow"
ADMISSION_LOAD_SUBJECT = "llmgw.v1.admission.load"
# Edge -> anyone: a request ended (its lease's release for the shard owner, the flow-control
# count, and the rate balancers' and breakers' sample). Public: usage and cost reports read it.
REQUEST_STATS_SUBJECT = "llmgw.v1.stats.request"
# Edge -> every edge: its requests and tokens per API key in the current rate window.
KEYS_USAGE_SUBJECT = "llmgw.v1.keys.usage"
# Edge -> one reaper of the queue group: a managed engine answered 404 for a model the fleet lists
# there; read its model list again (`fleet.models_refresh`'s follower).
MODELS_STALE_SUBJECT = "llmgw.v1.fleet.models_stale"
# Edge -> admission (one instance of the queue group writes it down): the edge's spend totals of
# one UTC day (llmgw.core.spend).
SPEND_TOTALS_SUBJECT = "llmgw.v1.spend.totals"
# Edge -> one admission instance of the queue group (request/reply): report what it spent from a
# budget account and ask for a new grant (llmgw.core.budget.regrant, by CAS on the account).
BUDGET_GRANT_SUBJECT = "llmgw.v1.spend.grant"
# Edge -> one edge (request/reply): give back to a budget account what you hold of it idle, for
# an edge whose grant cannot fit a request (llmgw.core.budget, loans).
BUDGET_LEND_PREFIX = "llmgw.v1.spend.lend."
# Responses API: an edge asks the edge that wrote a stored response for it (+ its writer token,
# llmgw.core.responses.writer_of); the answer is the record, or empty. Request/reply.
RESPONSES_ASK_PREFIX = "llmgw.v1.responses.ask."
# A deleted stored response's id, to every edge (each drops it from its memory).
RESPONSES_DELETED_SUBJECT = "llmgw.v1.responses.deleted"

# What an endpoint's prefix cache holds, for every admission instance, on subjects of one
# gateway's prefix stream (`Config.prefix_stream`), so two gateways (or two tests) sharing a NATS
# server never read each other's: `llmgw.v1.prefix.<stream>.sent.<endpoint>` (an admission
# instance placed a prompt there) and `.held.<endpoint>` (the scraper: what the engine's KV
# cache events say it holds). Kept in the stream, so an instance that starts catches up.
PREFIX_SUBJECT_ROOT = "llmgw.v1.prefix"


def prefix_subjects(stream: str) -> str:
    """Every subject of the prefix stream `stream`."""
    return f"{PREFIX_SUBJECT_ROOT}.{stream}.>"


def prefix_sent_subject(stream: str, endpoint: str) -> str:
    return f"{PREFIX_SUBJECT_ROOT}.{stream}.sent.{endpoint}"


def prefix_held_subject(stream: str, endpoint: str) -> str:
    return f"{PREFIX_SUBJECT_ROOT}.{stream}.held.{endpoint}"


def admission_subject(shard: int) -> str:
    return f"{ADMISSION_REQUEST_PREFIX}{shard}"


def leases_subject(shard: int) -> str:
    return f"{ADMISSION_LEASES_PREFIX}{shard}"


def handover_subject(instance: str) -> str:
    return f"{ADMISSION_HANDOVER_PREFIX}{instance}"


def loan_subject(instance: str) -> str:
    return f"{ADMISSION_LOAN_PREFIX}{instance}"


def budget_lend_subject(edge: str) -> str:
    return f"{BUDGET_LEND_PREFIX}{edge}"


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


M = TypeVar("M", bound=_Message)


def trusted(cls: type[M], **values: Any) -> M:
    """`cls.model_construct(**values)` at a fraction of its cost, for the hot path's own,
    already checked values (no validation): the same fields in the same order (so the same
    JSON), defaults and `model_fields_set`.

    model_construct walks every field's aliases and defaults per call (6-9 us for one of a
    request's messages here); this copies a template of the defaults made once per class.
    `values` must name fields only (model_construct would drop others; tests/test_wire.py
    holds the two equal)."""
    template, required = _template(cls)
    fields = template.copy()
    fields.update(values)
    for name in required:
        if fields[name] is _MISSING:  # as model_construct: a required field left out is absent
            del fields[name]
    message = cls.__new__(cls)
    _set = object.__setattr__
    _set(message, "__dict__", fields)
    _set(message, "__pydantic_fields_set__", set(values))
    _set(message, "__pydantic_extra__", None)
    _set(message, "__pydantic_private__", None)
    return message


_MISSING = object()


@functools.cache
def _template(cls: type[_Message]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Every field of `cls` in order with its default (`_MISSING` if required), and the
    required ones' names; TypeError for a class `trusted` cannot build as model_construct
    would (an alias, a default factory, a mutable default or a post-init hook)."""
    template: dict[str, Any] = {}
    required = []
    for name, field in cls.__pydantic_fields__.items():
        if field.alias not in (None, name) or field.validation_alias not in (None, name):
            raise TypeError(f"{cls.__name__}.{name} has an alias: use model_construct")
        if field.default_factory is not None:
            raise TypeError(f"{cls.__name__}.{name} has a default factory: use model_construct")
        if field.is_required():
            template[name] = _MISSING
            required.append(name)
            continue
        try:
            hash(field.default)
        except TypeError:
            raise TypeError(
                f"{cls.__name__}.{name} has a mutable default: use model_construct"
            ) from None
        template[name] = field.default
    if cls.__pydantic_post_init__:
        raise TypeError(f"{cls.__name__} has a post-init hook: use model_construct")
    return template, tuple(required)


class FailedAttempt(_Message):
    """The attempt a retry follows: its endpoint failed before anything reached the client."""

    attempt: str  # the failed attempt's id (its RequestEnded carries the same `id`)
    endpoint: str
    outcome: str  # llmgw.core.outcomes.Outcome value
    status: int | None = None
    retry_after: float | None = None
    # No connection could be made (refused, no such host, dial timeout): nothing serves there,
    # so the endpoint's breaker opens at once instead of after `router.failure_threshold`.
    refused: bool = False


class ContextExceeded(_Message):
    """A managed engine refused the request for its context length (its 400): the request needs
    more tokens than `window`, the window the engine named (None: it named none; then the
    window admission knows for `endpoint` and `model`, the model it was served as there)."""

    endpoint: str
    model: str
    window: int | None = Field(None, ge=1)


class AdmitRequest(_Message):
    """Edge -> the owner of `shard` (`admission_subject(shard)`): may this run now, and where?

    `session` is already a hash (never raw client text); `shard` is the session's shard (a
    sub-agent's: its family's, `llmgw.core.sessions.ClientKey.relatives`), or any shard for a
    request without a session; `parent`, a sub-agent's parent session (a hash too): its first
    request starts near the parent's pin. A retry names the lease of the attempt it
    follows (`retry_of`, released first, atomically with the new decision) and how that attempt
    failed (`failed`: the breakers learn it before the retry is placed); `exclude` lists every
    endpoint this request already tried. After an engine refused it for its context length,
    every later attempt says so (`exceeded`): it is placed only where it needs less than a
    window holds.
    """

    model_config = ConfigDict(
        extra="ignore", frozen=True, ser_json_bytes="base64", val_json_bytes="base64"
    )

    v: Literal[2] = 2
    id: str  # the attempt's id, unique across edges (its RequestEnded carries the same)
    edge: str
    model: str
    feature: Literal["chat", "completions", "embeddings"]
    request_id: str | None = None  # the client's x-request-id (or the edge's), for the logs
    shard: int = Field(ge=0)
    stream: bool = False
    session: str | None = None
    parent: str | None = None  # optional: an edge before it sends none, an instance ignores it
    band: str | None = None
    tenant: str | None = None
    # The API key's id and its max_parallel_requests (auth.mode keys): admission instances share
    # that limit as a quota (llmgw.core.apikeys.KeyLimits).
    key: str | None = None
    key_parallel: int | None = Field(None, ge=1)
    exclude: tuple[str, ...] = ()
    retry_of: str | None = None
    failed: FailedAttempt | None = None
    # The tenant's or key's overflow budget is used up: never a third party, wait for ours
    # (flow control queues it in its band; `exclude` lists the third parties' endpoints too).
    no_overflow: bool = False
    # The prompt's text chain (llmgw.core.prefix: `pack`ed, base64 in JSON) and the length of
    # its canonical bytes: placement prefers the endpoint that holds most of it. Empty: none.
    prefix: bytes = b""
    prompt_bytes: int = Field(0, ge=0)
    # With the model's tokenizer: the prompt's token chain (blocks of `token_block` ids, packed)
    # and its token count, matched against the engines' KV cache events. Empty: none.
    tokens: bytes = b""
    prompt_tokens: int = Field(0, ge=0)
    token_block: int = Field(0, ge=0)
    # The output it asks for at most (max_completion_tokens, max_tokens, max_output_tokens; 0:
    # not said): with the prompt, what it needs of a context window (llmgw.core.context).
    # None: an edge from before 2026-12-07, which cannot read a CONTEXT_LENGTH_EXCEEDED refusal
    # (its requests are routed by window, never refused for their length: the engine judges).
    max_output: int | None = Field(None, ge=0)
    # An engine refused it for its length (an edge from before 2026-12-07 sends none; an
    # instance from before ignores it and only `exclude` keeps the retry off that endpoint).
    exceeded: ContextExceeded | None = None


class Target(_Message):
    """Where an admitted request goes. `priority`: the engine-side priority to send (only for
    endpoints that opted in: `endpoints[].priority_scheduling`)."""

    provider: str
    provider_kind: Literal["managed", "unlimited"]
    endpoint: str
    url: str
    upstream_model: str
    priority: int | None = None


class ReplyStatus(enum.StrEnum):
    QUEUED = "queued"  # a progress reply: the request waits in flow control; the answer follows
    ADMITTED = "admitted"
    REFUSED = "refused"


class AdmitReply(_Message):
    """Owner -> edge. QUEUED first when the request waits (so the edge can tell a queue from an
    admission service that does not answer), then ADMITTED (target, lease) or REFUSED."""

    v: Literal[2] = 2
    id: str
    status: ReplyStatus
    target: Target | None = None
    lease: LeaseRecord | None = None
    route: str | None = None  # llmgw.core.placement.Route
    served_model: str | None = None  # the model asked for, or the fallback that serves it
    refresh: bool = False  # release with refresh on success (the pin's countdown restarts)
    refusal: Refusal | None = None
    message: str | None = None
    retry_after: float | None = None
    owner: str | None = None  # the instance that decided (renewals go to the shard's owner)
    edges: int | None = None  # edges the owner has heard from recently (local outage limits)


class RequestEnded(_Message):
    """Edge -> REQUEST_STATS_SUBJECT: one request ended (after each upstream attempt).

    For the shard's owner: the lease to release (`lease`, `shard`), refreshing the pin if
    `refresh`. For every admission instance: a rate-balancer sample (`latency` from sending it
    upstream to its end, tokens from the response's usage, zero for a failure) and the breakers'
    evidence (`outcome`, `status`, `retry_after`). For operators: usage per model, provider,
    endpoint and tenant.
    """

    v: Literal[2] = 2
    id: str  # the attempt: the request id, then "<request id>-<n>" for its n-th retry
    request_id: str | None = None  # the client's x-request-id (or the edge's), every attempt
    edge: str
    lease: str | None = None
    shard: int | None = None
    refresh: bool = False
    ok: bool
    outcome: str
    model: str
    served_model: str | None = None
    provider: str
    endpoint: str
    route: str | None = None
    tenant: str | None = None
    key: str | None = None  # the API key's id (auth.mode keys), never the key itself
    ended_at: float
    latency: float = 0.0  # seconds from sending upstream to the end; 0 if never sent
    sent: bool = True  # the request reached the upstream (stats are samples only then)
    input_tokens: int = 0
    output_tokens: int = 0
    status: int | None = None
    retry_after: float | None = None
    refused: bool = False  # as `FailedAttempt.refused`


class LeaseRenewal(_Message):
    """Edge -> the owner of `shard` (`leases_subject(shard)`): every lease it holds there.

    Complete by definition: the owner renews these, reports those it does not hold (`lost`),
    and ends the edge's other leases in the shard that are old enough to have been listed.
    `claims`: leases the edge granted itself while NATS was unreachable (outage mode `local`),
    offered to the owner, which takes them into its books as far as its quota covers and
    answers the others in `refused` (the edge offers those again at its next renewal).
    """

    v: Literal[2] = 2
    edge: str
    shard: int
    leases: tuple[str, ...]
    claims: tuple[LeaseRecord, ...] = ()


class LeaseRenewalReply(_Message):
    v: Literal[2] = 2
    lost: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()  # claims the owner did not take
    owner: str | None = None
    edges: int | None = None


class RollCall(_Message):
    """A new owner of `shards` -> every edge: answer with your leases in them."""

    v: Literal[2] = 2
    owner: str
    shards: tuple[int, ...]


class RollCallAnswer(_Message):
    v: Literal[2] = 2
    edge: str
    leases: tuple[LeaseRecord, ...]


class Handover(_Message):
    """The old owner -> the new owner of a shard: its pins and leases, their quota earmarked, and
    the recent grants of those leases (the new owner answers an ask again of one the same way)."""

    v: Literal[2] = 2
    source: str
    state: ShardState
    answers: tuple[AdmitReply, ...] = ()


class HandoverReply(_Message):
    v: Literal[2] = 2
    accepted: bool
    refused: tuple[str, ...] = ()  # lease ids the new owner could not cover


class QuotaLoanAsk(_Message):
    """An admission instance -> a peer (`loan_subject`): a request of the borrower's needs room
    on a pair that its own quota lacks; lend what you hold idle (leases ``g``, of which
    unreserved ``u``, pins ``p``), by moving it to the borrower in the pair's quota book."""

    v: Literal[1] = 1
    borrower: str
    provider: str
    model: str
    g: int = Field(0, ge=0)
    u: int = Field(0, ge=0)
    p: int = Field(0, ge=0)


class QuotaLoan(_Message):
    """The answer: what moved to the borrower, and the book's revision that shows it (0:
    nothing moved)."""

    v: Literal[1] = 1
    g: int = 0
    u: int = 0
    p: int = 0
    revision: int = 0


class HealthReply(_Message):
    """Answer on ADMISSION_HEALTH_SUBJECT: who is alive (every instance answers)."""

    v: Literal[2] = 2
    service: str
    instance: str
    shards: int = 0  # shards it serves now
    serving: bool = True


class PairHolding(_Message):
    provider: str
    model: str
    leases: int
    unreserved: int
    pins: int
    g: int | None = None
    u: int | None = None
    p: int | None = None


class PrefixTop(_Message):
    """One prompt prefix an endpoint takes (`llmgw state`): its first block's hash, how many
    placements started with it there, the longest of their chains (blocks) and the last
    time."""

    prefix: str
    placements: int
    blocks: int
    last_at: float


class EndpointPrefixes(_Message):
    """What an instance's prefix indexes hold of one endpoint (`llmgw state`)."""

    endpoint: str
    sent_blocks: int
    capacity_blocks: int
    held_blocks: int
    top: tuple[PrefixTop, ...] = ()


class StateReply(_Message):
    """Answer on ADMISSION_STATE_SUBJECT (every instance): what it holds, for `llmgw state`."""

    v: Literal[2] = 2
    instance: str
    shards: tuple[int, ...]
    pairs: tuple[PairHolding, ...]
    leases_by_kind: dict[str, int] = {}
    edges: int = 0
    # Live leases per endpoint, and the live fleet's revision this instance runs on (a drain
    # waits for 0 leases on its endpoint at every instance: `llmgw endpoints remove`), and the
    # applied config's (`llmgw config apply` waits for every instance to run on it).
    leases_by_endpoint: dict[str, int] = {}
    fleet_revision: int = 0
    config_revision: int = 0
    # Its prefix indexes per endpoint (cache-aware placement): sizes and the top prefixes.
    prefixes: tuple[EndpointPrefixes, ...] = ()


class EdgeConfigReply(_Message):
    """Answer on EDGE_CONFIG_SUBJECT (every edge): the applied config's revision it runs on
    (0: its file), and whether it follows the applied config at all (an edge that could not
    read the fleet bucket runs on its file until it restarts)."""

    v: Literal[1] = 1
    edge: str
    config_revision: int = 0
    follows: bool = True


class AdmitCancel(_Message):
    """Edge -> all admission instances (ADMISSION_CANCEL_SUBJECT): drop this queued request.

    The instance holding it answers the pending AdmitRequest with CANCELLED. A request already
    granted is not affected: the edge releases the lease it receives.
    """

    v: Literal[2] = 2
    id: str


class FlowState(_Message):
    """One admission instance's waiters per model and band (ADMISSION_FLOW_SUBJECT).

    Sent when it changes (at most once per dispatch tick) and every second while non-empty; a
    state not refreshed for a few seconds is forgotten (its instance is gone).
    """

    v: Literal[2] = 2
    instance: str
    # The routing bucket the instance serves: gateways sharing one NATS server stay apart.
    scope: str
    at: float
    waiting: dict[str, dict[str, int]]


class FlowLoad(_Message):
    """One admission instance's live leases per managed endpoint (ADMISSION_LOAD_SUBJECT).

    Sent at the next event-loop turn after a change (the endpoints that changed, `full` False)
    and every second (all of them, `full` True); every other instance counts them into the
    endpoint's inflight, so all of them see the same load (forgotten after a few seconds).
    """

    v: Literal[2] = 2
    instance: str
    scope: str
    at: float
    full: bool = True
    inflight: dict[str, int]


class KeyWindowUse(_Message):
    """One key's use in one rate window, as counted by one edge."""

    requests: int = Field(0, ge=0)
    tokens: int = Field(0, ge=0)


class KeyUsage(_Message):
    """Edge -> every edge (KEYS_USAGE_SUBJECT), every `auth.usage_interval` while it has use:
    its totals per key id in rate window `window` (totals, not deltas: a lost message is
    repaired by the next one)."""

    v: Literal[2] = 2
    edge: str
    window: int
    keys: dict[str, KeyWindowUse]


class ModelsStale(_Message):
    """Edge -> MODELS_STALE_SUBJECT: engine `endpoint` answered 404 ``model_not_found`` for
    `model`, which the fleet lists there (an adapter unloaded since the reaper read its list):
    read its ``GET /v1/models`` again now. At most one per endpoint and model per second from
    each edge; `scope` is the gateway's fleet bucket (gateways sharing a NATS server stay
    apart)."""

    v: Literal[1] = 1
    edge: str
    scope: str
    endpoint: str
    model: str


class SpendTotalsReport(_Message):
    """Edge -> SPEND_TOTALS_SUBJECT, every `spend.interval` while they change: the edge's
    totals of UTC day `day` (rows: key id, tenant, provider, model, requests, input, cached and
    output tokens, picos; llmgw.core.spend.SpendTotals). Totals, not deltas: the latest copy
    replaces the earlier one, so a lost or repeated message does no harm."""

    v: Literal[2] = 2
    edge: str
    day: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")
    currency: str
    rows: list[list[str | int]]


class BudgetGrantRequest(_Message):
    """Edge -> BUDGET_GRANT_SUBJECT: holder `edge` of account `account` (a key of the spend
    bucket, llmgw.core.budget.account_key) has spent `spent` picos in all and asks for a grant
    of `want` in all; `limit` is the budget as the edge's config or key says now."""

    v: Literal[2] = 2
    edge: str
    account: str = Field(pattern=r"^budget\.[A-Za-z0-9_.:@-]+$")
    limit: int = Field(ge=0)
    spent: int = Field(ge=0)
    want: int = Field(ge=0)


class BudgetGrantReply(_Message):
    """The holder's grant (picos it may commit in all), the account's room after it and what the
    account has spent as far as its holders have told (`ok` False: not written, `error` says
    why; the holder keeps its grant). `lenders`: what each other holder holds beyond its spend
    (llmgw.core.budget.Account.lenders), whom a holder short of room may ask for a loan."""

    v: Literal[2] = 2
    ok: bool = True
    grant: int = 0
    room: int = 0
    spent: int = 0
    mine: int = 0  # what the account holds as this holder's spend (it never goes back)
    lenders: tuple[tuple[str, int], ...] = ()  # (holder, picos) pairs
    error: str | None = None


class BudgetLoanAsk(_Message):
    """Edge -> a holder of budget account `account` (`budget_lend_subject`): a request of
    `borrower`'s does not fit its grant and the account's room is held by others; give back up
    to `want` picos of what you hold idle (never what you spent or reserved) by lowering your
    own grant in the account, before you answer."""

    v: Literal[2] = 2
    borrower: str
    account: str = Field(pattern=r"^budget\.[A-Za-z0-9_.:@-]+$")
    want: int = Field(ge=0)


class BudgetLoan(_Message):
    """The answer: what the holder gave back (0: nothing idle, or it waits for a grant itself);
    the account shows it as room by the time the answer is sent."""

    v: Literal[2] = 2
    lent: int = 0


class PrefixSent(_Message):
    """Admission instance -> everyone (`prefix_sent_subject`, kept in the prefix stream): it
    placed a prompt whose text chain is `chain` (`llmgw.core.prefix.pack`) on `endpoint`, for
    `model`, at `at` (its wall clock). Every instance records it in its `SentIndex`."""

    model_config = ConfigDict(
        extra="ignore", frozen=True, ser_json_bytes="base64", val_json_bytes="base64"
    )

    v: Literal[1] = 1
    instance: str
    endpoint: str
    model: str
    at: float
    chain: bytes


class PrefixHeld(_Message):
    """Scraper -> everyone (`prefix_held_subject`, kept in the prefix stream): what `endpoint`'s
    KV cache events said, in order, as token chains (`llmgw.core.prefix.token_chain`, packed):
    `cleared` first (the engine cleared its cache, restarted, or events were lost: forget what
    it held), then the blocks it `stored`, then those it `removed`. `seq` is the engine's batch
    sequence number of the last event applied; `block_size` its KV block in tokens."""

    model_config = ConfigDict(
        extra="ignore", frozen=True, ser_json_bytes="base64", val_json_bytes="base64"
    )

    v: Literal[1] = 1
    endpoint: str
    seq: int
    block_size: int = Field(ge=1)
    cleared: bool = False
    stored: bytes = b""
    removed: bytes = b""
    # The engine's own cache was emptied (AllBlocksCleared, or it restarted), not only what
    # the scraper knew of it: what was sent there is gone too.
    emptied: bool = False
