"""Cached prompt tokens through every API, under `llmgw up` with the shipped config and a price
for our engines with `cached_input`: each API's official SDK reads the cached part of a prompt
where that API puts it (chat: `prompt_tokens_details.cached_tokens`; Responses:
`input_tokens_details.cached_tokens`; Messages: `cache_read_input_tokens`, outside
`input_tokens`), streamed and not, as the engines counted it (`GET /sim/usage`), and `llmgw
spend` prices exactly those tokens at `cached_input`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from anthropic import Anthropic
from openai import OpenAI
from spend_cluster import SpendCluster, start_cluster
from timing import eventually

pytestmark = pytest.mark.e2e

MODEL = "llama-3.3-70b"
# Micro-units per million tokens (USD): cached input a quarter of input.
INPUT, CACHED_INPUT, OUTPUT = 2_000_000, 500_000, 8_000_000
PRICES = [{"provider": "iris", "model": MODEL, "input": 2, "cached_input": 0.5, "output": 8}]

Counts = tuple[int, int, int]  # prompt tokens (cached ones included), cached, output


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpendCluster]:
    cluster = start_cluster(tmp_path_factory.mktemp("cached"), {"prices": PRICES})
    try:
        yield cluster
    finally:
        cluster.stop()


def long_prompt(topic: str) -> str:
    """A system prompt of a few hundred tokens: many blocks of the engines' prefix cache."""
    return " ".join(f"{topic} fact {i}: its value is {i * 7 % 13}." for i in range(90))


