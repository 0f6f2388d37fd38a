"""`llmgw up` with the shipped config, one engine broken: streams are retried before their first
byte and the client (the official `openai` SDK, its own retries off) gets them complete.

engine-1 is a real misbehaving server (tests/misbehaving.py: healthy and idle to the scraper,
then it sends garbage where the first token should be) ranked above engine-2, a simulated engine.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import openai
import pytest
import yaml
from up_harness import REPO, write_cluster_config

sys.path.insert(0, str(REPO / "tests"))
from misbehaving import MisbehavingServer

READY = (
    r"^llmgw is ready: OpenAI API at (http://\S+/v1), API key (sk-llmgw-\w+) \(Ctrl-C to stop\)$"
)

pytestmark = pytest.mark.e2e


async def streams(api: str, key: str, count: int) -> list[tuple[str, str]]:
    """(endpoint, text) of `count` streamed chat completions, each its own session."""
    client = openai.AsyncOpenAI(base_url=api, api_key=key, max_retries=0, timeout=30)
    results = []
    for n in range(count):
        stream = await client.chat.completions.create(
            model="llama",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=6,
            extra_body={"ignore_eos": True},  # six tokens, then "length"
            stream=True,
            user=f"user-{n}",
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].choices and chunks[-1].choices[0].finish_reason == "length"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        results.append((stream.response.headers["x-llmgw-endpoint"], text))
    await client.close()
    return results


def test_a_broken_engine_costs_streaming_clients_nothing(tmp_path: Path, start_up) -> None:
    async def scenario() -> tuple[list[tuple[str, str]], int]:
        bad = await MisbehavingServer("garbage").start()
        try:
            config = write_cluster_config(tmp_path / "cluster.yaml")
            data = yaml.safe_load(config.read_text())
            for endpoint in data["endpoints"]:
                if endpoint["id"] == "engine-1":  # tried first, no simulator of its own
                    endpoint.update(url=bad.url, priority=200)
                    endpoint.pop("simulate")
            config.write_text(yaml.safe_dump(data, sort_keys=False))
            up = start_up(config)
            api, key = (await asyncio.to_thread(up.wait_for, READY, 90)).groups()
            return await streams(api, key, 4), bad.requests
        finally:
            await bad.stop()

    results, tried = asyncio.run(scenario())
    assert [endpoint for endpoint, _ in results] == ["engine-2"] * 4
    assert all(text for _, text in results)
    assert tried >= 1  # the broken engine was tried first (until its breaker opened)
