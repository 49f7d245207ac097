"""Chat templates: Jinja rendered in a sandbox with the same variables as transformers.

A chat template comes from the model (or, for the gateway, from a prefill over gRPC) and is
untrusted code, so it runs in jinja2's immutable sandbox and only ever sees plain JSON data.
The environment matches transformers' ``apply_chat_template``: ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that does not escape
HTML, the ``raise_exception`` and ``strftime_now`` globals, and ``{% generation %}`` blocks
(rendered as their body).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template that does not compile, or messages that it refuses to render."""


class _GenerationBlocks(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` and renders the body unchanged.

    NOTE: transformers uses these blocks to mark assistant tokens for training masks; some
    published templates contain them, so they must parse here even though serving ignores them.
    """

    tags = {"generation"}  # noqa: RUF012 (the type jinja2 declares for it)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # NOTE: jinja's own tojson escapes <, > and & for HTML, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlocks, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _plain(value: Any) -> Any:
    """A copy of `value` made only of JSON types, so the sandbox never sees rich objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    raise ChatTemplateError(f"chat inputs must be JSON-like data, got {type(value).__name__}")


class ToolSupport(NamedTuple):
    """What of a tool conversation a chat template renders (found by rendering probes, as
    llama.cpp's minja does: a template that ignores a part leaves the probe's marker out).

    Attributes:
        system: ``system`` messages.
        tools: The ``tools`` variable (the functions offered).
        tool_calls: Assistant messages' ``tool_calls``.
        tool_responses: ``tool`` messages.
    """

    system: bool
    tools: bool
    tool_calls: bool
    tool_responses: bool


_PROBE_TOOL = "pdserve_probe_tool"
_PROBE_ARGUMENT = "pdserve_probe_argument"
_PROBE_RESULT = "pdserve_probe_result"
_PROBE_SYSTEM = "pdserve_probe_system"
_PROBE_USER = {"role": "user", "content": "Hi"}
_PROBE_CALL = {
    "id": "call_probe",
    "type": "function",
    "function": {"name": _PROBE_TOOL, "arguments": {_PROBE_ARGUMENT: 1}},
}


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: The Jinja source, as found in ``tokenizer_config.json`` or
            ``chat_template.jinja``.

    Raises:
        ChatTemplateError: If the source does not compile.
    """

    def __init__(self, source: str) -> None:
        self._source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc

    @property
    def source(self) -> str:
        """The Jinja source of the template."""
        return self._source

    @functools.cached_property
    def tool_support(self) -> ToolSupport:
        """What of a tool conversation the template renders (probed once per template)."""
        tool = {
            "type": "function",
            "function": {
                "name": _PROBE_TOOL,
                "description": "A probe.",
                "parameters": {
                    "type": "object",
                    "properties": {_PROBE_ARGUMENT: {"type": "integer"}},
                },
            },
        }
        system = {"role": "system", "content": _PROBE_SYSTEM}
        calling = {"role": "assistant", "tool_calls": [_PROBE_CALL]}
        has_calls = self._shows(_PROBE_TOOL, [_PROBE_USER, calling])
        answered = calling if has_calls else {"role": "assistant", "content": "Let me see."}
        result = {"role": "tool", "tool_call_id": "call_probe", "content": _PROBE_RESULT}
        return ToolSupport(
            system=self._shows(_PROBE_SYSTEM, [system, _PROBE_USER]),
            tools=self._shows(_PROBE_TOOL, [_PROBE_USER], tools=[tool]),
            tool_calls=has_calls,
            tool_responses=self._shows(_PROBE_RESULT, [_PROBE_USER, answered, result]),
        )

    def _shows(self, marker: str, messages: list[dict[str, Any]], **variables: Any) -> bool:
        """Whether rendering `messages` succeeds and writes `marker`."""
        try:
            return marker in self.render(messages, **variables)
        except ChatTemplateError:
            return False

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        special_tokens: Mapping[str, str] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **variables: Any,
    ) -> str:
        """Renders a conversation to the prompt text.

        As in transformers, keys whose value is None are dropped from each message (APIs send
        ``"content": null``), and the template sees ``messages``, ``add_generation_prompt``,
        ``tools``, ``documents``, every named special token (``bos_token``, ``eos_token``...)
        and `variables`, which win over special tokens of the same name.

        Args:
            messages: The conversation: mappings with at least ``role``.
            add_generation_prompt: Whether to end with the header of an assistant turn.
            continue_final_message: End the prompt inside the last message, right after its
                text, so that the model continues it (an assistant reply begun for it), as
                transformers' ``continue_final_message``; not with `add_generation_prompt`.
            special_tokens: Named special tokens, e.g. ``{"bos_token": "<s>"}``.
            tools: Tool (function) JSON schemas, for templates that support them.
            documents: Retrieved documents, for templates that support them.
            **variables: Extra template variables (e.g. ``enable_thinking``).

        Returns:
            The rendered prompt text.

        Raises:
            ChatTemplateError: If the conversation is empty or malformed, or the template
                rejects it (``raise_exception``) or fails while rendering.
        """
        if not messages:
            raise ChatTemplateError("cannot render an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message continues the last message: it cannot be combined "
                "with add_generation_prompt"
            )
        chat = []
        for message in messages:
            if not isinstance(message, Mapping):
                raise ChatTemplateError(f"a chat message must be a mapping, got {message!r}")
            chat.append(_plain({k: v for k, v in message.items() if v is not None}))
        context = {
            **_plain(dict(special_tokens or {})),
            **_plain(variables),
            "messages": chat,
            "tools": _plain(tools),
            "documents": _plain(documents),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            rendered = self._template.render(**context)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc!r}") from exc
        return _open_final_message(rendered, chat[-1]) if continue_final_message else rendered


def _open_final_message(rendered: str, final: Mapping[str, Any]) -> str:
    """`rendered` cut right after the last message's text (as transformers cuts it for
    ``continue_final_message``: at its last occurrence, keeping the text's trailing spaces where
    the template kept them).

    Raises:
        ChatTemplateError: The message has no text, or the template did not write its text.
    """
    content = final.get("content")
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, Mapping)]
        content = next((text for text in reversed(texts) if isinstance(text, str)), None)
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message needs a last message with text")
    stripped = content.strip()
    at = rendered.rfind(stripped)
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message: the chat template does not write the last message's text"
        )
    kept = content.lstrip()
    if rendered[at : at + len(kept)] == kept:
        return rendered[: at + len(kept)]
    return rendered[: at + len(stripped)]
