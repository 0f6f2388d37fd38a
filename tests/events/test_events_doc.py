"""docs/events.md against the code, both ways: every kind with its publishers and subject token
(`EVENT_KINDS`), the envelope and the version, every field of every kind with its type, the
reports' fields, and the JSON examples (a kind, field or version changed on one side only
fails here). tests/events/test_events_e2e.py runs the doc's example subscriber."""

from __future__ import annotations

import json
import re
import types
import typing
from typing import Any, Literal

import pytest
from event_doc import Section, quoted, section, sections
from pydantic import BaseModel

from llmgw.events import EVENT_KINDS, Event, EventName, Publisher, RoutingEvent, parse_event
from llmgw.load import EndpointReport, PoolReport

ENVELOPE = set(RoutingEvent.model_fields)
MODELS = {kind.model for kind in EVENT_KINDS.values()}


def doc_type(annotation: Any) -> str:
    """How the doc writes a field's type."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (types.UnionType, typing.Union) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return f"{doc_type(inner)} or null"
    if origin is Literal:
        if all(isinstance(a, EventName) for a in args):
            return "string"
        (value,) = args
        return f"`{value}`"
    if origin is tuple and args[1:] == (Ellipsis,):
        return f"list of {doc_type(args[0])}s"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"`{annotation.__name__}`"
    names = {str: "string", int: "integer", float: "number", bool: "boolean", EventName: "string"}
    return names[annotation]


def field_rows(table: list[list[str]]) -> dict[str, str]:
    """field -> type, from a `| field | type | meaning |` table (one row may name several)."""
    rows = {}
    for name_cell, type_cell, *_ in table:
        for name in quoted(name_cell):
            rows[name] = type_cell
    return rows


def kind_sections() -> list[Section]:
    fields_at = [s.heading for s in sections()].index("Fields per kind")
    found = []
    for s in sections()[fields_at + 1 :]:
        if s.level <= 2:
            break
        found.append(s)
    return found


def test_the_kinds_table_is_every_kind_with_its_token_and_publishers() -> None:
    documented = {}
    for kind, token, publishers, when in section("Kinds").table():
        assert when, kind
        (name,) = quoted(kind)
        (field,) = quoted(token)
        documented[name] = (field, set(re.split(r",\s*", publishers)))
    in_code = {
        str(name): (kind.token, {str(p) for p in kind.publishers})
        for name, kind in EVENT_KINDS.items()
    }
    assert documented == in_code
    assert set(EVENT_KINDS) == set(EventName)
    assert {p for _, ps in documented.values() for p in ps} <= {str(p) for p in Publisher}


def test_the_kinds_table_covers_the_union_and_names_string_fields_as_tokens() -> None:
    (union, _) = typing.get_args(Event)
    assert set(typing.get_args(union)) == MODELS  # parse_event reads every kind, and no other
    for name, kind in EVENT_KINDS.items():
        model: type[BaseModel] = kind.model
        *path, last = kind.token.split(".")
        for step in path:
            model = model.model_fields[step].annotation
        assert model.model_fields[last].annotation is str, name


def test_the_envelope_is_every_common_field_and_the_version() -> None:
    documented = field_rows(section("The envelope").table())
    assert set(documented) == ENVELOPE
    for name, field in RoutingEvent.model_fields.items():
        assert documented[name] == doc_type(field.annotation), name
    assert documented["v"] == f"`{RoutingEvent.model_fields['v'].default}`"
    # Every kind is at the envelope's version (a kind may not pin another `v`).
    assert {m.model_fields["v"].default for m in MODELS} == {2}


@pytest.mark.parametrize("heading", [s.heading for s in kind_sections()])
def test_each_kind_section_lists_its_models_fields_with_their_types(heading: str) -> None:
    match = re.fullmatch(r"(.+) \(`(\w+)`\)", heading)
    assert match, heading
    kinds = set(quoted(match.group(1)))
    (model,) = [m for m in MODELS if m.__name__ == match.group(2)]
    assert kinds == {str(k) for k, kind in EVENT_KINDS.items() if kind.model is model}
    event_values = typing.get_args(model.model_fields["event"].annotation)
    assert kinds == {str(v) for v in event_values}
    documented = field_rows(section(heading).table())
    own = {n: f for n, f in model.model_fields.items() if n not in ENVELOPE}
    assert set(documented) == set(own)
    for name, field in own.items():
        assert documented[name] == doc_type(field.annotation), (heading, name)


def test_every_kind_is_in_exactly_one_kind_section() -> None:
    headed = [k for s in kind_sections() for k in quoted(s.heading.split(" (")[0])]
    assert sorted(headed) == sorted(str(k) for k in EventName)


@pytest.mark.parametrize("report", [EndpointReport, PoolReport], ids=lambda r: r.__name__)
def test_the_reports_fields_are_documented(report: type[BaseModel]) -> None:
    documented = field_rows(section(f"`{report.__name__}`").tables()[0])
    assert set(documented) == set(report.model_fields)
    assert documented["v"] == f"`{report.model_fields['v'].default}`"


def test_the_json_examples_are_events_with_real_fields() -> None:
    text = "\n".join(s.body for s in sections())
    examples = [
        json.loads(block)
        for block in re.findall(r"^```json\n(.*?)^```", text, flags=re.S | re.M)
        if '"event"' in block
    ]
    assert len(examples) >= 4
    for example in examples:
        event = parse_event(json.dumps(example))
        assert set(example) <= set(type(event).model_fields), example["event"]
        if "report" in example:
            report = type(event).model_fields["report"].annotation
            assert set(example["report"]) <= set(report.model_fields)
