"""tests/timing.py's `eventually`: what every test waits with must fail when its condition
never holds, and pass on the first truthy answer."""

from __future__ import annotations

import itertools

import pytest
from timing import eventually


async def test_the_first_truthy_answer_is_returned_plain_or_awaited() -> None:
    counter = itertools.count()
    assert await eventually(lambda: next(counter) >= 3 and "ready", 1.0) == "ready"

    async def later() -> int | None:
        value = next(counter)
        return value if value >= 6 else None

    assert await eventually(later, 1.0, interval=0.001) == 6


async def test_a_condition_that_never_holds_fails_naming_it() -> None:
    with pytest.raises(AssertionError, match=r"not within 0\.05 s: the thing"):
        await eventually(lambda: False, 0.05, "the thing")

    def never() -> bool:
        return False

    with pytest.raises(AssertionError, match="never"):
        await eventually(never, 0.02)


async def test_exceptions_named_as_not_yet_are_retried_and_the_last_is_reported() -> None:
    attempts = itertools.count()

    def flaky() -> bool:
        if next(attempts) < 3:
            raise ConnectionError("between leaders")
        return True

    assert await eventually(flaky, 1.0, interval=0.001, ignoring=(ConnectionError,))

    def down() -> bool:
        raise ConnectionError("still down")

    with pytest.raises(AssertionError, match="still down"):
        await eventually(down, 0.02, ignoring=(ConnectionError,))
    with pytest.raises(ConnectionError):  # not named: raised at once
        await eventually(down, 1.0)
