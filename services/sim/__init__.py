"""Simulated upstreams: a vLLM-like engine and a third-party-API-like provider.

Layout: pure models (`engine_model`, `kvcache`, `provider_model`, `tokenizer`, `sampling`), their
real-time drivers (`engine_runtime`, `provider_runtime`), the shared OpenAI HTTP surface
(`openai_app`, `asgi`), composition roots (`apps`) and the CLI (`main`). See docs/simulator.md.
"""
