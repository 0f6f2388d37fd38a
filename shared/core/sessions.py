"""Which session a request belongs to: a hash, never raw client text.

A session is the run of requests of one conversation. Its id hashes
(user, model, feature class, stable prompt prefix):

- **chat**: the stable prefix is every message up to and including the
  first `user` message (system prompt, developer instructions, the opening
  question). Each later turn of the conversation resends those messages
  unchanged and appends to them, so every turn hashes to the same session,
  while a new conversation (a different opening) gets a new one.
- **completions**: the first STABLE_PROMPT_CHARS characters of the prompt.
  Clients that continue a conversation re-send the whole transcript as the
  prompt, so its beginning stays the same across turns.
- **embeddings**, and requests with nothing stable (empty prompt, no user
  message, token-id prompts, batched prompts), form no session: they take
  the unpinned path.

An explicit session key overrides the prefix: the `router.session_header`
header, else the request's `user` field (the router config's affinity key
"falls back to the `user` field"). All requests with the same key, model and
feature class share one session, so a client that sends `user` gets one
session per end user; send the header per conversation for finer sessions.

Ids are hex SHA-256 digests (first 32 characters), so whatever a client
sends, the id is a safe NATS subject token and KV key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from llmgw.core.requests import Feature

STABLE_PROMPT_CHARS = 512
SESSION_ID_CHARS = 32

_FEATURE_CLASS = {Feature.CHAT: "chat", Feature.COMPLETIONS: "completions"}


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        encoded = part.encode("utf-8", "surrogatepass")
        h.update(len(encoded).to_bytes(8, "big"))  # length-prefixed: no ambiguity between parts
        h.update(encoded)
    return h.hexdigest()[:SESSION_ID_CHARS]


def stable_prefix(feature: Feature, body: dict[str, Any]) -> str | None:
    """The part of the prompt that stays the same for a whole conversation, or None."""
    if feature is Feature.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        for index, message in enumerate(messages):
            if isinstance(message, dict) and message.get("role") == "user":
                return json.dumps(messages[: index + 1], sort_keys=True, ensure_ascii=False)
        return None
    if feature is Feature.COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return prompt[:STABLE_PROMPT_CHARS]
        return None
    return None


def session_id(
    feature: Feature,
    model: str,
    body: dict[str, Any],
    *,
    header_key: str | None = None,
) -> str | None:
    """The request's session id, or None when it forms no session.

    `model` is the canonical model name (aliases resolve to one session);
    `header_key` is the value of the session header, if the request had one.
    """
    feature_class = _FEATURE_CLASS.get(feature)
    if feature_class is None:
        return None
    raw_user = body.get("user")
    user = raw_user if isinstance(raw_user, str) else ""
    explicit = header_key or user
    if explicit:
        return _digest("key", explicit, model, feature_class)
    prefix = stable_prefix(feature, body)
    if prefix is None:
        return None
    return _digest("prefix", user, model, feature_class, prefix)


def chain_session(root: str, model: str, *, header_key: str | None = None) -> str:
    """The session of a Responses chain: its first response's id (the session header, when
    sent, as for chat). Every turn of the chain hashes to it, wherever it runs."""
    if header_key:
        return _digest("key", header_key, model, "responses")
    return _digest("chain", root, model)


def sessions_of_key(key: str, models: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Every session id an explicit key (a session header's value, or `user`) maps to, with its
    (model, feature class): how an operator finds a client's pins by what the client sent."""
    return {
        _digest("key", key, model, feature_class): (model, feature_class)
        for model in models
        for feature_class in sorted(set(_FEATURE_CLASS.values()))
    }


def tenant_id(authorization: str | None, user: str | None) -> str | None:
    """Who a request is from, for flow control's round robin: API key, else the `user` field.

    A hash (raw keys never leave the edge): "key-<hex>" from a bearer token, else "user-<hex>"
    from the body's `user`, else None (every such request shares one anonymous tenant).
    """
    if authorization:
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else authorization.strip()
        if token:
            return "key-" + _digest("tenant-key", token)[:16]
    if user:
        return "user-" + _digest("tenant-user", user)[:16]
    return None
