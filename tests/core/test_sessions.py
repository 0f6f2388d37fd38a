"""Session ids: one per conversation, stable across turns, always a safe token."""

import re

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.requests import Feature
from llmgw.core.sessions import (
    MAX_KEY_CHARS,
    SESSION_ID_CHARS,
    ClientKey,
    SessionRule,
    chain_session,
    client_key,
    keeps_its_own_history,
    responses_opening,
    session_id,
    session_rules,
)

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


# ---- agent clients' session headers (llmgw.core.sessions.client_key) -------------------------

CLAUDE = SessionRule(
    "x-claude-code-session-id", "x-claude-code-agent-id", "x-claude-code-parent-agent-id"
)
CODEX = SessionRule("session-id", "thread-id", "x-codex-parent-thread-id")
OPENCODE = SessionRule("x-session-id", parent="x-parent-session-id")
RULES = session_rules("x-session-id", [OPENCODE, CLAUDE, CODEX, SessionRule("session_id")])
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40).filter(
    lambda s: s.strip() == s and s != ""
)


def ids(headers, feature=Feature.CHAT, model="m"):
    """(session, parent, home) of a request with these headers, as the edge computes them."""
    client = client_key(headers, RULES)
    if feature is Feature.RESPONSES:  # a chain's session (the edge's Responses API)
        session = chain_session("resp_first", model, client=client)
    else:
        session = session_id(feature, model, chat({"role": "user", "content": "hi"}), client=client)
    parent, home = client.relatives(model, feature) if client else (None, None)
    return session, parent, home


def test_one_claude_code_session_is_one_session_whatever_its_opening():
    a = chat({"role": "user", "content": "fix the bug"})
    b = chat({"role": "system", "content": "compacted"}, {"role": "user", "content": "go on"})
    client = client_key({"x-claude-code-session-id": "c-1"}, RULES)
    assert client == ClientKey(("c-1",))
    assert session_id(Feature.CHAT, "m", a, client=client) == session_id(
        Feature.CHAT, "m", b, client=client
    )
    # the same hash as that value in the session header: pins keyed before stay valid
    assert session_id(Feature.CHAT, "m", a, client=client) == session_id(
        Feature.CHAT, "m", a, header_key="c-1"
    )


def test_a_claude_code_sub_agent_is_its_own_session_whose_parent_is_the_main_agent():
    main, main_parent, main_home = ids({"x-claude-code-session-id": "c-1"})
    sub, parent, home = ids({"x-claude-code-session-id": "c-1", "x-claude-code-agent-id": "a-7"})
    assert (main_parent, main_home) == (None, None)
    assert sub != main and parent == main and home == main
    nested, nested_parent, nested_home = ids(
        {
            "x-claude-code-session-id": "c-1",
            "x-claude-code-agent-id": "a-8",
            "x-claude-code-parent-agent-id": "a-7",
        }
    )
    assert nested not in (main, sub) and nested_parent == sub
    assert nested_home == main  # its family's shard: the root's
    # an agent id equal to the session's, or a parent naming the agent itself: the main agent
    assert ids({"x-claude-code-session-id": "c-1", "x-claude-code-agent-id": "c-1"})[0] == main
    selfish = {"x-claude-code-session-id": "c-1", "x-claude-code-agent-id": "a-9"}
    assert ids({**selfish, "x-claude-code-parent-agent-id": "a-9"})[1] == main


def test_a_codex_thread_shares_its_root_session_and_names_its_parent_thread():
    root, root_parent, _ = ids({"session-id": "s-1", "thread-id": "s-1"}, Feature.RESPONSES)
    assert root_parent is None
    child, parent, home = ids(
        {"session-id": "s-1", "thread-id": "t-2", "x-codex-parent-thread-id": "s-1"},
        Feature.RESPONSES,
    )
    assert child != root and parent == root and home == root
    assert chain_session("resp_x", "m", client=client_key({"session-id": "s-1"}, RULES)) == root
    # earlier releases: `session_id` alone
    assert ids({"session_id": "s-0"})[0] == session_id(
        Feature.CHAT, "m", chat({"role": "user", "content": "x"}), header_key="s-0"
    )


def test_an_opencode_child_session_names_its_parent_session():
    parent_own, _, _ = ids({"x-session-id": "p-1"})
    child, parent, home = ids({"x-session-id": "c-2", "x-parent-session-id": "p-1"})
    assert parent == parent_own and home == parent_own and child != parent_own
    assert ids({"x-session-id": "c-2", "x-parent-session-id": "c-2"})[1] is None


def test_the_session_header_comes_first_then_the_rules_in_their_order():
    both = {"x-session-id": "mine", "x-claude-code-session-id": "c-1", "session-id": "s-1"}
    assert client_key(both, RULES) == ClientKey(("mine",))
    assert client_key({"x-claude-code-session-id": "c-1", "session-id": "s-1"}, RULES) == (
        ClientKey(("c-1",))
    )
    rules = session_rules("x-conversation", [CLAUDE, OPENCODE])
    assert [r.header for r in rules] == [
        "x-conversation",
        "x-claude-code-session-id",
        "x-session-id",
    ]
    # the rule for the session header keeps its agent and parent headers, in first place
    assert session_rules("x-session-id", [CLAUDE, OPENCODE])[0] == OPENCODE
    assert session_rules("X-Session-Id", []) == (SessionRule("x-session-id"),)


