"""Checks that span sections of the config: names that must resolve, ids that must be unique.

`config_problems` is pure: it reads a structurally valid `Config` and returns every problem found as
(location, message) pairs, locations being pydantic-style tuples such as ("endpoints", 2, "models", 0).
An empty list means every reference resolves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmgw.config.spend import spend_problems

if TYPE_CHECKING:
    from llmgw.config.schema import Config

Problem = tuple[tuple[str | int, ...], str]


def config_problems(config: Config) -> list[Problem]:
    problems: list[Problem] = []
    problems += _model_problems(config)
    problems += _profile_problems(config)
    problems += _provider_problems(config)
    problems += _endpoint_problems(config)
    problems += spend_problems(config)
    return problems


def _model_problems(config: Config) -> list[Problem]:
    problems: list[Problem] = []
    names: dict[str, int] = {}
    for index, model in enumerate(config.models):
        if model.name in names:
            problems.append(
                (
                    ("models", index, "name"),
                    f"duplicate model name {model.name!r} (also models[{names[model.name]}])",
                )
            )
        names.setdefault(model.name, index)
    owners: dict[str, int] = {}
    for index, model in enumerate(config.models):
        for alias_index, alias in enumerate(model.aliases):
            where = ("models", index, "aliases", alias_index)
            if alias in names:
                problems.append((where, f"alias {alias!r} is already a model name"))
            elif alias in owners:
                problems.append(
                    (where, f"alias {alias!r} is already used by models[{owners[alias]}]")
                )
            owners.setdefault(alias, index)
    known = set(names) | set(owners)
    for index, model in enumerate(config.models):
        for fallback_index, fallback in enumerate(model.fallbacks):
            where = ("models", index, "fallbacks", fallback_index)
            if fallback not in known:
                problems.append((where, f"unknown model {fallback!r}"))
            elif fallback == model.name or fallback in model.aliases:
                problems.append((where, f"a model cannot fall back to itself ({fallback!r})"))
    return problems


def _profile_problems(config: Config) -> list[Problem]:
    problems: list[Problem] = []
    known = ", ".join(config.profiles)
    if config.router.default_profile not in config.profiles:
        problems.append(
            (
                ("router", "default_profile"),
                f"unknown profile {config.router.default_profile!r}; known profiles: {known}",
            )
        )
    for index, model in enumerate(config.models):
        if model.routing_profile is not None and model.routing_profile not in config.profiles:
            problems.append(
                (
                    ("models", index, "routing_profile"),
                    f"unknown profile {model.routing_profile!r}; known profiles: {known}",
                )
            )
    return problems


def _provider_problems(config: Config) -> list[Problem]:
    problems: list[Problem] = []
    model_names = {model.name for model in config.models}
    aliases = {alias: model.name for model in config.models for alias in model.aliases}
    ids: dict[str, int] = {}
    for index, provider in enumerate(config.providers):
        if provider.id in ids:
            problems.append(
                (
                    ("providers", index, "id"),
                    f"duplicate provider id {provider.id!r} (also providers[{ids[provider.id]}])",
                )
            )
        ids.setdefault(provider.id, index)
        for model_index, model in enumerate(provider.models):
            where = ("providers", index, "models", model_index, "name")
            if model.name in aliases:
                problems.append(
                    (
                        where,
                        f"{model.name!r} is an alias; use the model name {aliases[model.name]!r}",
                    )
                )
            elif model.name not in model_names:
                problems.append(
                    (
                        where,
                        f"unknown model {model.name!r}; configured models: "
                        f"{', '.join(sorted(model_names))}",
                    )
                )
    return problems


def unserved_pairs(config: Config) -> list[str]:
    """Provider models no endpoint of the file serves: legal (the file's endpoints only seed
    the live fleet; engines that join later, by `llmgw endpoints add`, registration,
    Kubernetes discovery or a LoRA adapter loaded at run time, serve them), but a typo as
    often, so each is a warning. A provider whose engines Kubernetes discovery brings in
    (`fleet.kubernetes.provider`) is expected to have none in the file."""
    discovered = config.fleet.kubernetes.provider if config.fleet.kubernetes else None
    model_names = {model.name for model in config.models}
    served = {(e.provider, name) for e in config.endpoints for name in e.models}
    return [
        f"providers[{index}].models[{model_index}].name: no endpoint in this file serves model "
        f"{model.name!r} of provider {provider.id!r}: it is served once an endpoint that "
        "serves it joins the live fleet"
        for index, provider in enumerate(config.providers)
        if provider.id != discovered
        for model_index, model in enumerate(provider.models)
        if model.name in model_names and (provider.id, model.name) not in served
    ]


def _endpoint_problems(config: Config) -> list[Problem]:
    problems: list[Problem] = []
    providers = {provider.id: provider for provider in config.providers}
    model_names = {model.name for model in config.models}
    aliases = {alias: model.name for model in config.models for alias in model.aliases}
    ids: dict[str, int] = {}
    for index, endpoint in enumerate(config.endpoints):
        if endpoint.id in ids:
            problems.append(
                (
                    ("endpoints", index, "id"),
                    f"duplicate endpoint id {endpoint.id!r} (also endpoints[{ids[endpoint.id]}])",
                )
            )
        ids.setdefault(endpoint.id, index)
        provider = providers.get(endpoint.provider)
        if provider is None:
            problems.append(
                (
                    ("endpoints", index, "provider"),
                    f"unknown provider {endpoint.provider!r}; known providers: "
                    f"{', '.join(providers)}",
                )
            )
        for model_index, name in enumerate(endpoint.models):
            where = ("endpoints", index, "models", model_index)
            if name in aliases:
                problems.append(
                    (where, f"{name!r} is an alias; use the model name {aliases[name]!r}")
                )
            elif name not in model_names:
                problems.append((where, f"unknown model {name!r}"))
            elif provider is not None and provider.model(name) is None:
                problems.append((where, f"provider {provider.id!r} does not serve model {name!r}"))
    return problems
