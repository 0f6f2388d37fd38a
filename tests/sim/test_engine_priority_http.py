"""The request ``priority`` field over real HTTP: refused under fcfs, honoured under priority."""

from __future__ import annotations

import asyncio
import time

import pytest
from sim_helpers import Serve, metric
from timing import eventually

from llmgw.services.sim.apps import create_engine_app, create_provider_app
from llmgw.services.sim.params import EngineParams, ProviderParams

MODEL = "sim-llama"


def body(path: str, **extra: object) -> dict[str, object]:
    if path == "/v1/chat/completions":
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    return {"model": MODEL, "prompt": "hi", **extra}


PATHS = ["/v1/chat/completions", "/v1/completions"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("priority", [1, -1, 2**63 - 1])
async def test_fcfs_answers_a_non_zero_priority_with_vllms_400(
    serve: Serve, path: str, priority: int
) -> None:
    client = await serve(create_engine_app(EngineParams.zero_delay(), [MODEL]))
    response = await client.post(path, json=body(path, max_tokens=2, priority=priority))
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["message"] == f"Got priority {priority} but Priority scheduling is not enabled."
    assert (error["type"], error["param"]) == ("invalid_request_error", "priority")
    state = (await client.get("/sim/state")).json()
    assert (state["scheduling_policy"], state["prompt_tokens_total"]) == ("fcfs", 0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("policy", "extra"),
    [
        ("fcfs", {}),
        ("fcfs", {"priority": 0}),
        ("priority", {}),
        ("priority", {"priority": 7}),
        ("priority", {"priority": -(2**63)}),
        ("priority", {"priority": "7"}),  # vLLM's pydantic model converts it
    ],
)
async def test_accepted_priorities_generate_normally(
    serve: Serve, path: str, policy: str, extra: dict[str, int]
) -> None:
    params = EngineParams.zero_delay(scheduling_policy=policy)
    client = await serve(create_engine_app(params, [MODEL]))
    response = await client.post(path, json=body(path, max_tokens=3, ignore_eos=True, **extra))
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("value", ["high", 1.5, None, [1], 2**63, -(2**63) - 1])
async def test_a_priority_that_is_not_a_64_bit_integer_is_400(
    serve: Serve, policy: str, value: object
) -> None:
    params = EngineParams.zero_delay(scheduling_policy=policy)
    client = await serve(create_engine_app(params, [MODEL]))
    path = "/v1/chat/completions"
    response = await client.post(path, json=body(path, max_tokens=1, priority=value))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "priority"


async def test_a_provider_ignores_an_integer_priority(serve: Serve) -> None:
    client = await serve(create_provider_app(ProviderParams.zero_delay(), [MODEL]))
    path = "/v1/completions"
    response = await client.post(path, json=body(path, max_tokens=2, priority=5))
    assert response.status_code == 200


async def test_priority_policy_serves_the_urgent_request_first_and_counts_no_preemption(
    serve: Serve,
) -> None:
    params = EngineParams(
        scheduling_policy="priority",
        max_num_seqs=1,
        prefill_base=0.0,
        prefill_per_token=0.0,
        itl_base=0.03,
        itl_per_running_seq=0.0,
    )
    client = await serve(create_engine_app(params, [MODEL]))
    path = "/v1/completions"
    done: dict[str, float] = {}

    async def send(label: str, priority: int, max_tokens: int) -> None:
        response = await client.post(
            path, json=body(path, max_tokens=max_tokens, ignore_eos=True, priority=priority)
        )
        assert response.status_code == 200
        done[label] = time.monotonic()

    async def state_is(running: int, waiting: int) -> bool:
        state = (await client.get("/sim/state")).json()
        return (state["running"], state["waiting"]) == (running, waiting)

    tasks = [asyncio.create_task(send("busy", 0, 8))]
    await eventually(lambda: state_is(1, 0))
    tasks.append(asyncio.create_task(send("batch", 10, 3)))
    await eventually(lambda: state_is(1, 1))
    tasks.append(asyncio.create_task(send("urgent", -5, 3)))
    await eventually(lambda: state_is(1, 2))
    text = (await client.get("/metrics")).text
    assert metric(text, "vllm:num_requests_waiting", model_name=MODEL) == 2
    await asyncio.gather(*tasks)
    # The urgent request came last but ran right after "busy"; "batch" waited for it.
    assert done["busy"] < done["urgent"] < done["batch"]
    assert done["batch"] - done["urgent"] > 0.05  # three 30 ms tokens apart
    text = (await client.get("/metrics")).text
    assert metric(text, "vllm:num_preemptions_total", model_name=MODEL) == 0
    assert metric(text, "vllm:request_success_total", finished_reason="length") == 3
