"""Structured outputs on SmolLM2-135M-Instruct through gateway, prefill and decode processes:
JSON Schema (strict), any JSON object (streamed), regex and choice on completions, grammar
over gRPC, a cut by max_tokens, and 400s for constraints that do not compile. The first token
is masked on the prefill and the rest on the decode; greedy output equals a reference that
masks transformers' logits with the same constraint, token for token."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import grpc
import jsonschema
import openai
import pydantic
import pytest
from support.masked_reference import masked_greedy
from support.process_cluster import ProcessCluster

from pdserve.common.errors import ErrorReason, from_rpc_error
from pdserve.common.generation import Constraint, ConstraintKind
from pdserve.engine.model_store import DEFAULT_MODEL
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON with name, age and hobbies."}]


@pytest.fixture(scope="module")
def cluster(smollm2_processes: ProcessCluster) -> ProcessCluster:
    return smollm2_processes  # NOTE: shared with the other files that only send it requests


def person_format() -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }


async def test_a_strict_json_schema_gives_valid_json_equal_to_the_masked_reference(
    cluster: ProcessCluster, smollm2_reference: tuple[Any, Any]
) -> None:
    response = await cluster.openai().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=80,
        temperature=0,
        response_format=person_format(),  # type: ignore[arg-type]
        extra_body={"return_token_ids": True},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    hf_tokenizer, _ = smollm2_reference
    prompt = list(
        hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
    )
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(PERSON))
    expected = masked_greedy(smollm2_reference, prompt, constraint, 80)
    generated = (choice.model_extra or {})["token_ids"]
    assert generated == expected[: len(generated)]
    assert len(generated) >= len(expected) - 1  # the reference keeps its end id


async def test_a_streamed_json_object_parses_and_seeded_samples_too(
    cluster: ProcessCluster,
) -> None:
    client = cluster.openai()
    for seed in (1, 2):
        stream = await client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
            max_tokens=120,
            temperature=0.8,
            seed=seed,
            stream=True,
            response_format={"type": "json_object"},
        )
        text, finish = "", None
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # cut by max_tokens: a prefix of an object
            assert finish == "length" and text.startswith("{")


async def test_regex_and_choice_on_completions(cluster: ProcessCluster) -> None:
    client = cluster.openai()
    phone = await client.completions.create(
        model=DEFAULT_MODEL,
        prompt="Call me at",
        max_tokens=20,
        temperature=0.7,
        seed=3,
        extra_body={"structured_outputs": {"regex": r" \d{3}-\d{4}"}},
    )
    assert re.fullmatch(r" \d{3}-\d{4}", phone.choices[0].text)
    assert phone.choices[0].finish_reason == "stop"
    answer = await client.completions.create(
        model=DEFAULT_MODEL,
        prompt="Is the sky blue? Answer:",
        max_tokens=5,
        n=3,
        temperature=1.0,
        extra_body={"guided_choice": [" yes", " no", " it depends"]},
    )
    assert {c.text for c in answer.choices} <= {" yes", " no", " it depends"}


async def test_a_cut_by_max_tokens_says_length(cluster: ProcessCluster) -> None:
    response = await cluster.openai().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        response_format=person_format(),  # type: ignore[arg-type]
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert (choice.message.content or "").startswith('{"name": "')


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}},
         "response_format"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ],
)  # fmt: skip
async def test_a_constraint_that_cannot_apply_is_a_400_naming_it(
    cluster: ProcessCluster, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await cluster.openai().chat.completions.create(
            model=DEFAULT_MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=5,
            extra_body=extra,
        )
    body = raised.value.body
    assert isinstance(body, dict) and body.get("param") == param, body


async def test_a_grammar_over_the_public_grpc_api(cluster: ProcessCluster) -> None:
    grammar = 'start: " " ANSWER "."\nANSWER: "red" | "green" | "blue"'
    async with grpc.aio.insecure_channel(cluster.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(
            model=DEFAULT_MODEL,
            text="My favourite colour is",
            sampling=common_pb2.SamplingParams(
                max_tokens=10, temperature=0.0, constraint=common_pb2.Constraint(grammar=grammar)
            ),
        )
        text = "".join([response.text async for response in stub.Generate(request)])
    assert text in {" red.", " green.", " blue."}


def schema_variant(i: int) -> dict[str, Any]:
    """One of several schemas (enums, bounded numbers, nested objects, arrays)."""
    kinds: list[dict[str, Any]] = [
        PERSON,
        {"type": "object", "properties": {"ok": {"type": "boolean"},
                                          "count": {"type": "integer", "maximum": 99}},
         "required": ["ok", "count"], "additionalProperties": False},
        {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                          "shade": {"type": "number"}},
         "required": ["colour"], "additionalProperties": False},
        {"type": "object", "properties": {"point": {
            "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"], "additionalProperties": False}},
         "required": ["point"], "additionalProperties": False},
    ]  # fmt: skip
    return kinds[i % len(kinds)]


async def test_twenty_schema_requests_streamed_and_not_are_each_valid(
    cluster: ProcessCluster,
) -> None:
    client = cluster.openai()

    async def one(i: int) -> tuple[str, str | None, dict[str, Any]]:
        schema = schema_variant(i)
        settings: dict[str, Any] = {
            "model": DEFAULT_MODEL,
            "messages": [{"role": "user", "content": f"Answer {i} as JSON, please."}],
            "max_tokens": 120,
            "temperature": 0.7,
            "seed": i,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
        }  # fmt: skip
        if i % 2:
            stream = await client.chat.completions.create(**settings, stream=True)
            text, finish = "", None
            async for chunk in stream:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
            return text, finish, schema
        response = await client.chat.completions.create(**settings)
        return response.choices[0].message.content or "", response.choices[0].finish_reason, schema

    results = await asyncio.gather(*(one(i) for i in range(20)))
    assert sum(finish == "stop" for _, finish, _ in results) >= 16
    for text, finish, schema in results:
        if finish == "stop":
            jsonschema.validate(json.loads(text), schema)
        else:
            assert finish == "length" and text.startswith("{")


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    degrees: int
    sunny: bool


async def test_the_sdk_parse_helper_gets_a_pydantic_object(cluster: ProcessCluster) -> None:
    completion = await cluster.openai().chat.completions.parse(
        model=DEFAULT_MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        response_format=Weather,
        max_tokens=60,
        temperature=0,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Weather) and len(parsed.city) <= 20


async def test_grpc_refuses_a_constraint_that_does_not_compile_with_error_info(
    cluster: ProcessCluster,
) -> None:
    async with grpc.aio.insecure_channel(cluster.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(
            model=DEFAULT_MODEL,
            text="Hello",
            sampling=common_pb2.SamplingParams(
                max_tokens=4, constraint=common_pb2.Constraint(regex="((")
            ),
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            [r async for r in stub.Generate(request)]
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    error = from_rpc_error(raised.value)
    assert error.reason is ErrorReason.INVALID_REQUEST
    assert error.metadata.get("param") == "sampling.constraint"


async def test_a_hostile_schema_is_refused_at_the_edge_and_others_run_on(
    cluster: ProcessCluster,
) -> None:
    """Huge (past --max-constraint-chars) or deeply nested schemas are 400s; a stream running
    meanwhile is not held up."""
    client = cluster.openai()
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(400):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    running = asyncio.create_task(
        client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=MESSAGES,
            max_tokens=24,
            temperature=0,  # type: ignore[arg-type]
        )
    )
    # NOTE: the huge one passes the JSON parser and is refused as a constraint; the deep one
    # is refused by the body's JSON parser already (its nesting limit).
    for schema, said in ((huge, "at most 100000 are accepted"), (deep, "recursion limit")):
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(
                model=DEFAULT_MODEL,
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=5,
                response_format={"type": "json_schema",  # type: ignore[arg-type]
                                 "json_schema": {"name": "h", "schema": schema}},
            )  # fmt: skip
        assert time.monotonic() - started < 10
        body = raised.value.body
        assert isinstance(body, dict) and said in str(body.get("message")), body
    assert (await running).choices[0].finish_reason in {"stop", "length"}
