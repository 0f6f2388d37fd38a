"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` on the simulated engine (pure: bodies in,
bodies out, `SimError` for what vLLM answers with an error).

``/tokenize`` takes vLLM's two request shapes: ``{model?, prompt, add_special_tokens=true}``, or
``{model?, messages, add_generation_prompt=true, add_special_tokens=false, tools?}``, whose
messages are rendered and encoded exactly as the engine does for a chat request with those
messages and tools (the same `Tokenizer` call), so its tokens are the ones the engine computes
and caches for that request. It answers ``{"count", "max_model_len", "tokens", "token_strs"}``;
``token_strs`` is null unless ``return_token_strs`` asks for them. ``/detokenize`` takes
``{model?, tokens}`` and answers ``{"prompt"}``. Token strings and detokenizing need a
vocabulary: an engine on the stand-in tokenizer answers them with 400.

Errors have vLLM's shape: ``{"error": {"message", "type", "param", "code"}}`` whose ``type`` is
the name of vLLM's exception (``BadRequestError``, ``NotFoundError``) and ``code`` the status
(`vllm_error`).
"""

from __future__ import annotations

from typing import Any

from llmgw.services.sim.generation import SimError
from llmgw.services.sim.tokenizer import TokenizeError, Tokenizer

__all__ = ["detokenize", "tokenize", "vllm_error"]

_VLLM_TYPES = {404: "NotFoundError"}


def vllm_error(exc: SimError) -> SimError:
    """`exc` in vLLM's error shape: its exception's name as ``type``, the status as ``code``."""
    kind = _VLLM_TYPES.get(exc.status, "BadRequestError")
    return SimError(exc.status, exc.message, type=kind, code=exc.status, param=exc.param)


def tokenize(body: dict[str, Any], tokenizer: Tokenizer, max_model_len: int) -> dict[str, Any]:
    """The answer to a ``/tokenize`` body; raises SimError (400)."""
    try:
        if "messages" in body:
            generation_prompt = _flag(body, "add_generation_prompt", True)
            if _flag(body, "continue_final_message", False):
                if generation_prompt:
                    raise SimError(
                        400,
                        "Cannot set both `continue_final_message` and `add_generation_prompt` "
                        "to True.",
                    )
                raise SimError(
                    400, "continue_final_message: not supported by the simulator", param="messages"
                )
            ids = tokenizer.chat(
                body["messages"],
                tools=body.get("tools"),
                add_generation_prompt=generation_prompt,
                add_special_tokens=_flag(body, "add_special_tokens", False),
            )
        elif "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise SimError(400, "prompt: Input should be a valid string", param="prompt")
            ids = tokenizer.encode(
                prompt, add_special_tokens=_flag(body, "add_special_tokens", True)
            )
        else:
            raise SimError(400, "a `prompt` or `messages` is required")
        strs = tokenizer.token_strs(ids) if _flag(body, "return_token_strs", False) else None
    except TokenizeError as exc:
        raise SimError(
            400, str(exc), param="messages" if "messages" in body else "prompt"
        ) from None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: dict[str, Any], tokenizer: Tokenizer) -> dict[str, Any]:
    """The answer to a ``/detokenize`` body; raises SimError (400)."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise SimError(400, "tokens: a list of token ids is required", param="tokens")
    try:
        return {"prompt": tokenizer.decode(tokens)}
    except TokenizeError as exc:
        raise SimError(400, str(exc), param="tokens") from None


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise SimError(400, f"{name}: Input should be a valid boolean", param=name)
    return value
