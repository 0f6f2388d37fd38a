"""A model's own chat tokenizer, from its Hugging Face files: the tokens an engine computes (and
caches) for a chat request.

`ChatTokenizer(directory)` reads ``tokenizer.json`` (with the ``tokenizers`` package) and
``tokenizer_config.json`` (its ``chat_template``, unless a ``chat_template.jinja`` file beside it
holds the template; its special tokens ``bos_token``, ``eos_token``...; ``add_bos_token`` /
``add_eos_token``). I/O happens there, once; everything after is pure and deterministic.

- `render` renders the chat template as transformers' ``apply_chat_template`` does: Jinja's
  ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
  ``loopcontrols`` extension and the ``{% generation %}`` tag, transformers' ``tojson`` filter
  (no HTML escaping, non-ASCII kept), the ``raise_exception`` and ``strftime_now`` globals, and
  the special tokens, ``messages``, ``tools``, ``documents`` and ``add_generation_prompt`` as
  variables. A template listing named variants picks ``tool_use`` when tools are given (and it
  has one), else ``default``.
- `encode` is the tokenizer's own encoding; ``add_special_tokens`` adds what its post-processor
  adds (BOS...), as for a completions prompt.
- `tokens` is vLLM's chat path: the messages as vLLM hands them to the template (`vllm_messages`:
  text parts joined by newlines, tool-call arguments as objects), rendered, then encoded without
  special tokens (the template writes the BOS it wants).

Errors: `TokenizerFilesError` (missing or unusable files), `ChatTemplateError` (the template
refused the conversation, or the conversation has the wrong shape); both are ValueErrors. Without
the ``tokenizer`` extra (``tokenizers``, ``jinja2``) construction raises ImportError saying how to
install it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2
    import tokenizers

__all__ = ["ChatTemplateError", "ChatTokenizer", "TokenizerFilesError", "vllm_messages"]

_EXTRA = "pip install 'llmgw[tokenizer]'"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")


class TokenizerFilesError(ValueError):
    """The directory lacks a file the tokenizer needs, or a file is not what it should be."""


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: the template raised (``raise_exception``), or the
    messages do not have the shape it or vLLM expects."""


