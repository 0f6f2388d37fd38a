"""`llmgw.chat_tokenizer` on real tokenizer files built at test time (tests/tokenizer_files.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tokenizer_files import write_tokenizer

from llmgw.chat_tokenizer import (
    ChatTemplateError,
    ChatTokenizer,
    TokenizerFilesError,
    vllm_messages,
)

SYSTEM = {"role": "system", "content": "You are a careful assistant who answers briefly."}
QUESTION = {"role": "user", "content": "What is a prefix cache?"}
REPLY = {"role": "assistant", "content": "It keeps the KV blocks of prompts it computed."}
FOLLOW_UP = {"role": "user", "content": "And why does it help?"}


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return ChatTokenizer(write_tokenizer(tmp_path_factory.mktemp("chatml"), "chatml"))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return ChatTokenizer(write_tokenizer(tmp_path_factory.mktemp("llama3"), "llama3"))


def test_render_writes_chatml_as_transformers_does(chatml: ChatTokenizer) -> None:
    # trim_blocks and lstrip_blocks: the template's own newlines and indents leave no trace.
    assert chatml.render([SYSTEM, QUESTION]) == (
        "<|im_start|>system\nYou are a careful assistant who answers briefly.<|im_end|>\n"
        "<|im_start|>user\nWhat is a prefix cache?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert chatml.render([QUESTION], add_generation_prompt=False) == (
        "<|im_start|>user\nWhat is a prefix cache?<|im_end|>\n"
    )


def test_tools_are_rendered_with_transformers_tojson(chatml: ChatTokenizer) -> None:
    tool = {
        "type": "function",
        "function": {"name": "lookup", "description": "Café <b>menu</b> & prices"},
    }
    rendered = chatml.render([QUESTION], tools=[tool])
    # No HTML escaping, non-ASCII kept, json.dumps' default separators.
    assert rendered.startswith(
        "<|im_start|>system\n# Tools\n"
        '{"type": "function", "function": {"name": "lookup", '
        '"description": "Café <b>menu</b> & prices"}}\n'
        "<|im_end|>\n<|im_start|>user\n"
    )


def test_the_template_sees_the_special_tokens_and_its_raise_exception_is_an_error(
    llama3: ChatTokenizer,
) -> None:
    assert llama3.render([SYSTEM, QUESTION]) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "You are a careful assistant who answers briefly.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is a prefix cache?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    with pytest.raises(ChatTemplateError, match="the first message must be the system prompt"):
        llama3.render([QUESTION])


def test_tokens_are_the_rendered_chat_encoded_without_added_special_tokens(
    llama3: ChatTokenizer,
) -> None:
    bos = llama3.encode("<|begin_of_text|>")
    assert len(bos) == 1
    tokens = llama3.tokens([SYSTEM, QUESTION])
    assert tokens == llama3.encode(llama3.render([SYSTEM, QUESTION]))
    assert tokens[:1] == bos and tokens[1:2] != bos  # the template's BOS, once
    # A prompt encoded with special tokens gets the BOS the config asks for (add_bos_token).
    assert llama3.encode("Hello!", add_special_tokens=True) == bos + llama3.encode("Hello!")


def test_tokens_are_deterministic_across_instances(tmp_path: Path) -> None:
    directory = write_tokenizer(tmp_path / "tok", "chatml")
    conversation = [SYSTEM, QUESTION, REPLY, FOLLOW_UP]
    first, second = ChatTokenizer(directory), ChatTokenizer(directory)
    assert first.tokens(conversation) == second.tokens(conversation) == first.tokens(conversation)
    assert first.decode(first.tokens(conversation)) == first.render(conversation)


def test_each_turn_of_a_chatml_conversation_extends_the_previous_turns_tokens(
    chatml: ChatTokenizer,
) -> None:
    turns = [[SYSTEM, QUESTION], [SYSTEM, QUESTION, REPLY, FOLLOW_UP]]
    asked, next_turn = (chatml.tokens(turn) for turn in turns)
    # The previous request, its generation prompt included, is a prefix of the next one...
    assert next_turn[: len(asked)] == asked
    # ...and so is the previous conversation closed at its message boundary.
    closed = chatml.tokens([SYSTEM, QUESTION, REPLY], add_generation_prompt=False)
    assert next_turn[: len(closed)] == closed and len(asked) < len(closed) < len(next_turn)


def test_vllm_messages_flatten_text_parts_and_parse_tool_call_arguments() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42", "extra": "dropped"},
    ]
    assert vllm_messages(messages) == [
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]"):
        vllm_messages([{"content": "no role"}])


def test_named_templates_pick_tool_use_when_tools_are_given(tmp_path: Path) -> None:
    directory = write_tokenizer(tmp_path / "tok", "chatml")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "plain"},
        {"name": "tool_use", "template": "{{ tools | length }} tools"},
    ]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = ChatTokenizer(directory)
    assert tokenizer.render([QUESTION]) == "plain"
    assert tokenizer.render([QUESTION], tools=[{"type": "function"}]) == "1 tools"


def test_a_chat_template_jinja_file_wins_over_the_config_with_transformers_extensions(
    tmp_path: Path,
) -> None:
    directory = write_tokenizer(tmp_path / "tok", "chatml")
    (directory / "chat_template.jinja").write_text(
        "{% generation %}{{ messages | length }}{% endgeneration %} messages"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}, {{ m.role }}"
        "{% endfor %}, {{ strftime_now('%Y') | length }}"
    )
    assert ChatTokenizer(directory).render([QUESTION, REPLY]) == "2 messages, user, 4"


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json"),
        (lambda d: (d / "tokenizer_config.json").unlink(), "tokenizer_config.json"),
        (lambda d: (d / "tokenizer_config.json").write_text("{}"), "no chat template"),
        (lambda d: (d / "tokenizer_config.json").write_text("[1]"), "not a JSON object"),
    ],
    ids=["no-tokenizer-json", "no-config", "no-template", "config-not-an-object"],
)
def test_unusable_files_are_a_clear_error(tmp_path: Path, break_it, message: str) -> None:  # type: ignore[no-untyped-def]
    directory = write_tokenizer(tmp_path / "tok", "chatml")
    break_it(directory)
    with pytest.raises(TokenizerFilesError, match=message):
        ChatTokenizer(directory)


def test_without_the_extra_the_error_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = write_tokenizer(tmp_path / "tok", "chatml")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` fails
    with pytest.raises(ImportError, match=r"pip install 'llmgw\[tokenizer\]'"):
        ChatTokenizer(directory)
