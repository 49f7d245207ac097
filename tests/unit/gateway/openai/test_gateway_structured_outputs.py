"""Constraints at the edge: every way a client sets one becomes the same `Constraint`, and one
that cannot apply is a 400 naming the parameter before any instance sees it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import Constraint, ConstraintKind
from pdserve.gateway.openai.parsing import parse_openai_body
from pdserve.gateway.prepare.validation import RequestLimits, check_constraint
from pdserve.gateway.request import ApiKind

K = ConstraintKind
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "hi"}]


def parse(body: dict[str, Any], *, is_chat: bool = True, **limits: Any) -> Any:
    prompt = {"messages": MESSAGES} if is_chat else {"prompt": "hi"}
    raw = json.dumps({"model": "m", **prompt, **body}).encode()
    kind = ApiKind.CHAT if is_chat else ApiKind.COMPLETIONS
    return parse_openai_body(raw, kind, RequestLimits(**limits)).params[0]


@pytest.mark.parametrize(
    ("body", "is_chat", "constraint", "name"),
    [
        ({"response_format": {"type": "json_object"}}, True, Constraint(K.JSON_OBJECT),
         "response_format"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
         True, Constraint(K.JSON_SCHEMA, json.dumps(SCHEMA)), "response_format"),
        ({"structured_outputs": {"json": SCHEMA}}, False,
         Constraint(K.JSON_SCHEMA, json.dumps(SCHEMA)), "structured_outputs"),
        ({"structured_outputs": {"regex": "[0-9]+"}}, True, Constraint(K.REGEX, "[0-9]+"),
         "structured_outputs"),
        ({"structured_outputs": {"json_object": True}}, False, Constraint(K.JSON_OBJECT),
         "structured_outputs"),
        ({"guided_json": json.dumps(SCHEMA)}, False,
         Constraint(K.JSON_SCHEMA, json.dumps(SCHEMA)), "guided_json"),
        ({"guided_choice": ["x", "y"]}, True, Constraint(K.CHOICE, choices=("x", "y")),
         "guided_choice"),
        ({"guided_grammar": 'start: "ok"'}, False, Constraint(K.GRAMMAR, 'start: "ok"'),
         "guided_grammar"),
        ({"guided_regex": "a|b"}, False, Constraint(K.REGEX, "a|b"), "guided_regex"),
    ],
)  # fmt: skip
def test_every_way_of_asking_becomes_one_constraint(
    body: dict[str, Any], is_chat: bool, constraint: Constraint, name: str
) -> None:
    params = parse(body, is_chat=is_chat)
    assert params.constraint == constraint and params.constraint_name == name
    sampling = params.to_sampling_params(16, 1)
    assert sampling.constraint == constraint


def test_text_format_is_no_constraint() -> None:
    assert parse({"response_format": {"type": "text"}}).constraint is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"schema": SCHEMA, "extra": 1}}}, "response_format"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"schema": {"type": "nonsense"}}}}, "response_format"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["ok", ""]}, "guided_choice"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
        ({"guided_grammar": 'root ::= "a" | undefined'}, "guided_grammar"),
        ({"structured_outputs": {"grammar": "root ::= [0-9"}}, "structured_outputs"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
        ({"guided_regex": "a" * 101}, "guided_regex"),
    ],
)  # fmt: skip
def test_a_constraint_that_cannot_apply_is_refused_naming_it(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(PdserveError) as raised:
        check_constraint(parse(body, max_constraint_chars=100))
    assert raised.value.reason is ErrorReason.INVALID_REQUEST
    assert raised.value.metadata.get("param") == param, raised.value
