"""What an admission instance tells about itself: its health (``llmgw.v1.admission.health``) and
its state (``llmgw.v1.admission.state``: its shards, what it holds of each pair, its leases by
kind and endpoint, its prefix index, the fleet and config revisions it runs on). Read only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmgw.wire import HealthReply, PairHolding, StateReply

if TYPE_CHECKING:
    from llmgw.core.ledger import Ledger
    from llmgw.services.admission.membership import Membership
    from llmgw.services.admission.prefixes import PrefixBoard


def health_reply(membership: Membership, shards: frozenset[int]) -> HealthReply:
    return HealthReply(
        service="admission",
        instance=membership.instance,
        shards=len(shards),
        serving=membership.can_serve(),
    )


def state_reply(
    instance: str,
    ledger: Ledger,
    shards: frozenset[int],
    prefixes: PrefixBoard,
    *,
    fleet_revision: int,
    config_revision: int,
) -> StateReply:
    pairs = []
    for pair, use in sorted(ledger.use.items()):
        quota = ledger.pair_quota(pair)
        pairs.append(
            PairHolding(
                provider=pair[0],
                model=pair[1],
                leases=use.leases,
                unreserved=use.unreserved,
                pins=use.pins,
                g=quota.g if quota else None,
                u=quota.u if quota else None,
                p=quota.p if quota else None,
            )
        )
    kinds: dict[str, int] = {}
    by_endpoint: dict[str, int] = {}
    for lease in ledger.leases.values():
        kinds[lease.kind.value] = kinds.get(lease.kind.value, 0) + 1
        if lease.endpoint is not None:
            by_endpoint[lease.endpoint] = by_endpoint.get(lease.endpoint, 0) + 1
    return StateReply(
        instance=instance,
        shards=tuple(sorted(shards)),
        pairs=tuple(pairs),
        leases_by_kind=kinds,
        edges=len(ledger.edges()),
        leases_by_endpoint=by_endpoint,
        prefixes=prefixes.summary(),
        fleet_revision=fleet_revision,
        config_revision=config_revision,
    )
