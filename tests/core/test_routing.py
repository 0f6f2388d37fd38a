"""The routing view: which endpoints of a provider are usable, and when a provider is degraded."""

from llmgw.core.requests import Feature
from llmgw.core.routing import EndpointView, ProviderKind, ProviderView


def provider(kind, endpoints, features=frozenset(Feature)):
    return ProviderView("p", kind, {"m": features}, tuple(endpoints))


def ep(eid, healthy=True, models=("m",)):
    return EndpointView(eid, f"http://{eid}", "p", frozenset(models), healthy=healthy)


def test_healthy_endpoints_keep_their_order_and_skip_unhealthy_excluded_and_other_models():
    view = provider(
        ProviderKind.MANAGED, [ep("e1", False), ep("e2"), ep("e3"), ep("e4", models=("x",))]
    )
    assert [e.id for e in view.healthy_endpoints("m")] == ["e2", "e3"]
    assert [e.id for e in view.healthy_endpoints("m", exclude={"e2"})] == ["e3"]


def test_a_managed_provider_without_a_healthy_endpoint_is_degraded_an_unlimited_one_never():
    assert provider(ProviderKind.MANAGED, [ep("e1", False)]).degraded("m")
    assert not provider(ProviderKind.MANAGED, [ep("e1", False), ep("e2")]).degraded("m")
    assert not provider(ProviderKind.UNLIMITED, [ep("e1", False)]).degraded("m")


def test_supports_means_the_model_with_that_feature():
    view = provider(ProviderKind.MANAGED, [ep("e1")], frozenset({Feature.CHAT}))
    assert view.supports("m", Feature.CHAT)
    assert not view.supports("m", Feature.EMBEDDINGS)
    assert not view.supports("other", Feature.CHAT)
    assert (
        EndpointView("e", "u", "p", frozenset({"m"}), upstream_models={"m": "m-v2"}).upstream_model(
            "m"
        )
        == "m-v2"
    )
