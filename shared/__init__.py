"""llmgw: an OpenAI-compatible LLM routing gateway on a NATS mesh."""

__version__ = "0.1.0"
