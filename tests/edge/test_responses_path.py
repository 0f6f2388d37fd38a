"""The Responses API through edge -> admission (NATS) -> simulated engines, with the official
openai client: create (whole and streamed), chains by previous_response_id, the stored
responses' GET, DELETE and input items."""

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from llmgw.services.sim.params import EngineParams
from llmgw.services.sim.tokenizer import render_chat, token_ids


@pytest.fixture
def engine_params() -> EngineParams:
    """The engines' model writes 64 tokens: each request's max_output_tokens (all below 64)
    cuts its answer, so its output is that long and the response is incomplete."""
    return EngineParams.zero_delay(output_len_distribution="fixed", output_len_mean=64)


@pytest.fixture
def client(gateway):
    return AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sk-one", max_retries=0)


async def test_create_answers_a_response_object_with_text_usage_and_our_id(client, gateway):
    response = await client.responses.create(model="m1", input="hello there", max_output_tokens=7)
    assert response.id.startswith("resp_") and len(response.id) == 37
    assert response.status == "incomplete"  # it stopped at max_output_tokens, as OpenAI says
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text
    assert response.usage.output_tokens == 7 and response.usage.input_tokens > 0
    assert response.store is True and response.previous_response_id is None
    again = await client.responses.retrieve(response.id)
    assert again.id == response.id and again.output_text == response.output_text


async def test_streamed_create_sends_typed_events_ending_in_completed_with_usage(client):
    stream = await client.responses.create(
        model="m1", input="tell me a story", max_output_tokens=5, stream=True
    )
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.count("response.output_text.delta") == 5
    assert kinds[-1] == "response.incomplete"  # max_output_tokens reached
    completed = events[-1].response
    assert completed.usage.output_tokens == 5
    assert events[0].response.id == completed.id and completed.id.startswith("resp_")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert completed.output_text == text
    stored = await client.responses.retrieve(completed.id)
    assert stored.output_text == text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_five_turn_chain_stays_on_its_replica_and_each_turn_carries_the_whole_conversation(
    gateway, stream
):
    client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sk-one", max_retries=0)
    previous = None
    endpoints, conversation = [], []
    for turn in range(5):
        question = f"turn {turn}: what next?"
        raw = await client.responses.with_raw_response.create(
            model="m1",
            input=question,
            instructions="be brief",
            max_output_tokens=4,
            previous_response_id=previous,
            stream=stream,
        )
        endpoints.append(raw.headers["x-llmgw-endpoint"])
        if stream:
            events = [event async for event in raw.parse()]
            response = events[-1].response
        else:
            response = raw.parse()
        assert response.previous_response_id == previous
        conversation.append({"role": "user", "content": question})
        prompt = [{"role": "system", "content": "be brief"}, *conversation]
        # The engine got every earlier turn: its prompt is the whole conversation's.
        assert response.usage.input_tokens == len(token_ids(render_chat(prompt)))
        conversation.append({"role": "assistant", "content": response.output_text})
        previous = response.id
    assert len(set(endpoints)) == 1, endpoints
    items = await client.responses.input_items.list(previous, order="asc")
    texts = [item.content[0].text if item.content else None for item in items.data]
    assert texts[0] == "turn 0: what next?" and texts[-1] == "turn 4: what next?"
    assert len(items.data) == 9  # five questions, four answers


