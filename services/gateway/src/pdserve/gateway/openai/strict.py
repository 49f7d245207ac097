"""How the REST bodies parse: strictly (unknown fields refused, no value coerced to another
type), with the unions of their lists told apart before validation, so that an error names
the one element at fault instead of listing why it matched none of the union's shapes.

Messages, items and parts are TypedDicts (plain dicts), not models: they validate several
times faster, which matters for a body of many thousands of messages.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Discriminator, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
OPEN = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


def type_tag(known: frozenset[str], default: str | None = None) -> Any:
    """A discriminator on ``type``: a known type's own shape, anything else ``<other>``.

    Tags are in angle brackets so that error locations can leave them out
    (`pdserve.gateway.openai.parsing.from_validation_error`)."""

    def tag(value: Any) -> str:
        kind = value.get("type", default) if isinstance(value, dict) else None
        return f"<{kind}>" if kind in known else "<other>"

    return Discriminator(tag)


def _text_or_list(value: Any) -> str:
    return "<text>" if isinstance(value, str) else "<list>"


# NOTE: a string or a list, told apart before validation, so an error in a list's item is
# reported alone rather than after "not a valid string".
TEXT_OR_LIST = Discriminator(_text_or_list)


@with_config(OPEN)
class UnsupportedPart(TypedDict):
    """A content part of a type pdserve does not read (images, files, audio): parsed so that
    the refusal can name its type and place."""

    type: str
