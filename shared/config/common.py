"""Building blocks shared by the schema modules: strict models, constrained strings, error helper."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

SLUG_PATTERN = r"^[a-z0-9][a-z0-9_-]*$"
# Ids that end up in NATS subjects and KV keys: lowercase, no dots, no spaces.
Slug = Annotated[str, Field(pattern=SLUG_PATTERN, max_length=64)]
# A non-empty name without surrounding whitespace.
Name = Annotated[str, Field(min_length=1, pattern=r"^\S(.*\S)?$")]
Feature = Literal["chat", "completions", "embeddings"]
# The wire APIs a provider serves (`providers[].apis`).
Api = Literal["chat_completions", "completions", "embeddings", "responses", "messages"]
MASK = "***"

Location = tuple[str | int, ...]


class ConfigWarning(UserWarning):
    """A legal but probably unintended setting."""


def fail(problems: list[tuple[Location, str]]) -> None:
    """Raise the problems as one ValidationError whose entries keep their own locations."""
    if problems:
        raise ValidationError.from_exception_data(
            "Config",
            [
                InitErrorDetails(
                    type=PydanticCustomError("config", "{message}", {"message": message}),
                    loc=loc,
                    input=None,
                )
                for loc, message in problems
            ],
        )


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