def test_empty_or_overlong_values_count_as_not_sent():
    long = "x" * (MAX_KEY_CHARS + 1)
    assert client_key({"x-session-id": "  ", "x-claude-code-session-id": "c-1"}, RULES) == (
        ClientKey(("c-1",))
    )
    assert client_key({"x-session-id": long, "session-id": "s-1"}, RULES) == ClientKey(("s-1",))
    assert client_key({"x-session-id": "x" * MAX_KEY_CHARS}, RULES) is not None
    assert client_key({"x-claude-code-session-id": "c", "x-claude-code-agent-id": long}, RULES) == (
        ClientKey(("c",))
    )
    assert client_key({}, RULES) is None and client_key({"x-other": "v"}, RULES) is None


def test_a_session_headers_request_without_a_stable_feature_forms_no_session():
    client = client_key({"x-session-id": "k"}, RULES)
    assert session_id(Feature.EMBEDDINGS, "m", {"input": "x"}, client=client) is None
    assert client is not None and client.relatives("m", Feature.EMBEDDINGS) == (None, None)


@given(session=TEXT, agent=TEXT, parent=TEXT, model=st.sampled_from(["m", "m.2"]))
def test_a_sub_agents_parent_id_is_the_id_its_parents_own_requests_get(
    session, agent, parent, model
):
    """Whatever the values: the parent a sub-agent names is the session its parent's requests
    are counted in, the family's root is the shard of all its sessions, and every id is a
    safe token."""
    base = {"x-claude-code-session-id": session}
    main = ids(base, model=model)[0]
    parent_own = ids({**base, "x-claude-code-agent-id": parent}, model=model)[0]
    child, named, home = ids(
        {**base, "x-claude-code-agent-id": agent, "x-claude-code-parent-agent-id": parent},
        model=model,
    )
    if agent == session:
        assert child == main and named is None
    elif parent in (session, agent):
        assert named == main and home == main
    else:
        assert named == parent_own and home == main
    child, named, home = ids({"x-session-id": agent, "x-parent-session-id": parent}, model=model)
    if parent != agent:
        assert named == home == ids({"x-session-id": parent}, model=model)[0]
    for sid in (main, parent_own, child, named, home):
        assert sid is None or re.fullmatch(f"[0-9a-f]{{{SESSION_ID_CHARS}}}", sid)


def user(text):
    return {"type": "message", "role": "user", "content": text}


def said(text):
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
    }


DEVELOPER = {"type": "message", "role": "developer", "content": "Be terse."}
LATER = st.lists(
    st.one_of(
        TEXT.map(user),
        TEXT.map(said),
        st.builds(
            lambda call, out: {"type": "function_call_output", "call_id": call, "output": out},
            TEXT,
            TEXT,
        ),
    ),
    max_size=6,
)


def responses_session(items, root="resp_first"):
    return chain_session(root, "m", opening=responses_opening(items))


@given(TEXT, LATER, LATER)
def test_every_turn_of_a_resent_responses_conversation_has_its_openings_session(first, one, other):
    """A conversation its client resends whole each turn: whatever follows the first user
    message, and whatever response id each turn gets, the session is the opening's."""
    opening = [DEVELOPER, user(first)]
    assert responses_session([*opening, *one], "resp_a") == responses_session(
        [*opening, *other], "resp_b"
    )


@given(TEXT, TEXT)
def test_responses_conversations_with_other_openings_have_other_sessions(a, b):
    assert (responses_session([user(a)]) == responses_session([user(b)])) == (a == b)
    assert responses_session([user(a)]) != responses_session([DEVELOPER, user(a)])


def test_a_responses_opening_is_its_text_however_the_content_came():
    as_string = [user("hello"), said("hi")]
    as_parts = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "hel"},
                {"type": "input_text", "text": "lo"},
            ],
        }
    ]
    assert responses_opening(as_string) == responses_opening(as_parts)
    image = {
        "role": "user",
        "content": [{"type": "input_image", "image_url": "https://x/a.png"}],
    }
    assert responses_opening([image]) not in (None, responses_opening(as_string))


def test_a_responses_conversation_without_a_user_message_is_its_chains():
    only_developer = [DEVELOPER]
    assert responses_opening(only_developer) is None
    assert responses_session(only_developer, "resp_a") != responses_session(
        only_developer, "resp_b"
    )
    assert responses_session(only_developer, "resp_a") == chain_session("resp_a", "m")


def test_a_responses_session_is_not_the_chat_session_of_the_same_opening():
    """Responses is a session class of its own: its turns differ from chat's in form."""
    opening = [user("hello")]
    assert responses_session(opening) != session_id(
        Feature.CHAT, "m", chat({"role": "user", "content": "hello"})
    )


def test_a_responses_request_keeps_its_own_history_when_it_cannot_chain_or_carries_turns():
    assert keeps_its_own_history([user("hi")], store=False)  # nothing to chain from
    assert not keeps_its_own_history([DEVELOPER, user("hi")], store=True)  # may start a chain
    assert keeps_its_own_history([user("hi"), said("hello"), user("and?")], store=True)
    tool_output = {"type": "function_call_output", "call_id": "c", "output": "42"}
    assert keeps_its_own_history([user("hi"), tool_output], store=True)
