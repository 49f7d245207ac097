"""A `Constraint` as llguidance's grammar, and its check before any instance sees it.

llguidance (a Rust library with a dependency-free wheel) turns each kind into one grammar
text: a JSON Schema, a regex or a Lark-like grammar (a GBNF grammar, llama.cpp's syntax and
the one vLLM's xgrammar takes, is converted to Lark first by llguidance's own converter:
`as_lark`, `in_lark`). The gateway, which has no torch and no model, checks a constraint with
`check` (the grammar is parsed, no tokenizer needed) and answers 400 for one that cannot
compile; the prefill and decode compile the same text against the model's tokenizer
(`pdserve.engine.constraints`).

JSON is generated compactly but readably: ``", "`` between items, ``": "`` after keys, and no
other whitespace (flexible whitespace lets a small model pad forever).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import TYPE_CHECKING

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import Constraint, ConstraintKind

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # the stubs' type only

JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_JSON_OBJECT = '{"type": "object"}'
MAX_PROBLEM_CHARS = 500
_SOURCE_LINE = re.compile(r"^\d+ \|")
# NOTE: the converter's time grows with the square of the rules (300: 50 ms, 1,000: 0.6 s on
# a 2-core EPYC); grammars written by hand have tens.
MAX_GBNF_RULES = 256
_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z][A-Za-z0-9_-]*\s*::=")


def as_lark(grammar: str) -> str:
    """A grammar constraint's text in llguidance's Lark syntax: a GBNF grammar (rules written
    ``root ::= ...``) converted, anything else as given.

    Raises:
        ValueError: A GBNF grammar that does not parse, or of more than `MAX_GBNF_RULES` rules.
    """
    if "::=" not in grammar or is_lark_syntax(grammar):
        return grammar
    num_rules = len(_GBNF_RULE.findall(grammar))
    if num_rules > MAX_GBNF_RULES:
        raise ValueError(
            f"a GBNF grammar of {num_rules} rules; at most {MAX_GBNF_RULES} are converted "
            "(write a larger one in Lark syntax)"
        )
    try:
        return gbnf_to_lark(grammar)
    except Exception as error:
        # NOTE: the converter raises GbnfToLarkError for syntax and a bare Exception for a
        # missing rule (a deep nesting: RecursionError); each is the grammar's fault.
        raise ValueError(f"GBNF: {error}") from None


def grammar_of(constraint: Constraint) -> str:
    """llguidance's grammar text for `constraint` (not yet checked)."""
    kind = constraint.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(
            constraint.value, defaults=JSON_OPTIONS
        )
    if kind is ConstraintKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
    if kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(constraint.value)
    if kind is ConstraintKind.CHOICE:
        # NOTE: Lark string literals take JSON's escapes.
        alternatives = " | ".join(json.dumps(choice) for choice in constraint.choices)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return llguidance.LLMatcher.grammar_from_lark(as_lark(constraint.value))


def in_lark(constraint: Constraint) -> Constraint:
    """`constraint` as an instance compiles it: a GBNF grammar converted to Lark syntax
    (`as_lark`; the gateway sends it on so, and the instances need not convert it), any other
    as given.

    Raises:
        PdserveError: INVALID_REQUEST for a GBNF grammar that does not convert.
    """
    if constraint.kind is not ConstraintKind.GRAMMAR:
        return constraint
    try:
        return dataclasses.replace(constraint, value=as_lark(constraint.value))
    except ValueError as error:
        raise invalid(constraint, str(error)) from None


def check(constraint: Constraint) -> str:
    """The grammar of `constraint`, checked.

    Raises:
        PdserveError: INVALID_REQUEST naming what does not compile.
    """
    try:
        grammar = grammar_of(constraint)
    except (ValueError, TypeError) as error:
        raise invalid(constraint, str(error)) from None
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise invalid(constraint, problem)
    return grammar


def invalid(constraint: Constraint, problem: str) -> PdserveError:
    """The INVALID_REQUEST error of a constraint that does not compile."""
    # NOTE: llguidance echoes the grammar's source line and a caret under it: left out.
    lines = [line.strip() for line in problem.splitlines()]
    said = [line for line in lines if line and line != "^" and not _SOURCE_LINE.match(line)]
    summary = "; ".join(said)[:MAX_PROBLEM_CHARS] or "unknown error"
    return PdserveError(
        ErrorReason.INVALID_REQUEST,
        f"the {constraint.kind.value} constraint does not compile: {summary}",
        {"constraint": constraint.kind.value},
    )
