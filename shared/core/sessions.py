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
- **responses** (`chain_session`): a chain by `previous_response_id` is
  its first response's id, every turn of it; a conversation its client keeps
  and resends whole each turn (``store: false``, or earlier turns in the
  input: `keeps_its_own_history`) is the opening of its input items (up to
  and including the first user message), as chat's.
- **embeddings**, and requests with nothing stable (empty prompt, no user
  message, token-id prompts, batched prompts), form no session: they take
  the unpinned path.

An explicit session key overrides the prefix: the session headers
(`client_key`: `router.session_header` first, then `router.session_headers`,
the headers agent clients send, in their order), else the request's `user`
field (the router config's affinity key "falls back to the `user` field").
All requests with the same key, model and feature class share one session, so
a client that sends `user` gets one session per end user; send a header per
conversation for finer sessions.

A header rule may name an *agent* header and a *parent* header: a sub-agent's
requests carry the session header of the conversation it works for and its own
agent id (Claude Code, Codex), or their own session and their parent's
(opencode). A sub-agent is a session of its own, and knows its parent's
session id (`ClientKey.relatives`): admission starts it near its parent.

Ids are hex SHA-256 digests (first 32 characters), so whatever a client
sends, the id is a safe NATS subject token and KV key. A header value longer
than `MAX_KEY_CHARS`, or empty, counts as not sent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmgw.core.records import record
from llmgw.core.requests import Feature

STABLE_PROMPT_CHARS = 512
SESSION_ID_CHARS = 32
MAX_KEY_CHARS = 256  # a longer session header value counts as not sent
# The response header that names the session a request was counted in (its id).
SESSION_RESPONSE_HEADER = "x-llmgw-session"

_FEATURE_CLASS = {Feature.CHAT: "chat", Feature.COMPLETIONS: "completions"}
# The class a request's session is counted in: Messages as chat (its session is the chat
# session of its opening), Responses in a class of its own (`chain_session`).
_SESSION_CLASS = {**_FEATURE_CLASS, Feature.MESSAGES: "chat", Feature.RESPONSES: "responses"}
# Content parts that carry text, in a Responses message (`responses_opening`).
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


@dataclass(frozen=True, slots=True)
class SessionRule:
    """One session header, and the headers that say which of its agents sent a request.

    ``agent``: the sub-agent's id within the session (a value equal to the session's is its
    main agent); ``parent``: with ``agent``, the id of the agent that started this one (none:
    the session's main agent); without it, the parent's own value of ``header`` (a sub-agent
    that is a session of its own). Header names are lower case."""

    header: str
    agent: str | None = None
    parent: str | None = None


@record
class ClientKey:
    """What a request's session headers name: its session's key (the session header's value,
    and the agent's within it), its parent's key (a sub-agent's), and the key of the session
    whose shard it shares (its family's root, so a parent's pin and its sub-agents' pins are
    decided by one admission instance); None: its own. Raw client text: only ever hashed."""

    key: tuple[str, ...]
    parent: tuple[str, ...] | None = None
    home: tuple[str, ...] | None = None

    def relatives(self, model: str, feature: Feature) -> tuple[str | None, str | None]:
        """(the parent session's id, the id of the session whose shard this one lives in) for
        a request of `model` and `feature`; None for what it has not."""
        feature_class = _SESSION_CLASS.get(feature)
        if feature_class is None:
            return None, None
        parent = None if self.parent is None else key_session(self.parent, model, feature_class)
        if self.home == self.parent:  # a first-level sub-agent: its parent is the root
            return parent, parent
        home = None if self.home is None else key_session(self.home, model, feature_class)
        return parent, home


def session_rules(session_header: str, rules: Iterable[SessionRule]) -> tuple[SessionRule, ...]:
    """The rules in the order they are tried: `session_header` first (with the agent and
    parent headers of the rule for it, if `rules` has one), then the others in their order."""
    header = session_header.lower()
    rules = tuple(rules)
    own = next((r for r in rules if r.header == header), SessionRule(header))
    return (own, *(r for r in rules if r.header != header))


def _value(headers: Mapping[str, str], name: str | None) -> str | None:
    if name is None:
        return None
    value = headers.get(name)
    if value is None:
        return None
    value = value.strip()
    return value if value and len(value) <= MAX_KEY_CHARS else None


def client_key(headers: Mapping[str, str], rules: Sequence[SessionRule]) -> ClientKey | None:
    """The session key the first rule whose session header the request carries names, or None
    (then `user`, then the opening decide). `headers` looks names up in lower case."""
    for rule in rules:
        session = _value(headers, rule.header)
        if session is None:
            continue
        parent = _value(headers, rule.parent)
        if rule.agent is not None:
            agent = _value(headers, rule.agent)
            if agent is None or agent == session:
                return ClientKey((session,))  # the session's main agent
            if parent is None or parent in (session, agent):
                return ClientKey((session, agent), (session,), (session,))
            return ClientKey((session, agent), (session, parent), (session,))
        if parent is None or parent == session:
            return ClientKey((session,))
        return ClientKey((session,), (parent,), (parent,))
    return None


def key_session(key: tuple[str, ...], model: str, feature_class: str) -> str:
    """The session id of an explicit key (a header's value, `user`; or a session's and its
    agent's) for `model` and `feature_class`."""
    if len(key) == 1:
        return _digest("key", key[0], model, feature_class)
    return _digest("agent", *key, model, feature_class)


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        encoded = part.encode("utf-8", "surrogatepass")
        h.update(len(encoded).to_bytes(8, "big"))  # length-prefixed: no ambiguity between parts
        h.update(encoded)
    return h.hexdigest()[:SESSION_ID_CHARS]


# `json.dumps(value, sort_keys=True, ensure_ascii=False)` (the opening a session id hashes),
# with one encoder for every request (`json.dumps` with arguments makes one per call).
_stable_json = json.JSONEncoder(sort_keys=True, ensure_ascii=False).encode


def stable_prefix(feature: Feature, body: dict[str, Any]) -> str | None:
    """The part of the prompt that stays the same for a whole conversation, or None."""
    if feature is Feature.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        for index, message in enumerate(messages):
            if isinstance(message, dict) and message.get("role") == "user":
                return _stable_json(messages[: index + 1])
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
    client: ClientKey | None = None,
) -> str | None:
    """The request's session id, or None when it forms no session.

    `model` is the canonical model name (aliases resolve to one session); `client` is what
    its session headers name (`client_key`), `header_key` the value of a single session
    header (the same as ``ClientKey((header_key,))``).
    """
    feature_class = _FEATURE_CLASS.get(feature)
    if feature_class is None:
        return None
    if client is not None:
        return key_session(client.key, model, feature_class)
    raw_user = body.get("user")
    user = raw_user if isinstance(raw_user, str) else ""
    explicit = header_key or user
    if explicit:
        return _digest("key", explicit, model, feature_class)
    prefix = stable_prefix(feature, body)
    if prefix is None:
        return None
    return _digest("prefix", user, model, feature_class, prefix)


