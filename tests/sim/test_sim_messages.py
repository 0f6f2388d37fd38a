"""The simulators' Messages API: served unless `messages_api: false`, in Anthropic's shapes."""

import httpx
import pytest

from llmgw.services.sim.apps import create_engine_app, create_provider_app
from llmgw.services.sim.params import EngineParams, ProviderParams
from llmgw.serving import start_server

BODY = {"model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}
# The model would write 64 tokens: `max_tokens` 4 cuts every answer, 100 lets it end.
WRITES_64 = {"output_len_distribution": "fixed", "output_len_mean": 64}


@pytest.mark.parametrize(
    "app",
    [
        pytest.param(
            lambda on: create_engine_app(
                EngineParams.zero_delay(**WRITES_64).model_copy(update={"messages_api": on})
            ),
            id="engine",
        ),
        pytest.param(
            lambda on: create_provider_app(
                ProviderParams(messages_api=on, base_latency=0, **WRITES_64)
            ),
            id="provider",
        ),
    ],
)
async def test_messages_are_served_whole_streamed_and_counted_unless_turned_off(app):
    on, off = await start_server(app(True)), await start_server(app(False))
    try:
        async with httpx.AsyncClient() as http:
            whole = await http.post(on.url + "/v1/messages", json=BODY)
            ended = await http.post(on.url + "/v1/messages", json={**BODY, "max_tokens": 100})
            stream = await http.post(on.url + "/v1/messages", json={**BODY, "stream": True})
            count = await http.post(on.url + "/v1/messages/count_tokens", json=BODY)
            bad = await http.post(on.url + "/v1/messages", json={**BODY, "model": "other"})
            absent = await http.post(off.url + "/v1/messages", json=BODY)
    finally:
        await on.stop()
        await off.stop()
    message = whole.json()
    assert message["type"] == "message" and message["usage"]["output_tokens"] == 4
    assert message["stop_reason"] == "max_tokens" and message["content"][0]["text"]
    assert (ended.json()["stop_reason"], ended.json()["usage"]["output_tokens"]) == ("end_turn", 64)
    assert stream.headers["content-type"].startswith("text/event-stream")
    assert stream.text.startswith("event: message_start")
    assert stream.text.rstrip().endswith('data: {"type":"message_stop"}')
    assert count.json()["input_tokens"] > 0
    assert bad.status_code == 404 and bad.json()["error"]["type"] == "not_found_error"
    assert absent.status_code == 404
