"""The parts of a Hugging Face ``tokenizer_config.json`` that pdserve uses."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""Named special tokens; a chat template sees each one that is set as a variable."""


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """Settings read from ``tokenizer_config.json`` (all optional).

    Attributes:
        special_tokens: Named special tokens by key (``"bos_token" -> "<s>"``), only those set.
        add_bos_token: Whether encoding adds the BOS token; None when the file does not say.
            Only consulted when ``tokenizer.json`` has no post-processor, because a
            post-processor, when present, already decides (as in transformers).
        add_eos_token: Like `add_bos_token`, for EOS at the end.
        chat_template: The Jinja chat template, if the file carries one.
    """

    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        unknown = set(self.special_tokens) - set(SPECIAL_TOKEN_KEYS)
        if unknown:
            raise ValueError(f"unknown special token keys: {sorted(unknown)}")

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text, if set."""
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """The EOS token's text, if set."""
        return self.special_tokens.get("eos_token")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TokenizerConfig:
        """Parses the JSON object of a ``tokenizer_config.json``.

        Special tokens may be plain strings or ``{"content": ...}`` objects (serialized
        ``AddedToken``s). A list of named chat templates resolves to the one named
        ``"default"``, else the first.

        Raises:
            ValueError: If a field has a type that cannot be understood.
        """
        special_tokens: dict[str, str] = {}
        for key in SPECIAL_TOKEN_KEYS:
            token = _token_text(data.get(key), key)
            if token is not None:
                special_tokens[key] = token
        return cls(
            special_tokens=special_tokens,
            add_bos_token=_optional_bool(data.get("add_bos_token"), "add_bos_token"),
            add_eos_token=_optional_bool(data.get("add_eos_token"), "add_eos_token"),
            chat_template=_chat_template(data.get("chat_template")),
        )


def _token_text(value: Any, key: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise ValueError(f"{key} must be a string or an object with 'content', got {value!r}")


def _optional_bool(value: Any, key: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"{key} must be a boolean, got {value!r}")


def _chat_template(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, list) and value:
        named = {
            entry.get("name"): entry.get("template")
            for entry in value
            if isinstance(entry, Mapping) and isinstance(entry.get("template"), str)
        }
        if "default" in named:
            return str(named["default"])
        if named:
            return str(next(iter(named.values())))
    raise ValueError("chat_template must be a string or a list of {name, template} objects")
