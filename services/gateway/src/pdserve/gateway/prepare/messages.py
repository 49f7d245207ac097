"""Chat messages and tools, checked per role as the OpenAI API checks them.

* ``system`` (and ``developer``, its alias) and ``user`` messages need ``content``;
* an ``assistant`` message needs ``content`` or ``tool_calls`` (each with an id, a function
  name and arguments);
* a ``tool`` message needs ``content`` and ``tool_call_id``, the id of a call in an earlier
  assistant message;
* ``tool_calls`` and ``reasoning_content`` belong to assistant messages only, ``tool_call_id``
  to tool messages only.

Tools: at most ``--max-tools``, each named as OpenAI allows (``[A-Za-z0-9_-]{1,64}``, unique),
its ``parameters`` a JSON object; ``tool_choice`` needs tools (``none`` aside) and names one of
them; a forced call (``required``, a named function) is a constraint
(`pdserve.gateway.tools.plan`), so it cannot be combined with ``ignore_eos`` (the constraint's
completion can only end) or with a constraint of the client's (``response_format``...).

Every failure is an INVALID_REQUEST naming the field (``messages[2].tool_call_id``).
"""

from __future__ import annotations

from dataclasses import replace

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.prepare.params import ChatMessage, GenerationParams
from pdserve.gateway.tools.plan import forced_call_constraint
from pdserve.gateway.tools.spec import TOOL_NAME_PATTERN, ToolChoiceMode

MAX_NAME_CHARS = 256  # model, user, client request ids, message names and call ids
CHAT_ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}


def invalid(message: str, param: str) -> PdserveError:
    """An INVALID_REQUEST naming the offending parameter."""
    return PdserveError(ErrorReason.INVALID_REQUEST, message, {"param": param})


def check_text(value: str, param: str) -> None:
    """Refuses a string that is not valid Unicode (a lone surrogate such as ``"\\ud800"``)."""
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid(
            f"{param} is not valid Unicode (a lone surrogate at character {exc.start})", param
        ) from exc


def check_name(value: str | None, param: str) -> None:
    """Refuses a name or id longer than `MAX_NAME_CHARS`, or not valid Unicode."""
    if value is None:
        return
    if len(value) > MAX_NAME_CHARS:
        raise invalid(f"{param} is longer than {MAX_NAME_CHARS} characters", param)
    check_text(value, param)


def checked_messages(messages: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
    """The messages with roles normalized (``developer`` is ``system``), once each passed its
    role's rules.

    Raises:
        PdserveError: INVALID_REQUEST naming the field at fault.
    """
    if not messages:
        raise invalid("messages must not be empty", "messages")
    checked: list[ChatMessage] = []
    call_ids: set[str] = set()
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        role = ROLE_ALIASES.get(message.role, message.role)
        if role not in CHAT_ROLES:
            raise invalid(
                f"role {message.role[:MAX_NAME_CHARS]!r} is not supported "
                "(system, developer, user, assistant, tool)",
                f"{where}.role",
            )
        _check_role_fields(message, role, where, call_ids)
        if message.content is not None:
            check_text(message.content, f"{where}.content")
        check_name(message.name, f"{where}.name")
        for number, call in enumerate(message.tool_calls):
            call_where = f"{where}.tool_calls[{number}]"
            if not call.id:
                raise invalid(f"{call_where}.id is required", f"{call_where}.id")
            check_name(call.id, f"{call_where}.id")
            if not call.name:
                raise invalid(
                    f"{call_where}.function.name is required", f"{call_where}.function.name"
                )
            check_name(call.name, f"{call_where}.function.name")
            check_text(call.arguments, f"{call_where}.function.arguments")
            call_ids.add(call.id)
        checked.append(message if role == message.role else replace(message, role=role))
    return tuple(checked)


def _check_role_fields(message: ChatMessage, role: str, where: str, call_ids: set[str]) -> None:
    if message.tool_calls and role != "assistant":
        raise invalid(
            f"only assistant messages may have tool_calls ({where})", f"{where}.tool_calls"
        )
    if message.tool_call_id is not None and role != "tool":
        raise invalid(
            f"only tool messages may have a tool_call_id ({where})", f"{where}.tool_call_id"
        )
    if message.reasoning is not None:
        if role != "assistant":
            raise invalid(
                f"only assistant messages may have reasoning_content ({where})",
                f"{where}.reasoning_content",
            )
        check_text(message.reasoning, f"{where}.reasoning_content")
    if message.content is None and not (role == "assistant" and message.tool_calls):
        needs = "content or tool_calls" if role == "assistant" else "content"
        raise invalid(
            f"{where}.content is required: a {message.role} message needs {needs}",
            f"{where}.content",
        )
    if role != "tool":
        return
    if not message.tool_call_id:
        raise invalid(
            f"{where}.tool_call_id is required for a tool message", f"{where}.tool_call_id"
        )
    check_name(message.tool_call_id, f"{where}.tool_call_id")
    if message.tool_call_id not in call_ids:
        raise invalid(
            f"{where}.tool_call_id {message.tool_call_id!r} answers no tool call of an earlier "
            "assistant message",
            f"{where}.tool_call_id",
        )


def with_tool_constraint(params: GenerationParams) -> GenerationParams:
    """Checks the tools (`check_tools`); a request whose tool_choice forces a call gets its
    constraint (`pdserve.gateway.tools.plan.forced_call_constraint`), checked and compiled
    then like any other.

    Raises:
        PdserveError: INVALID_REQUEST naming the field at fault, and for a forced call with a
            constraint of the client's own (``response_format``...).
    """
    check_tools(params)
    choice = params.tool_choice
    constraint = forced_call_constraint(params.tools, choice, params.parallel_tool_calls)
    if constraint is None or params.constraint == constraint:  # (validated once already)
        return params
    if params.constraint is not None:
        mode = "a named function" if choice and choice.function_name else "required"
        raise invalid(
            f"tool_choice {mode} cannot be combined with {params.constraint_name}", "tool_choice"
        )
    return replace(params, constraint=constraint, constraint_name="tools")


def check_tools(params: GenerationParams) -> None:
    """Checks a request's tools (their number is `check_counts`' to check), tool_choice and the
    settings a forced call rules out.

    Raises:
        PdserveError: INVALID_REQUEST naming the field at fault.
    """
    tools = params.tools
    names: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}].function"
        if not TOOL_NAME_PATTERN.fullmatch(tool.name):
            raise invalid(
                f"{where}.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -",
                f"{where}.name",
            )
        if tool.name in names:
            raise invalid(f"{where}.name {tool.name!r} is not unique", f"{where}.name")
        names.add(tool.name)
        if tool.description is not None:
            check_text(tool.description, f"{where}.description")
        if tool.parameters is not None:
            check_text(tool.parameters, f"{where}.parameters")
            try:
                tool.parameters_schema()
            except ValueError:
                raise invalid(
                    f"{where}.parameters must be a JSON Schema (a JSON object)",
                    f"{where}.parameters",
                ) from None
    choice = params.tool_choice
    if choice is None or choice.mode is ToolChoiceMode.NONE:
        return
    if not tools:
        raise invalid("tool_choice needs tools", "tool_choice")
    if choice.mode is ToolChoiceMode.FUNCTION and choice.function_name not in names:
        name = (choice.function_name or "")[:MAX_NAME_CHARS]
        raise invalid(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
    if choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.FUNCTION) and params.ignore_eos:
        raise invalid("ignore_eos cannot be combined with a forced tool call", "ignore_eos")
