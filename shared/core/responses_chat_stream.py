"""A chat completions SSE stream as the Responses API's typed events, chunk by chunk. Pure.

`ChatToResponsesStream` reads the stream of a provider that speaks only chat completions
(`llmgw.core.responses_chat` translated the request) and emits what a Responses stream sends:
``response.created``, ``response.in_progress``, then per output item ``.added``, its deltas
(text, function call arguments) and ``.done`` events, and at the chat stream's ``[DONE]``
``response.completed`` (or ``response.incomplete`` after a length stop) with the whole
response and its usage. Events carry consecutive ``sequence_number``s; chunks may be cut
anywhere (the output does not depend on where: tests/core/test_responses_chat.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from llmgw.core.responses import Turn, compact_json, response_usage
from llmgw.core.responses_chat import (
    call_item,
    chat_usage,
    end_status,
    message_item,
    response_skeleton,
)
from llmgw.core.usage import Usage

__all__ = ["ChatToResponsesStream"]


class ChatToResponsesStream:
    """A chat completions SSE stream in, the Responses API's events out (see the module
    docstring). Same reader interface as `llmgw.core.responses.ResponsesStream`: `feed` and
    `finish` return the bytes to forward; `response`, `completed` and `usage` once it ended."""

    def __init__(
        self,
        body: dict[str, Any],
        response_id: str,
        turn: Turn,
        clock: Callable[[], float],
    ) -> None:
        self._body = body
        self._turn = turn
        self._id = response_id
        self._suffix = response_id.removeprefix("resp_")
        self._clock = clock
        self._buffer = b""
        self._sequence = 0
        self._started = False
        self._live: dict[str, Any] | None = None  # the response object being built
        self._text: dict[str, Any] | None = None  # the open message item: index, text
        self._calls: dict[int, dict[str, Any]] = {}  # open function calls by chat index
        self._finish_reason: Any = None
        self._chat_usage: Any = None
        self.response: dict[str, Any] | None = None
        self.completed = False
        self.usage: Usage | None = None
        self.events = 0  # the chat stream's data events read (one per token for most engines)

    # -- SSE plumbing -------------------------------------------------------------------------
    def _emit(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        encoded = compact_json(payload)
        return f"event: {kind}\ndata: {encoded}\n\n".encode()

    def feed(self, chunk: bytes) -> bytes:
        self._buffer += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
        out: list[bytes] = []
        while (end := self._buffer.find(b"\n\n")) >= 0:
            event, self._buffer = self._buffer[:end], self._buffer[end + 2 :]
            data = b"\n".join(
                line[5:].removeprefix(b" ")
                for line in event.split(b"\n")
                if line.startswith(b"data:")
            )
            if data:
                self.events += 1
                out.append(self._data(data))
        return b"".join(out)

    def finish(self) -> bytes:
        return b""

    # -- translation --------------------------------------------------------------------------
    def _data(self, data: bytes) -> bytes:
        if data.strip() == b"[DONE]":
            return self._close()
        try:
            chunk = json.loads(data)
        except ValueError:
            return b""
        if not isinstance(chunk, dict) or self.completed:
            return b""
        if "error" in chunk:  # the provider's error mid-stream: the relay reports the break
            return b""
        out: list[bytes] = []
        if not self._started:
            self._started = True
            self._live = response_skeleton(
                self._body,
                self._id,
                self._turn,
                int(chunk.get("created") or self._clock()),
                chunk.get("model") or self._body.get("model"),
            )
            out.append(self._emit("response.created", response=dict(self._live)))
            out.append(self._emit("response.in_progress", response=dict(self._live)))
        if chunk.get("usage"):
            self._chat_usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out.append(self._text_delta(delta["content"]))
            for call in delta.get("tool_calls") or ():
                out.append(self._call_delta(call))
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return b"".join(out)

    def _output(self) -> list[Any]:
        assert self._live is not None
        output: list[Any] = self._live["output"]
        return output

    def _text_delta(self, text: str) -> bytes:
        out: list[bytes] = []
        if self._text is None:
            index = len(self._output())
            item_id = f"msg_{self._suffix}"
            self._text = {"index": index, "id": item_id, "text": ""}
            self._output().append(message_item(item_id, "", "in_progress"))
            item = message_item(item_id, "", "in_progress")
            item["content"] = []
            out.append(self._emit("response.output_item.added", output_index=index, item=item))
            out.append(
                self._emit(
                    "response.content_part.added",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                )
            )
        self._text["text"] += text
        out.append(self._text_delta_event(text))
        return b"".join(out)

    def _text_delta_event(self, text: str) -> bytes:
        """The ``response.output_text.delta`` event of `text`, byte for byte what `_emit` makes
        of it (`delta_event`), without building and encoding its object: one per token."""
        assert self._text is not None
        sequence, self._sequence = self._sequence, self._sequence + 1
        return delta_event(sequence, self._text["id"], self._text["index"], text)

    def _call_delta(self, call: dict[str, Any]) -> bytes:
        out: list[bytes] = []
        position = call.get("index", 0)
        function = call.get("function") or {}
        open_call = self._calls.get(position)
        if open_call is None:
            index = len(self._output())
            item_id = f"fc_{self._suffix}_{position}"
            open_call = {
                "index": index,
                "id": item_id,
                "call_id": call.get("id") or f"call_{self._suffix}_{position}",
                "name": function.get("name") or "",
                "arguments": "",
            }
            self._calls[position] = open_call
            item = call_item(item_id, open_call["call_id"], open_call["name"], "", "in_progress")
            self._output().append(item)
            out.append(
                self._emit("response.output_item.added", output_index=index, item=dict(item))
            )
        arguments = function.get("arguments") or ""
        if arguments:
            open_call["arguments"] += arguments
            out.append(
                self._emit(
                    "response.function_call_arguments.delta",
                    item_id=open_call["id"],
                    output_index=open_call["index"],
                    delta=arguments,
                )
            )
        return b"".join(out)

    def _close(self) -> bytes:
        if self._live is None or self.completed:
            return b""
        out: list[bytes] = []
        output = self._output()
        if self._text is not None:
            text, index, item_id = self._text["text"], self._text["index"], self._text["id"]
            part = {"type": "output_text", "text": text, "annotations": []}
            out.append(
                self._emit(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            out.append(
                self._emit(
                    "response.content_part.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
            output[index] = message_item(item_id, text)
            out.append(
                self._emit("response.output_item.done", output_index=index, item=output[index])
            )
        for open_call in self._calls.values():
            index = open_call["index"]
            out.append(
                self._emit(
                    "response.function_call_arguments.done",
                    item_id=open_call["id"],
                    output_index=index,
                    arguments=open_call["arguments"],
                )
            )
            output[index] = call_item(
                open_call["id"],
                open_call["call_id"],
                open_call["name"],
                open_call["arguments"],
                "completed",
            )
            out.append(
                self._emit("response.output_item.done", output_index=index, item=output[index])
            )
        end_status(self._live, self._finish_reason)
        self._live["usage"] = chat_usage(self._chat_usage)
        kind = (
            "response.completed" if self._live["status"] == "completed" else "response.incomplete"
        )
        out.append(self._emit(kind, response=self._live))
        self.response = self._live
        self.completed = True
        self.usage = response_usage(self._live)
        return b"".join(out)


_DELTA_HEAD = (
    'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    '"sequence_number":'
)


def delta_event(sequence: int, item_id: str, output_index: int, text: str) -> bytes:
    """An ``response.output_text.delta`` SSE event as `ChatToResponsesStream._emit` encodes it
    (``json.dumps`` with ``(",", ":")`` separators, ``ensure_ascii=False``; keys in its order),
    from a template and the encoded strings alone."""
    return (
        f"{_DELTA_HEAD}{sequence},"
        f'"item_id":{compact_json(item_id)},"output_index":{output_index},'
        f'"content_index":0,"delta":{compact_json(text)},"logprobs":[]}}\n\n'
    ).encode()
