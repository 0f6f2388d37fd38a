"""`llmgw config apply` and the edges: every edge answers with the applied config revision it
runs on, so the command returns once a separate edge (following by a watch of its own) runs on
the new revision too, names an edge that lags, and names one that runs on its file without
waiting for it."""

from __future__ import annotations

from typing import Any

import httpx
from fleet_helpers import add_following_admission, local_config, stop_fleet_cluster
from inproc import Cluster
from nats.aio.client import Client as NatsClient

from llmgw.services.edge.live import AppliedConfigFollower, Following, follow_applied_config
from llmgw.services.fleet.apply import apply_file


async def test_config_apply_waits_for_separate_edges_and_names_those_that_do_not_follow(
    nats_url: str, nats_client: NatsClient, unique_id: str
) -> None:
    config = local_config(nats_url, unique_id, auth={"mode": "none"})
    cluster = Cluster(config, nats_url)
    mirrors: list[Any] = []
    followings: list[Following] = []
    try:
        mirrors.append(await add_following_admission(cluster, config))
        following, lagging, on_file = [await cluster.add_edge() for _ in range(3)]
        for edge in (following, lagging):
            followings.append(await follow_applied_config(edge.nc, config, edge.app.edge))
        # an edge that could not read the fleet bucket: it runs on its file, and says so
        unfollowing = Following(AppliedConfigFollower(on_file.app.edge, config), None)
        unfollowing.follows = False
        await unfollowing.answer(on_file.nc)
        followings.append(unfollowing)
        ids = [e.app.edge.edge_id for e in (following, lagging, on_file)]

        values = config.model_dump(mode="json")
        values["models"][0]["aliases"] = ["llama", "big"]
        # a provider too: the edge calls it with its own headers and APIs
        vela = {"id": "vela", "kind": "unlimited", "apis": ["chat_completions", "responses"]}
        values["providers"].append(vela | {"models": [{"name": "llama-3.3-70b"}]})
        endpoint = values["endpoints"][0]["url"]
        values["endpoints"].append(
            {"id": "vela-1", "url": endpoint, "provider": "vela", "models": ["llama-3.3-70b"]}
        )
        await followings[1].mirror.stop()  # type: ignore[union-attr]  # it stops following
        applied = await apply_file(nats_client, config, values, "<test>", wait=1.0)
        assert (applied.on_it, applied.answering) == (1, 1)
        assert applied.lagging_edges == [ids[1]]
        assert applied.unfollowing_edges == [ids[2]]
        on_it = {e.edge: e.config_revision for e in applied.edges}
        assert on_it[ids[0]] == applied.revision
        async with httpx.AsyncClient(base_url=following.url) as http:  # no wait: it runs on it
            listed = (await http.get("/v1/models")).json()["data"]
        assert "big" in [m["id"] for m in listed]
        assert "responses" in following.app.edge.responses.apis["vela"]
        assert "vela" in following.app.edge.upstream_headers

        await followings.pop(1).stop()
        await lagging.stop()  # gone: nothing left to wait for
        cluster.edges.remove(lagging)
        values["models"][0]["aliases"] = ["llama"]
        again = await apply_file(nats_client, config, values, "<test>", wait=5.0)
        assert not again.lagging_edges and again.unfollowing_edges == [ids[2]]
        assert {e.edge for e in again.edges} == {ids[0], ids[2]}
    finally:
        for one in followings:
            await one.stop()
        await stop_fleet_cluster(mirrors, cluster, [], nats_url, config)
