"""config/example.yaml sets every field of the config schema, each at its nesting.

The file promises every field with a comment (its header, docs/config.md, the README), so a field
added to the schema without a line there fails here, named by its dotted path
(`admission.shards`, `providers[].strategy`, `profiles.*.timeouts.dial`). Lists and maps of
sections count the union of their entries' keys. An optional section the file leaves null
(`nats.tls`, `fleet.kubernetes`) lists its fields as commented-out lines right below it, at its
own indentation (`#  key: value`); those lines count, and uncommented they are valid config too.
"""

import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from llmgw.config import Config, config_from_dict, load_config
from llmgw.config.loader import _unwrap  # X of `X | None` and of `Annotated[X, ...]`

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "example.yaml"

_NULL_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_]*): null\b")
_COMMENTED_KEY = re.compile(r"^(?P<indent> *)#(?P<rest> +[A-Za-z_][A-Za-z0-9_]*:.*)$")


def with_alternatives(text: str) -> str:
    """`text` with each run of commented-out `key: value` lines right below a `key: null` line
    (at that line's indentation) uncommented in the null's place."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        null = _NULL_KEY.match(lines[i])
        block: list[str] = []
        j = i + 1
        while null is not None and j < len(lines):
            commented = _COMMENTED_KEY.match(lines[j])
            if commented is None or commented["indent"] != null["indent"]:
                break
            block.append(f"{commented['indent']} {commented['rest']}")
            j += 1
        if null is not None and block:
            out += [f"{null['indent']}{null['key']}:", *block]
            i = j
        else:
            out.append(lines[i])
            i += 1
    return "\n".join(out) + "\n"


def _section(annotation: Any) -> type[BaseModel] | None:
    annotation = _unwrap(annotation)
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


def missing_fields(model: type[BaseModel], values: list[Any], path: str = "") -> list[str]:
    """The dotted paths of `model`'s fields (recursively) that none of `values` sets."""
    missing = []
    for name, field in model.model_fields.items():
        where = f"{path}.{name}" if path else name
        present = [v[name] for v in values if isinstance(v, dict) and name in v]
        if not present:
            missing.append(where)
            continue
        annotation = _unwrap(field.annotation)
        origin = typing.get_origin(annotation)
        args = typing.get_args(annotation)
        if (section := _section(annotation)) is not None:
            missing += missing_fields(section, [v for v in present if v is not None], where)
        elif origin is list and (item := _section(args[0])) is not None:
            entries = [entry for v in present for entry in v or ()]
            missing += missing_fields(item, entries, f"{where}[]")
        elif origin is dict and (item := _section(args[1])) is not None:
            entries = [entry for v in present for entry in (v or {}).values()]
            missing += missing_fields(item, entries, f"{where}.*")
    return missing


def example_missing(text: str) -> list[str]:
    return missing_fields(Config, [yaml.safe_load(with_alternatives(text))])


def test_example_yaml_sets_every_field_of_the_schema() -> None:
    missing = example_missing(EXAMPLE.read_text())
    assert not missing, f"config/example.yaml lacks: {', '.join(missing)}"


@pytest.mark.parametrize(
    ("line", "path"),
    [
        ("  shards: 32\n", "admission.shards"),
        ("  models_refresh: 15s\n", "fleet.models_refresh"),
        ("    strategy: null\n", "providers[].strategy"),
        ("    capacity: 256\n", "endpoints[].capacity"),
        (
            "    timeouts: {dial: 1s, response_header: 10s, first_token: 20s, idle: 30s, total: 5m}\n",
            "profiles.*.timeouts.dial",
        ),
        ("  #  verify: true                 # verify the server certificate\n", "nats.tls.verify"),
        (
            "  #  port_name: null              # the slice port to use (null: the first)\n",
            "fleet.kubernetes.port_name",
        ),
    ],
)
def test_a_field_taken_out_of_the_example_is_named(line: str, path: str) -> None:
    text = EXAMPLE.read_text()
    assert text.count(line) == 1, f"the example no longer has {line!r}: update this test"
    assert path in example_missing(text.replace(line, ""))


def test_the_example_and_its_commented_alternatives_are_valid_config() -> None:
    pytest.importorskip("llmgw.services.sim.params")  # `simulate` blocks are checked by it
    config = load_config(EXAMPLE, env={})
    assert config.nats.tls is None and config.fleet.kubernetes is None
    alternatives = config_from_dict(
        yaml.safe_load(with_alternatives(EXAMPLE.read_text())), "<alternatives>", env={}
    )
    assert alternatives.nats.tls is not None and alternatives.nats.tls.verify
    assert alternatives.fleet.kubernetes is not None
    assert alternatives.fleet.kubernetes.provider == "iris"
