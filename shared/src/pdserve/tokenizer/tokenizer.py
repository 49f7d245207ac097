"""`Tokenizer`: a Hugging Face ``tokenizer.json`` plus the model's special tokens and chat template.

It loads from a model directory, or from the file contents alone: the gateway has no access
to the model's files and receives them from a prefill instance (``GetModelInfo``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
import tokenizers

from pdserve.tokenizer.chat_template import ChatTemplate, ChatTemplateError, ToolSupport
from pdserve.tokenizer.config import TokenizerConfig

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"

log = structlog.get_logger()


class Tokenizer:
    """Text <-> token ids, special tokens and chat prompts for one model.

    Args:
        tokenizer_json: Contents of ``tokenizer.json``.
        config: Settings from ``tokenizer_config.json``; defaults to none set.
        chat_template: Jinja chat template; overrides ``config.chat_template`` when given.
        eos_token_ids: Extra ids that end generation (e.g. from ``generation_config.json``),
            added after the EOS token named in `config`.

    Raises:
        ValueError: If ``tokenizer.json`` cannot be parsed, or the BOS/EOS token named in
            `config` is not in the vocabulary.
        ChatTemplateError: If the chat template does not compile.
    """

    def __init__(
        self,
        tokenizer_json: str,
        config: TokenizerConfig | None = None,
        *,
        chat_template: str | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        try:
            self._backend = tokenizers.Tokenizer.from_str(tokenizer_json)
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ValueError(f"invalid tokenizer.json: {exc}") from exc
        self._tokenizer_json = tokenizer_json
        self._config = config or TokenizerConfig()
        template_source = chat_template or self._config.chat_template
        self._chat_template = ChatTemplate(template_source) if template_source else None

        self._bos_token_id = self._special_token_id("bos_token")
        named_eos_id = self._special_token_id("eos_token")
        eos_ids = [] if named_eos_id is None else [named_eos_id]
        for token_id in eos_token_ids:
            if int(token_id) not in eos_ids:
                eos_ids.append(int(token_id))
        self._eos_token_ids = tuple(eos_ids)
        # NOTE: like transformers, a post-processor in tokenizer.json decides which special
        # tokens encode() adds; add_bos_token/add_eos_token only apply when there is none.
        uses_config = self._backend.post_processor is None
        add_bos = uses_config and bool(self._config.add_bos_token)
        add_eos = uses_config and bool(self._config.add_eos_token)
        self._prepended_bos_id = self._bos_token_id if add_bos else None
        self._appended_eos_id = named_eos_id if add_eos else None

    def _special_token_id(self, key: str) -> int | None:
        token = self._config.special_tokens.get(key)
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{key} {token!r} is not in the tokenizer's vocabulary")
        return int(token_id)

    @classmethod
    def from_files(
        cls,
        tokenizer_json: str,
        tokenizer_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        *,
        eos_token_ids: Iterable[int] = (),
    ) -> Tokenizer:
        """Builds a tokenizer from file contents, e.g. as received over gRPC.

        Args:
            tokenizer_json: Contents of ``tokenizer.json``.
            tokenizer_config: The parsed JSON object of ``tokenizer_config.json``, if any.
            chat_template: A chat template that overrides the config's (the contents of
                ``chat_template.jinja``), if any.
            eos_token_ids: Extra ids that end generation.

        Raises:
            ValueError: See `Tokenizer`.
        """
        config = TokenizerConfig.from_dict(tokenizer_config) if tokenizer_config else None
        return cls(tokenizer_json, config, chat_template=chat_template, eos_token_ids=eos_token_ids)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Loads the tokenizer of a Hugging Face model directory.

        Reads ``tokenizer.json`` (required), ``tokenizer_config.json``, ``chat_template.jinja``
        (which wins over the config's template, as in transformers) and the EOS ids of
        ``generation_config.json``, each when present.

        Raises:
            FileNotFoundError: If the directory has no ``tokenizer.json``.
            ValueError: See `Tokenizer`.
        """
        model_dir = Path(model_dir)
        tokenizer_path = model_dir / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in {model_dir}")
        config_path = model_dir / TOKENIZER_CONFIG_FILE
        config = json.loads(config_path.read_text("utf-8")) if config_path.is_file() else None
        template_path = model_dir / CHAT_TEMPLATE_FILE
        template = template_path.read_text("utf-8") if template_path.is_file() else None
        tokenizer = cls.from_files(
            tokenizer_path.read_text("utf-8"),
            config,
            template,
            eos_token_ids=_generation_eos_ids(model_dir / GENERATION_CONFIG_FILE),
        )
        log.debug(
            "tokenizer_loaded",
            model_dir=str(model_dir),
            vocab_size=tokenizer.vocab_size,
            eos_token_ids=list(tokenizer.eos_token_ids),
        )
        return tokenizer

    @property
    def tokenizer_json(self) -> str:
        """The ``tokenizer.json`` contents this tokenizer was built from."""
        return self._tokenizer_json

    @property
    def config(self) -> TokenizerConfig:
        """Settings from ``tokenizer_config.json``."""
        return self._config

    @property
    def chat_template(self) -> str | None:
        """The Jinja source of the chat template in use, if any."""
        return self._chat_template.source if self._chat_template else None

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        """Id of the BOS token, if the model names one."""
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the named EOS token first, then the extra ones."""
        return self._eos_token_ids

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The ids of the added tokens marked special (those a decode without special tokens
        leaves out)."""
        added = self._backend.get_added_tokens_decoder()
        return frozenset(int(i) for i, token in added.items() if token.special)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (e.g. ``"<|end|>"``), or None if unknown."""
        token_id = self._backend.token_to_id(token)
        return None if token_id is None else int(token_id)

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of an id, or None if out of range."""
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Encodes text to token ids.

        Args:
            text: Any text. Special tokens written in it (``"<|user|>"``) become their ids.
            add_special_tokens: Whether to add the tokens the model expects around a sequence
                (typically BOS). Prompts rendered from a chat template already contain them.
        """
        # NOTE: encode_batch releases the GIL while it works and encode does not, so a long text
        # tokenized on a worker thread does not stall the other threads (an event loop).
        encoding = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        ids: list[int] = encoding.ids
        if add_special_tokens and self._prepended_bos_id is not None:
            ids = [self._prepended_bos_id, *ids]
        if add_special_tokens and self._appended_eos_id is not None:
            ids = [*ids, self._appended_eos_id]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decodes token ids to text.

        Byte sequences that are not valid UTF-8 (for example a character cut in half at the
        end) decode to U+FFFD. Ids outside the vocabulary are ignored.
        """
        return str(self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    @property
    def tool_support(self) -> ToolSupport:
        """What of a tool conversation the model's chat template renders (nothing without
        one)."""
        if self._chat_template is None:
            return ToolSupport(system=False, tools=False, tool_calls=False, tool_responses=False)
        return self._chat_template.tool_support

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **variables: Any,
    ) -> str:
        """Renders a conversation with the model's chat template.

        Same semantics as transformers' ``apply_chat_template(..., tokenize=False)``; see
        `ChatTemplate.render`.

        Raises:
            ChatTemplateError: If the model has no chat template, or rendering fails.
        """
        if self._chat_template is None:
            raise ChatTemplateError("the model has no chat template")
        return self._chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            special_tokens=self._config.special_tokens,
            tools=tools,
            documents=documents,
            **variables,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> list[int]:
        """The prompt token ids of a conversation.

        The rendered text is encoded without adding special tokens, because the template
        writes them itself (as transformers does).

        Raises:
            ChatTemplateError: See `apply_chat_template`.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False)


def _generation_eos_ids(path: Path) -> list[int]:
    """The ``eos_token_id`` (an int or a list) of a ``generation_config.json``, if any."""
    if not path.is_file():
        return []
    value = json.loads(path.read_text("utf-8")).get("eos_token_id")
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints")
    return [int(v) for v in values]