async def test_a_conversation_resent_whole_each_turn_keeps_one_session_and_replica(gateway):
    """Agents that keep their own history (``store: false``, no ``previous_response_id``: the
    whole conversation resent each turn) are one session, as chat's clients are: its opening's,
    which a stored conversation resent with earlier turns shares; a chain by
    ``previous_response_id`` is a session of its own, and another opening another session."""
    client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sk-one", max_retries=0)
    history: list[dict] = [{"role": "developer", "content": "be brief"}]
    sessions, endpoints = [], []
    for turn in range(5):
        history.append({"role": "user", "content": [{"type": "input_text", "text": f"q{turn}"}]})
        raw = await client.responses.with_raw_response.create(
            model="m1", input=history, max_output_tokens=3, store=False
        )
        sessions.append(raw.headers["x-llmgw-session"])
        endpoints.append(raw.headers["x-llmgw-endpoint"])
        history.append({"role": "assistant", "content": raw.parse().output_text})
    assert len(set(sessions)) == 1 and len(set(endpoints)) == 1, (sessions, endpoints)

    opening = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "q0"}]
    stored = await client.responses.with_raw_response.create(  # stored, with an earlier turn
        model="m1",
        input=[*opening, {"role": "assistant", "content": "a0"}, {"role": "user", "content": "q1"}],
        max_output_tokens=3,
    )
    assert stored.headers["x-llmgw-session"] == sessions[0]
    chained = await client.responses.with_raw_response.create(
        model="m1", input=opening, max_output_tokens=3
    )
    follow = await client.responses.with_raw_response.create(
        model="m1", input="and?", max_output_tokens=3, previous_response_id=chained.parse().id
    )
    assert chained.headers["x-llmgw-session"] == follow.headers["x-llmgw-session"] != sessions[0]
    other = await client.responses.with_raw_response.create(
        model="m1", input="another opening", max_output_tokens=3, store=False
    )
    assert other.headers["x-llmgw-session"] != sessions[0]


async def test_a_deleted_response_is_gone_and_ends_its_chain(client):
    first = await client.responses.create(model="m1", input="remember this", max_output_tokens=2)
    deleted = await client.responses.delete(first.id)
    assert deleted is None  # the SDK returns nothing for a 200 deletion
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as caught:
        await client.responses.create(model="m1", input="and?", previous_response_id=first.id)
    assert caught.value.body["code"] == "previous_response_not_found"


async def test_another_callers_response_is_not_found(gateway, client):
    mine = await client.responses.create(model="m1", input="mine", max_output_tokens=2)
    other = AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sk-two", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        await other.responses.create(model="m1", input="x", previous_response_id=mine.id)
    async with httpx.AsyncClient() as http:
        gone = await http.delete(
            f"{gateway.url}/v1/responses/{mine.id}", headers={"authorization": "Bearer sk-two"}
        )
    assert gone.status_code == 404
    assert (await client.responses.retrieve(mine.id)).id == mine.id


async def test_store_false_is_answered_but_not_kept(client):
    response = await client.responses.create(
        model="m1", input="forget me", max_output_tokens=2, store=False
    )
    assert response.output_text and response.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)


async def test_responses_are_counted_as_their_own_feature_with_tokens_and_stored_results(
    client, gateway
):
    response = await client.responses.create(model="m1", input="count me", max_output_tokens=3)
    await gateway.deps.responses.close()  # the write has landed
    registry = gateway.deps.metrics.registry

    def total(name: str, **labels: str) -> float:
        return sum(
            sample.value
            for metric in registry.collect()
            for sample in metric.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    assert total("llmgw_edge_requests_total", feature="responses", outcome="success") == 1
    assert total("llmgw_edge_tokens_total", direction="output") == response.usage.output_tokens
    assert total("llmgw_edge_responses_stored_total", result="stored") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_failing_engine_is_retried_elsewhere_before_anything_reached_the_client(
    gateway, client, stream
):
    engine_1 = gateway.engines["engine-1"].url
    async with httpx.AsyncClient() as http:  # engine-1 (the first choice) answers 500, always
        set_faults = await http.post(engine_1 + "/sim/faults", json={"error_rate": 1.0})
    assert set_faults.status_code == 200
    raw = await client.responses.with_raw_response.create(
        model="m1", input="retry me", max_output_tokens=2, stream=stream
    )
    assert raw.headers["x-llmgw-endpoint"] == "engine-2"
    retried = gateway.deps.metrics.retries.labels("upstream_error")._value.get()
    assert retried == 1  # engine-1 was asked first and failed
    response = [e async for e in raw.parse()][-1].response if stream else raw.parse()
    assert response.output_text and response.usage.output_tokens == 2
    assert (await client.responses.retrieve(response.id)).id == response.id
