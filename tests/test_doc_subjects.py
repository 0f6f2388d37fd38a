"""Every NATS subject the docs name exists in the code: a subject (or a subscription pattern such
as `llmgw.v1.events.pin.>`, or a placeholder such as `<shard>`) in README.md or docs/*.md must
match one that `llmgw.wire` or `llmgw.events` defines. The decision records (docs/adr) keep the
subjects of their day and are not read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmgw import wire
from llmgw.events import EVENT_KINDS, event_subject

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NAMED = re.compile(r"llmgw\.v1(?:\.[A-Za-z0-9_<>*-]+|\.>)*")
ANY = "*"  # one token, whatever it is


def code_subjects() -> set[str]:
    """Every subject the code publishes or listens on, a variable token as `*`."""
    subjects = {v for k, v in vars(wire).items() if k.endswith("_SUBJECT")}
    subjects |= {v + ANY for k, v in vars(wire).items() if k.endswith("_PREFIX")}
    subjects |= {event_subject(kind, ANY) for kind in EVENT_KINDS}
    subjects |= {
        wire.prefix_subjects(ANY),
        wire.prefix_sent_subject(ANY, ANY),
        wire.prefix_held_subject(ANY, ANY),
    }
    assert all(s.startswith("llmgw.v1.") for s in subjects)
    return subjects


def matches(named: str, subject: str) -> bool:
    """Whether `named` (literal tokens, `*`, `<placeholder>`, a final `>`, or a prefix of
    whole tokens) covers `subject`."""
    want, have = named.split("."), subject.split(".")
    for n, token in enumerate(want):
        if token == ">":
            return len(have) > n
        if n >= len(have):
            return False
        if token not in (ANY, have[n]) and not token.startswith("<") and have[n] != ANY:
            return False
    return True  # the whole subject, or a prefix of it (`llmgw.v1.events`)


def named_subjects() -> list[tuple[str, str]]:
    return sorted(
        {
            (doc.relative_to(REPO).as_posix(), name.rstrip("."))
            for doc in DOCS
            for name in NAMED.findall(doc.read_text())
        }
    )


def test_the_docs_name_subjects() -> None:
    assert {doc for doc, _ in named_subjects()} >= {"docs/architecture.md", "docs/events.md"}


@pytest.mark.parametrize(("doc", "named"), named_subjects())
def test_a_subject_the_docs_name_exists(doc: str, named: str) -> None:
    assert any(matches(named, s) for s in code_subjects()), f"{doc}: {named}"


def test_the_matching_rule() -> None:
    subjects = code_subjects()
    assert any(matches("llmgw.v1.admission.request.<shard>", s) for s in subjects)
    assert any(matches("llmgw.v1.events.*.*.iris", s) for s in subjects)
    assert not any(matches("llmgw.v1.admission.done", s) for s in subjects)
    assert not any(matches("llmgw.v1.events.lease.unlisted", s) for s in subjects)
    assert not any(matches("llmgw.v1.events.pin.created.iris.x", s) for s in subjects)