class ChatTokenizer:
    """A model's tokenizer and chat template (see the module docstring). Immutable once built;
    safe to share between tasks (rendering and encoding keep no state)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        tokenizers_module, jinja = _extra()
        root = Path(directory)
        config = _json_file(root / "tokenizer_config.json")
        try:
            self._tokenizer = tokenizers_module.Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise TokenizerFilesError(f"{root / 'tokenizer.json'}: {exc}") from None
        self.special_tokens = _special_tokens(config)
        bos, eos = config.get("add_bos_token"), config.get("add_eos_token")
        if bos is not None or eos is not None:
            self._tokenizer.post_processor = _post_processor(
                tokenizers_module, self._tokenizer, self.special_tokens, bool(bos), bool(eos)
            )
        self._templates = _templates(root, config)
        self._environment = _environment(jinja)
        self._compiled: dict[str, jinja2.Template] = {}

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template applied to `messages` (as given), as ``apply_chat_template`` with
        ``tokenize=False`` does."""
        import jinja2

        template = self._template(tools)
        try:
            return template.render(
                messages=messages,
                tools=list(tools) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template: {exc}") from None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The token ids of `text`."""
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def encode_with_ends(self, text: str) -> tuple[list[int], list[int]]:
        """The token ids of `text` (no special tokens added) and where each ends in it (a
        character offset): what a prefix cache of tokenizations keys tokens by."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return list(encoding.ids), [end for _, end in encoding.offsets]

    def chat_text(self, messages: Any, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The text vLLM's chat path encodes for these messages and tools (`tokens` encodes
        exactly this)."""
        return self.render(vllm_messages(messages), tools, True)

    def tokens(
        self,
        messages: Any,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The tokens vLLM computes for a chat request with these messages and tools."""
        rendered = self.render(vllm_messages(messages), tools, add_generation_prompt)
        return self.encode(rendered, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids` (special tokens included, as vLLM's /detokenize answers)."""
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=False)
        return text

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's token string; ValueError for an id outside the vocabulary."""
        strs = []
        for token_id in ids:
            piece = self._tokenizer.id_to_token(token_id)
            if piece is None:
                raise ValueError(f"token id {token_id} is not in the vocabulary")
            strs.append(piece)
        return strs

    def _template(self, tools: Sequence[Mapping[str, Any]] | None) -> jinja2.Template:
        name = "tool_use" if tools and "tool_use" in self._templates else "default"
        if name not in self._templates:
            raise ChatTemplateError("the tokenizer's chat templates have no `default`")
        compiled = self._compiled.get(name)
        if compiled is None:
            import jinja2

            try:
                compiled = self._environment.from_string(self._templates[name])
            except jinja2.TemplateSyntaxError as exc:
                raise TokenizerFilesError(f"chat template {name!r}: {exc}") from None
            self._compiled[name] = compiled
        return compiled


def vllm_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` as vLLM hands them to a chat template whose content is text: each message's
    text parts joined by newlines (None: empty; other parts left out), an assistant's tool-call
    arguments parsed from their JSON text, and only ``role``, ``content``, ``name``,
    ``tool_calls`` and ``tool_call_id`` kept."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages: must be a non-empty list")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{index}]: must be an object with a string `role`")
        kept: dict[str, Any] = {
            "role": message["role"],
            "content": _text(message.get("content"), index),
        }
        if isinstance(message.get("name"), str):
            kept["name"] = message["name"]
        if message["role"] == "assistant" and isinstance(message.get("tool_calls"), list):
            kept["tool_calls"] = [_tool_call(call, index) for call in message["tool_calls"]]
        if message["role"] == "tool" and "tool_call_id" in message:
            kept["tool_call_id"] = message["tool_call_id"]
        out.append(kept)
    return out


def _text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    raise ChatTemplateError(f"messages[{index}].content: must be a string or a list of parts")


def _tool_call(call: Any, index: int) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        raise ChatTemplateError(
            f"messages[{index}].tool_calls: arguments are not JSON: {function['arguments']!r}"
        ) from None
    return {**call, "function": {**function, "arguments": arguments}}


# -- loading -----------------------------------------------------------------------------------


def _extra() -> tuple[Any, Any]:
    """The ``tokenizers`` and ``jinja2`` modules, or ImportError saying how to get them."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
        import tokenizers
        import tokenizers.processors
    except ImportError as exc:
        raise ImportError(
            f"a model's tokenizer needs the `tokenizers` and `jinja2` packages ({exc.name} is "
            f"missing): {_EXTRA}"
        ) from None
    return tokenizers, jinja2


def _json_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TokenizerFilesError(f"{path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise TokenizerFilesError(f"{path}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerFilesError(f"{path}: not a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, Any]:
    """transformers' ``special_tokens_map``: the special tokens the config sets, as text."""
    found: dict[str, Any] = {}
    for name in (*_SPECIAL, "mask_token"):
        text = _token_text(config.get(name))
        if text is not None:
            found[name] = text
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        found["additional_special_tokens"] = [t for t in map(_token_text, extra) if t]
    return found


def _templates(root: Path, config: Mapping[str, Any]) -> dict[str, str]:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return {"default": jinja_file.read_text(encoding="utf-8")}
    template = config.get("chat_template")
    if isinstance(template, str):
        return {"default": template}
    if isinstance(template, list):  # named variants: [{"name": ..., "template": ...}]
        return {
            item["name"]: item["template"]
            for item in template
            if isinstance(item, Mapping)
            and isinstance(item.get("name"), str)
            and isinstance(item.get("template"), str)
        }
    raise TokenizerFilesError(f"{root}: no chat template (tokenizer_config.json's chat_template)")


def _post_processor(
    module: Any, tokenizer: tokenizers.Tokenizer, special: Mapping[str, Any], bos: bool, eos: bool
) -> Any:
    """What Llama's fast tokenizer builds when the config sets ``add_bos_token`` /
    ``add_eos_token``: ``BOS $A EOS``, each end only when asked for."""
    ends: dict[str, str] = {}
    used = []
    for wanted, name in ((bos, "bos_token"), (eos, "eos_token")):
        if not wanted:
            continue
        token = special.get(name)
        token_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
        if token is None or token_id is None:
            raise TokenizerFilesError(f"add_{name} is set but {name} is not in the vocabulary")
        ends[name] = token
        used.append((token, token_id))

    def sequence(piece: str, type_id: int) -> str:
        parts = [f"{ends['bos_token']}:{type_id}"] if "bos_token" in ends else []
        parts.append(f"{piece}:{type_id}")
        if "eos_token" in ends:
            parts.append(f"{ends['eos_token']}:{type_id}")
        return " ".join(parts)

    return module.processors.TemplateProcessing(
        single=sequence("$A", 0),
        pair=f"{sequence('$A', 0)} {sequence('$B', 1)}",
        special_tokens=used,
    )


def _environment(jinja: Any) -> jinja2.Environment:
    """transformers' chat-template environment (``_compile_jinja_template``)."""

    class GenerationTag(jinja.ext.Extension):  # type: ignore[misc]
        """``{% generation %}...{% endgeneration %}`` marks what the assistant wrote (for
        training masks); rendering keeps its body as it is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> Any:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own filter escapes HTML characters; transformers' does not.
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = jinja.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment  # type: ignore[no-any-return]