def responses_opening(items: Sequence[Any]) -> str | None:
    """A Responses conversation's opening, or None: its input items up to and including the
    first user message, each message as its role and text (whether its content came as a string
    or as text parts), the whole as `stable_prefix` encodes chat's. `instructions` are not part
    of it: a chain may send them on its first turn only, and a later turn must map to the same
    session."""
    opening: list[Any] = []
    for item in items:
        if not isinstance(item, dict):
            return None
        if item.get("type", "message") != "message":
            opening.append(item)
            continue
        content = item.get("content")
        if isinstance(content, list) and all(
            isinstance(part, dict) and part.get("type") in _TEXT_PARTS for part in content
        ):
            content = "".join(str(part.get("text", "")) for part in content)
        opening.append({"role": item.get("role"), "content": content})
        if item.get("role") == "user":
            return _stable_json(opening)
    return None


def keeps_its_own_history(items: Sequence[Any], store: bool) -> bool:
    """Whether a Responses request that names no previous response belongs to a conversation
    its client keeps (and so resends whole each turn): it cannot start a chain (``store:
    false``), or its input already holds earlier turns (an assistant message, a function call or
    its output, a reasoning item)."""
    if not store:
        return True
    return any(
        isinstance(item, dict)
        and (item.get("role") == "assistant" or item.get("type", "message") != "message")
        for item in items
    )


def chain_session(
    root: str,
    model: str,
    *,
    opening: str | None = None,
    header_key: str | None = None,
    client: ClientKey | None = None,
) -> str:
    """The session of a Responses conversation, the same for each of its turns wherever it runs:
    the session headers' (as for chat); else, for a conversation its client keeps and resends
    whole (`keeps_its_own_history`: the caller passes its `opening`), that opening's, as chat's;
    else its chain's first response's id, `root`: a chain by `previous_response_id` is a
    conversation of its own even where it opens as another does."""
    if client is not None:
        return key_session(client.key, model, "responses")
    if header_key:
        return _digest("key", header_key, model, "responses")
    if opening is not None:
        return _digest("prefix", "", model, "responses", opening)
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
