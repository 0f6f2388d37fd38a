"""Session ids: one per conversation, stable across turns, always a safe token."""

import re

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.requests import Feature
from llmgw.core.sessions import SESSION_ID_CHARS, session_id

SYSTEM = {"role": "system", "content": "You are terse."}


def chat(*messages, **extra):
    return {"model": "m", "messages": list(messages), **extra}


def test_every_turn_of_a_conversation_has_the_same_session():
    turn1 = chat(SYSTEM, {"role": "user", "content": "Plan a trip"})
    turn2 = chat(
        SYSTEM,
        {"role": "user", "content": "Plan a trip"},
        {"role": "assistant", "content": "Where to?"},
        {"role": "user", "content": "Lisbon"},
    )
    assert session_id(Feature.CHAT, "m", turn1) == session_id(Feature.CHAT, "m", turn2) is not None


def test_different_openings_models_or_features_are_different_sessions():
    a = chat({"role": "user", "content": "Plan a trip"})
    b = chat({"role": "user", "content": "Write a poem"})
    ids = {
        session_id(Feature.CHAT, "m", a),
        session_id(Feature.CHAT, "m", b),
        session_id(Feature.CHAT, "other", a),
        session_id(Feature.COMPLETIONS, "m", {"prompt": "Plan a trip"}),
    }
    assert len(ids) == 4


def test_completions_share_a_session_while_the_prompt_grows():
    first = {"prompt": "Transcript:\nUser: hi\n" + "x" * 600}
    later = {"prompt": first["prompt"] + "\nAssistant: hello\nUser: more"}
    assert session_id(Feature.COMPLETIONS, "m", first) == session_id(
        Feature.COMPLETIONS, "m", later
    )


def test_explicit_header_then_user_field_override_the_prefix():
    a = chat({"role": "user", "content": "one"})
    b = chat({"role": "user", "content": "two"})
    assert session_id(Feature.CHAT, "m", a, header_key="conv-7") == session_id(
        Feature.CHAT, "m", b, header_key="conv-7"
    )
    assert session_id(Feature.CHAT, "m", {**a, "user": "u1"}) == session_id(
        Feature.CHAT, "m", {**b, "user": "u1"}
    )
    assert session_id(Feature.CHAT, "m", {**a, "user": "u1"}) != session_id(
        Feature.CHAT, "m", {**a, "user": "u2"}
    )


def test_requests_without_a_stable_prefix_form_no_session():
    assert session_id(Feature.EMBEDDINGS, "m", {"input": "x"}) is None
    assert session_id(Feature.EMBEDDINGS, "m", {"input": "x"}, header_key="k") is None
    assert session_id(Feature.CHAT, "m", chat({"role": "system", "content": "only"})) is None
    assert session_id(Feature.COMPLETIONS, "m", {"prompt": ""}) is None
    assert session_id(Feature.COMPLETIONS, "m", {"prompt": [[1, 2, 3]]}) is None


@given(key=st.text(), user=st.text(), content=st.text(min_size=1))
def test_ids_are_safe_tokens_whatever_the_client_sends(key, user, content):
    body = chat({"role": "user", "content": content}, user=user)
    for header in (key, None):
        sid = session_id(Feature.CHAT, "m.with.dots", body, header_key=header)
        assert sid is not None and re.fullmatch(f"[0-9a-f]{{{SESSION_ID_CHARS}}}", sid)
