"""Versioned wire messages and the NATS subjects they travel on.

Every message carries `v` (the schema version). A receiver rejects a version
it does not know instead of guessing. Request bodies never cross NATS: only
the metadata admission needs (a few hundred bytes), so the 1 MB NATS payload
limit never matters. docs/architecture.md lists the subjects.
"""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import BaseModel, ConfigDict

from llmgw.core.leasekeys import LeaseKind, PinValue
from llmgw.core.leases import Lease as CoreLease
from llmgw.core.leases import Pin as CorePin

WIRE_VERSION = 1

# Subjects: one vocabulary, `llmgw.v1.<service>.<verb>`.
ADMISSION_REQUEST_SUBJECT = "llmgw.v1.admission.request"
ADMISSION_QUEUE_GROUP = "admission"
ADMISSION_HEALTH_SUBJECT = "llmgw.v1.admission.health"
# Edge -> every admission instance: the client of a queued request has gone.
ADMISSION_CANCEL_SUBJECT = "llmgw.v1.admission.cancel"
# Admission instance -> the others: its queue depths, and the grants it made (flow control).
ADMISSION_FLOW_SUBJECT = "llmgw.v1.admission.flow"
ADMISSION_GRANTS_SUBJECT = "llmgw.v1.admission.grants"
# Edge -> every admission instance: a request admission counted on an endpoint has ended.
ADMISSION_DONE_SUBJECT = "llmgw.v1.admission.done"
# Edge -> anyone (admission's rate balancers): one finished upstream request's stats.
REQUEST_STATS_SUBJECT = "llmgw.v1.stats.request"


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class AdmitRequest(_Message):
    """Edge -> admission: may this request run now, and where?

    `session_id` is already a hash (never raw client text); `band` and
    `tenant` feed flow control. Sent on ADMISSION_REQUEST_SUBJECT to the
    ADMISSION_QUEUE_GROUP, so exactly one admission instance answers.
    """

    v: Literal[1] = 1
    request_id: str
    edge_id: str
    model: str
    feature: Literal["chat", "completions", "embeddings"]
    stream: bool = False
    session_id: str | None = None
    band: str | None = None
    tenant: str | None = None
    # Endpoints the edge already tried for this request (retries go elsewhere).
    exclude_endpoints: tuple[str, ...] = ()


class Target(_Message):
    """Where an admitted request goes."""

    provider: str
    provider_kind: Literal["managed", "unlimited"]
    endpoint: str
    url: str
    upstream_model: str


class Lease(_Message):
    """A request lease; the edge owns it from the reply until it releases it.

    `key` and `revision` identify the lease record in the routing-state
    bucket so that renew and release are compare-and-swap operations; the
    other fields are what the record holds (see llmgw.core.leases.Lease).
    """

    key: str
    revision: int
    lease_id: str
    kind: Literal["pinned", "new_pin", "temporary"]
    provider: str
    model: str
    session: str | None = None
    pin_id: str | None = None
    edge_id: str
    granted_at: float
    renewed_at: float
    slot: int | None = None

    @classmethod
    def from_core(cls, lease: CoreLease) -> Lease:
        return cls(
            key=lease.key,
            revision=lease.revision,
            lease_id=lease.lease_id,
            kind=lease.kind.value,
            provider=lease.provider,
            model=lease.model,
            session=lease.session,
            pin_id=lease.pin_id,
            edge_id=lease.edge_id,
            granted_at=lease.granted_at,
            renewed_at=lease.renewed_at,
            slot=lease.slot,
        )

    def to_core(self) -> CoreLease:
        return CoreLease(
            key=self.key,
            revision=self.revision,
            lease_id=self.lease_id,
            kind=LeaseKind(self.kind),
            provider=self.provider,
            model=self.model,
            session=self.session,
            pin_id=self.pin_id,
            edge_id=self.edge_id,
            granted_at=self.granted_at,
            renewed_at=self.renewed_at,
            slot=self.slot,
        )


class PinRef(_Message):
    """The session's pin as admission left it: a hint that saves the edge a read on release."""

    key: str
    revision: int
    value: str  # the pin's JSON value (llmgw.core.leasekeys.PinValue)

    @classmethod
    def from_core(cls, pin: CorePin) -> PinRef:
        return cls(key=pin.key, revision=pin.revision, value=pin.value.to_json().decode())

    def to_core(self) -> CorePin:
        return CorePin(self.key, self.revision, PinValue.from_json(self.value.encode()))


