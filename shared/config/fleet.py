"""The `fleet` section: where the live fleet (endpoints, and the applied config) is kept.

The config file's `endpoints` seed the fleet bucket; from then on the bucket is the truth every
service follows (docs/architecture.md, "Live fleet"; docs/adr/0005-live-fleet.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, model_validator

from llmgw.config.common import StrictModel, fail
from llmgw.config.durations import PositiveDuration

if TYPE_CHECKING:
    from llmgw.config.schema import Config


class KubernetesDiscovery(StrictModel):
    """The engines behind a Kubernetes Service, followed by list + watch of its EndpointSlices
    (discovery.k8s.io/v1) by the reaper: a ready endpoint joins the fleet, one that is no
    longer ready (or gone) is drained, and removed once no lease is left on it."""

    namespace: str = "default"
    # The Service whose slices to follow (label kubernetes.io/service-name), or any label
    # selector of EndpointSlices; one of the two.
    service: str | None = None
    label_selector: str | None = None
    provider: str  # the provider its engines belong to
    # The models they serve; empty: each engine's GET /v1/models, matched against the config.
    models: list[str] = Field(default_factory=list)
    port_name: str | None = None  # the slice port to use (default: the first)
    id_prefix: str = Field("k8s", pattern=r"^[a-z0-9][a-z0-9_-]*$", max_length=20)
    capacity: int | None = Field(None, ge=1)  # batch slots of each engine (else learned)
    # The API server and credentials; unset: the pod's own (in-cluster service account).
    api_server: str | None = None
    token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_file: str | None = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"

    @property
    def selector(self) -> str:
        return self.label_selector or f"kubernetes.io/service-name={self.service}"

    @model_validator(mode="after")
    def _one_selector(self) -> KubernetesDiscovery:
        if (self.service is None) == (self.label_selector is None):
            fail([(("service",), "set service or label_selector (one of the two)")])
        return self


class FleetConfig(StrictModel):
    # The JetStream KV bucket (file storage) of the live fleet: one key per endpoint, the
    # applied config document, and the seed marks of the config files that seeded it.
    # Unset: `router.load_bucket` + "_fleet" (llmgw_load_fleet), so a gateway that names its
    # own load bucket gets its own fleet too.
    bucket: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]+$")
    # Seed the bucket from this file's `endpoints` (once per distinct list: a restart with the
    # same file does not bring back endpoints removed since). Off: the bucket alone decides.
    seed: bool = True
    # How long `llmgw endpoints remove` (and the admin API) waits for a draining endpoint's
    # leases to end before it refuses; `--force` removes at once.
    drain_timeout: PositiveDuration = 60.0
    # How often the reaper reads again the `GET /v1/models` of each endpoint whose models came
    # from its engine, and follows what it serves (a LoRA adapter loaded or unloaded at run
    # time, a model renamed); null: read once, when the endpoint joins. The scraper reads each
    # managed engine's context window again as often (and whenever it turns healthy again).
    models_refresh: PositiveDuration | None = 15.0
    # Follow a Kubernetes Service's EndpointSlices (docs/deployment.md, "Discovery"); off: null.
    kubernetes: KubernetesDiscovery | None = None


def fleet_bucket(config: Config) -> str:
    """The fleet bucket's name (`fleet.bucket`, else named after `router.load_bucket`)."""
    return config.fleet.bucket or f"{config.router.load_bucket}_fleet"
