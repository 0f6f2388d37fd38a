"""The foundation's routing rule: first usable endpoint of the first suitable provider."""

from llmgw.core.requests import Feature
from llmgw.core.routing import (
    EndpointView,
    NoRoute,
    ProviderKind,
    ProviderView,
    RoutingSnapshot,
    first_available,
)

ALL = frozenset(Feature)


def provider(pid, kind, endpoints, features=None):
    return ProviderView(pid, kind, {"m": features or ALL}, tuple(endpoints))


def ep(eid, pid, healthy=True):
    return EndpointView(eid, f"http://{eid}", pid, frozenset({"m"}), healthy=healthy)


def test_managed_provider_is_preferred_when_healthy():
    snap = RoutingSnapshot((
        provider("iris", ProviderKind.MANAGED, [ep("e1", "iris"), ep("e2", "iris")]),
        provider("tx", ProviderKind.UNLIMITED, [ep("t1", "tx")]),
    ))
    routed = first_available(snap, "m", Feature.CHAT)
    assert (routed.provider.id, routed.endpoint.id) == ("iris", "e1")


def test_unhealthy_endpoint_is_skipped_and_degraded_provider_falls_through():
    snap = RoutingSnapshot((
        provider("iris", ProviderKind.MANAGED, [ep("e1", "iris", False), ep("e2", "iris")]),
        provider("tx", ProviderKind.UNLIMITED, [ep("t1", "tx")]),
    ))
    assert first_available(snap, "m", Feature.CHAT).endpoint.id == "e2"
    degraded = RoutingSnapshot((
        provider("iris", ProviderKind.MANAGED, [ep("e1", "iris", False)]),
        provider("tx", ProviderKind.UNLIMITED, [ep("t1", "tx")]),
    ))
    assert first_available(degraded, "m", Feature.CHAT).provider.id == "tx"


def test_unsupported_feature_versus_no_capacity():
    snap = RoutingSnapshot((
        provider("iris", ProviderKind.MANAGED, [ep("e1", "iris", False)], frozenset({Feature.CHAT})),
    ))
    assert first_available(snap, "m", Feature.EMBEDDINGS) is NoRoute.UNSUPPORTED
    assert first_available(snap, "m", Feature.CHAT) is NoRoute.NO_CAPACITY
    assert first_available(snap, "other", Feature.CHAT) is NoRoute.UNSUPPORTED


def test_excluded_endpoints_are_not_chosen():
    snap = RoutingSnapshot((provider("iris", ProviderKind.MANAGED, [ep("e1", "iris"), ep("e2", "iris")]),))
    assert first_available(snap, "m", Feature.CHAT, exclude_endpoints={"e1"}).endpoint.id == "e2"
    assert first_available(snap, "m", Feature.CHAT, exclude_endpoints={"e1", "e2"}) is NoRoute.NO_CAPACITY