class RejectReason(enum.StrEnum):
    """Why admission said no; the edge maps each to one client-facing outcome."""

    UNSUPPORTED = "unsupported"  # no provider serves this model with this feature
    NO_CAPACITY = "no_capacity"  # every candidate is degraded, full or unhealthy
    UNKNOWN_MODEL = "unknown_model"
    UNKNOWN_BAND = "unknown_band"
    MALFORMED = "malformed"  # the request did not parse (e.g. an edge of another version)
    QUEUE_FULL = "queue_full"  # flow control: the band's queue is at capacity
    QUEUE_TIMEOUT = "queue_timeout"  # flow control: waited admission.queue_ttl
    CANCELLED = "cancelled"  # the edge said its client left while the request was queued


class AdmitReply(_Message):
    """Admission -> edge: a target (and lease, once leases exist) or a rejection."""

    v: Literal[1] = 1
    request_id: str
    admitted: bool
    target: Target | None = None
    lease: Lease | None = None
    pin: PinRef | None = None
    # How the request relates to its session's pin (llmgw.core.pinning.Route).
    route: str | None = None
    # The model that serves it: the one asked for, or one of its fallbacks (models[].fallbacks)
    # when every provider of the asked model was degraded or full.
    served_model: str | None = None
    # Release the lease with refresh_pin=True if the request succeeds.
    refresh_pin_on_success: bool = False
    reject_reason: RejectReason | None = None
    message: str | None = None
    retry_after_s: float | None = None
    # Set when admission counts the request against the target endpoint's load: the edge
    # announces the request's end with it (RequestDone), so the count ends with the request.
    granted_at: float | None = None


class HealthReply(_Message):
    """Answer on ADMISSION_HEALTH_SUBJECT: who is alive (every instance answers)."""

    v: Literal[1] = 1
    service: str
    instance: str


class AdmitCancel(_Message):
    """Edge -> all admission instances (ADMISSION_CANCEL_SUBJECT): drop this queued request.

    The instance holding it answers the pending AdmitRequest with CANCELLED. A request already
    granted is not affected: the edge releases the lease it receives.
    """

    v: Literal[1] = 1
    request_id: str


class FlowState(_Message):
    """One admission instance's waiters per model and band (ADMISSION_FLOW_SUBJECT).

    Sent when it changes (at most once per dispatch tick) and every second while non-empty; a
    state not refreshed for a few seconds is forgotten (its instance is gone).
    """

    v: Literal[1] = 1
    instance: str
    # The routing bucket the instance serves: gateways sharing one NATS server stay apart.
    scope: str
    at: float
    waiting: dict[str, dict[str, int]]


class FlowGrants(_Message):
    """Grants one admission instance made, as (endpoint, unix time) pairs (ADMISSION_GRANTS_SUBJECT).

    Other instances count them against the endpoint's saturation until a scrape taken after
    them shows the request in the engine's own numbers.
    """

    v: Literal[1] = 1
    instance: str
    scope: str  # as in FlowState
    grants: list[tuple[str, float]]


class RequestDone(_Message):
    """Edge -> all admission instances (ADMISSION_DONE_SUBJECT): a counted request has ended.

    ``endpoint`` and ``granted_at`` are the target and `AdmitReply.granted_at` of the request.
    Instances stop counting it against the endpoint at once instead of at the next scrape, so
    short requests do not look like load for a whole scrape interval. Best effort: a lost one
    only delays that to the next scrape.
    """

    v: Literal[1] = 1
    endpoint: str
    granted_at: float
    ended_at: float  # unix seconds, the edge's clock


class RequestStats(_Message):
    """Edge -> REQUEST_STATS_SUBJECT: one upstream request, as a rate balancer sample.

    ``latency`` is seconds from sending the request upstream to its end; the tokens come from
    the response's usage (zero for a failed request, ``ok`` False). Every admission instance
    learns deployment rates from every edge's traffic this way (llmgw.core.balancer).
    """

    v: Literal[1] = 1
    endpoint: str
    provider: str
    ended_at: float  # unix seconds, the edge's clock
    latency: float
    ok: bool
    input_tokens: int = 0
    output_tokens: int = 0
    # How the request ended (llmgw.core.outcomes.Outcome); the upstream's status and Retry-After
    # (seconds) when it answered with an error. Breakers count upstream_* outcomes as failures.
    outcome: str = "success"
    status: int | None = None
    retry_after_s: float | None = None
