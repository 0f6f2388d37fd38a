"""What the rooms of an admission decision share: the request being decided, what placement can
answer besides a reply (`Loan`, `QuotaWait`), and what a live change swaps (`Current`).

`Current` is the one place the config the instance runs on, the provider catalog built from it
and the tables read from its models and bands are kept: `live.apply_fleet` swaps the config and
the catalog (through `AdmissionService`), `AdmissionService.follow_config` the tables, between
two decisions; every room reads them here at each use, never a copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmgw.core.quota import QuotaCounts

if TYPE_CHECKING:
    from llmgw.config.schema import Band, Config
    from llmgw.core.context import ContextNeed
    from llmgw.core.prefix import PromptPrefix
    from llmgw.core.requests import Feature
    from llmgw.services.admission.catalog import ProviderCatalog
    from llmgw.wire import AdmitRequest

ANONYMOUS_TENANT = "anonymous"  # the tenant of requests that name none


@dataclass(slots=True)
class Deciding:
    """One admission request being decided."""

    request: AdmitRequest
    feature: Feature
    band: Band
    reply_to: str | None
    started: float
    arrived: float = 0.0  # the service clock's time it arrived (a held request expires by it)
    borrowing: bool = False  # waiting for a loan of quota (`Loan`), not in a queue
    grace_spent: bool = False  # its `limit_grace` ran out while it waited for room
    # It may run on a third party: its band overflows, its overflow budget is not used up, and
    # an unlimited provider serves its model (or a fallback). When not, it waits for our engines.
    can_overflow: bool = True
    prompt: PromptPrefix | None = None  # its prompt's chain, for cache-aware placement
    # What it needs of a context window (None: nothing known, it fits everywhere), and the
    # models that may serve it, in order: its own and its fallbacks, those whose window it
    # fits (`Intake.fitting`). The first is the model whose pool and queue it waits in.
    need: ContextNeed | None = None
    models: tuple[str, ...] = ()

    @property
    def tenant(self) -> str:
        return self.request.tenant or ANONYMOUS_TENANT


@dataclass(frozen=True, slots=True)
class Loan:
    """Placement would send the request elsewhere (a third party, a temporary fallback, a
    refusal) only because this instance's share of `pair` is used up, while the pair's limits
    have room: borrow first, then place it again. `need`: what the request will use of the
    pair (a lease, unreserved or not, and a pin if it creates one); its round borrows what its
    requests together lack of that."""

    pair: tuple[str, str]
    need: QuotaCounts
    overflow: bool = False


@dataclass(frozen=True, slots=True)
class QuotaWait:
    """Placement would send the request to a third party, or refuse it, only because our quota
    of `pair` is used up (this instance's share, and no loan came). A request of a band that
    waits rather than overflows (a batch band, or one whose overflow budget is used up) waits
    in its queue for room (`FlowControl.hold`; `until` None), as it waits there for engine room:
    batch bands wait for our engines. One of a band that overflows waits for a lease to end
    until `until` (``admission.limit_grace`` after it arrived), then goes where placement
    sends it: a lease's end may be on its way to its owner."""

    pair: tuple[str, str]
    until: float | None = None

    @property
    def in_queue(self) -> bool:
        """It waits in its band's queue (no `until`), not for a lease end."""
        return self.until is None


@dataclass(slots=True)
class Current:
    """The config in force, its provider catalog, and the tables read from its models and
    bands (`follow`)."""

    config: Config
    catalog: ProviderCatalog
    bands: dict[str, Band] = field(default_factory=dict)
    models: frozenset[str] = frozenset()  # canonical names (wire values)
    engine_priority: dict[str, int] = field(default_factory=dict)  # by band: 0 the highest
    fallbacks: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def follow(self, config: Config) -> None:
        """The tables the decisions read from `config.models` and `config.admission.bands`."""
        bands = config.admission.bands
        self.bands = {b.name: b for b in bands}
        self.models = frozenset(m.name for m in config.models)
        ranked = sorted(bands, key=lambda b: -b.priority)
        self.engine_priority = {b.name: index for index, b in enumerate(ranked)}
        self.fallbacks = {m.name: tuple(m.fallbacks) for m in config.models}