def engines_bill(cluster: SpendCluster) -> dict[str, int]:
    """What our engines counted they served of MODEL (`GET /sim/usage`), summed."""
    row = cluster.bill(cluster.engines()).get(MODEL, {})
    return {k: row.get(k, 0) for k in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")}  # fmt: skip


def spend_row(cluster: SpendCluster, tenant: str, requests: int) -> dict[str, Any]:
    """`llmgw spend`'s row of `tenant` on iris and MODEL once it counts `requests` (the edge
    publishes its totals every spend.interval)."""
    report: dict[str, Any] = {}

    def counted() -> dict[str, Any] | None:
        nonlocal report
        report = cluster.cli("spend", "--period", "total", "--by", "tenant,provider,model")
        rows = [
            r
            for p in report["periods"]
            for r in p["rows"]
            if (r["tenant"], r["provider"], r["model"]) == (tenant, "iris", MODEL)
        ]
        return rows[0] if rows and rows[0]["requests"] >= requests else None

    try:
        return asyncio.run(eventually(counted, 30, interval=0.5))
    except AssertionError as failure:
        raise AssertionError(f"{failure}: {report}") from None


def check(cluster: SpendCluster, tenant: str, before: dict[str, int], counted: list[Counts]):
    """The clients' counts are the engines' own, and what `llmgw spend` priced."""
    after = engines_bill(cluster)
    prompt, cached, output = (sum(c[i] for c in counted) for i in range(3))
    assert after["requests"] - before["requests"] == len(counted)
    assert after["prompt_tokens"] - before["prompt_tokens"] == prompt
    assert after["cached_tokens"] - before["cached_tokens"] == cached
    assert after["completion_tokens"] - before["completion_tokens"] == output
    row = spend_row(cluster, tenant, len(counted))
    assert (
        row["requests"],
        row["input_tokens"],
        row["cached_input_tokens"],
        row["output_tokens"],
    ) == (len(counted), prompt, cached, output)
    picos = sum(INPUT * (p - c) + CACHED_INPUT * c + OUTPUT * o for p, c, o in counted)
    assert row["picos"] == picos  # cached tokens at cached_input, to the pico
    print(f"\n{tenant}: {counted} (prompt, cached, output); spend {row['cost']} USD")


def test_chat_completions_report_and_price_cached_tokens(cluster: SpendCluster) -> None:
    tenant = "cached-chat"
    client = OpenAI(base_url=cluster.apis[0], api_key=cluster.key_for(tenant), max_retries=0)
    messages = [
        {"role": "system", "content": long_prompt("chat")},
        {"role": "user", "content": "Which value has fact 7?"},
    ]

    def counts(usage: Any) -> Counts:
        details = usage.prompt_tokens_details
        cached = details.cached_tokens if details is not None else 0
        return usage.prompt_tokens, cached or 0, usage.completion_tokens

    before = engines_bill(cluster)
    counted = [counts(client.chat.completions.create(model="llama", messages=messages, max_tokens=8).usage)]  # fmt: skip
    stream = client.chat.completions.create(
        model="llama",
        messages=messages,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    (usage,) = [chunk.usage for chunk in stream if chunk.usage is not None]
    counted.append(counts(usage))
    counted.append(counts(client.chat.completions.create(model="llama", messages=messages, max_tokens=8).usage))  # fmt: skip
    assert counted[1][1] > 0 and counted[2][1] > 0  # the engine's prefix cache held the prompt
    assert counted[0][0] == counted[1][0] == counted[2][0]
    check(cluster, tenant, before, counted)


def test_the_responses_api_reports_and_prices_cached_tokens(cluster: SpendCluster) -> None:
    tenant = "cached-responses"
    client = OpenAI(base_url=cluster.apis[0], api_key=cluster.key_for(tenant), max_retries=0)
    instructions = long_prompt("responses")

    def counts(usage: Any) -> Counts:
        return usage.input_tokens, usage.input_tokens_details.cached_tokens, usage.output_tokens

    before = engines_bill(cluster)
    first = client.responses.create(
        model="llama", instructions=instructions, input="Which value has fact 7?",
        max_output_tokens=8,
    )  # fmt: skip
    counted = [counts(first.usage)]
    events = client.responses.create(
        model="llama", instructions=instructions, input="And fact 8?", max_output_tokens=8,
        previous_response_id=first.id, stream=True,
    )  # fmt: skip
    ended = ("response.completed", "response.incomplete")  # incomplete: max_output_tokens
    (second,) = [e.response for e in events if e.type in ended]
    counted.append(counts(second.usage))
    third = client.responses.create(
        model="llama", instructions=instructions, input="And fact 9?", max_output_tokens=8,
        previous_response_id=second.id,
    )  # fmt: skip
    counted.append(counts(third.usage))
    assert counted[1][1] > 0 and counted[2][1] > 0  # each turn's chain was cached
    check(cluster, tenant, before, counted)


def test_the_messages_api_reports_cache_reads_outside_input_tokens_and_prices_them(
    cluster: SpendCluster,
) -> None:
    tenant = "cached-messages"
    client = Anthropic(
        base_url=cluster.apis[0].removesuffix("/v1"),
        api_key=cluster.key_for(tenant),
        max_retries=0,
    )
    request: dict[str, Any] = {
        "model": "llama",
        "max_tokens": 8,
        "system": [
            {
                "type": "text",
                "text": long_prompt("messages"),
                "cache_control": {"type": "ephemeral", "ttl": "1h"},
            }
        ],
        "messages": [{"role": "user", "content": "Which value has fact 7?"}],
    }

    def counts(usage: Any) -> Counts:
        read = usage.cache_read_input_tokens or 0
        prompt = usage.input_tokens + read + (usage.cache_creation_input_tokens or 0)
        return prompt, read, usage.output_tokens

    before = engines_bill(cluster)
    first = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        second = stream.get_final_message()
    third = client.messages.create(**request)
    counted = [counts(m.usage) for m in (first, second, third)]
    assert counted[1][1] > 0 and counted[2][1] > 0
    # The same prompt each time: input_tokens is what the cache did not hold (Anthropic's
    # convention), so it shrinks by what was read.
    assert counted[0][0] == counted[1][0] == counted[2][0]
    assert third.usage.input_tokens == counted[2][0] - third.usage.cache_read_input_tokens
    assert third.usage.input_tokens < first.usage.input_tokens
    check(cluster, tenant, before, counted)
