"""Bad requests are refused with an OpenAI error body and never reach prefill or decode."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import openai
import pytest
from support.gateway_cluster import Cluster
from support.gateway_fakes import MAX_MODEL_LEN, MODEL_NAME

from pdserve.common import constraints
from pdserve.common.errors import ErrorReason, from_rpc_error
from pdserve.common.generation import Constraint
from pdserve.common.grpc_server import insecure_channel
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "x", **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": MESSAGES, **fields}


TOOL = [{"role": "tool", "content": "x"}]
FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
CALLED = [*MESSAGES, {"role": "assistant", "tool_calls": [CALL]}]
TOO_MANY_TOKENS = _completion(prompt="y" * 100, max_tokens=MAX_MODEL_LEN)
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
BAD_REQUESTS: list[tuple[str, str, Any, int, str | None]] = [
    # (name, path, body, status, param)
    ("malformed_json", COMPLETIONS, b'{"model": "tiny", "prompt": ', 400, None),
    ("not_an_object", COMPLETIONS, [1, 2], 400, None),
    ("missing_messages", CHAT, {"model": MODEL_NAME}, 400, "messages"),
    ("empty_messages", CHAT, _chat(messages=[]), 400, "messages"),
    ("missing_model", COMPLETIONS, {"prompt": "x"}, 400, "model"),
    ("max_tokens_zero", COMPLETIONS, _completion(max_tokens=0), 400, "max_tokens"),
    ("max_tokens_negative", CHAT, _chat(max_tokens=-3), 400, "max_tokens"),
    ("temperature_negative", COMPLETIONS, _completion(temperature=-0.5), 400, "temperature"),
    ("top_p_zero", COMPLETIONS, _completion(top_p=0), 400, "top_p"),
    ("n_zero", CHAT, _chat(n=0), 400, "n"),
    ("n_over_limit", CHAT, _chat(n=17), 400, "n"),
    ("top_logprobs_21", CHAT, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top_logprobs_alone", CHAT, _chat(top_logprobs=2), 400, "top_logprobs"),
    ("completion_logprobs_6", COMPLETIONS, _completion(logprobs=6), 400, "logprobs"),
    ("presence_penalty_3", CHAT, _chat(presence_penalty=3), 400, "presence_penalty"),
    ("frequency_penalty_low", COMPLETIONS, _completion(frequency_penalty=-2.5), 400,
     "frequency_penalty"),
    ("repetition_penalty_zero", CHAT, _chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("min_p_over_one", CHAT, _chat(min_p=1.5), 400, "min_p"),
    ("min_tokens_over_max", CHAT, _chat(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    ("logit_bias_101", CHAT, _chat(logit_bias={"5": 101}), 400, "logit_bias"),
    ("logit_bias_not_an_id", CHAT, _chat(logit_bias={"a": 1}), 400, "logit_bias"),
    ("logit_bias_out_of_vocab", CHAT, _chat(logit_bias={"99999": 1}), 400, "logit_bias"),
    ("best_of_two", COMPLETIONS, _completion(best_of=2), 400, "best_of"),
    ("too_many_prompts", COMPLETIONS, _completion(prompt=["a"] * 65), 400, "prompt"),
    ("max_tokens_zero_without_echo", COMPLETIONS, _completion(max_tokens=0, logprobs=1), 400,
     "max_tokens"),
    ("tool_without_function", CHAT, _chat(tools=[{"type": "function"}]), 400, "tools"),
    ("unknown_field", COMPLETIONS, _completion(best_guess=1), 400, "best_guess"),
    ("tool_without_call_id", CHAT, _chat(messages=TOOL), 400, "messages[0].tool_call_id"),
    ("image_part", CHAT, _chat(messages=IMAGE), 400, "messages[0].content[0]"),
    # per role, as the OpenAI API checks messages
    ("user_without_content", CHAT, _chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    ("user_content_null", CHAT, _chat(messages=[{"role": "user", "content": None}]), 400,
     "messages[0].content"),
    ("system_without_content", CHAT, _chat(messages=[{"role": "system"}, *MESSAGES]), 400,
     "messages[0].content"),
    ("assistant_without_content_or_calls", CHAT, _chat(messages=[*MESSAGES,
     {"role": "assistant"}, *MESSAGES]), 400, "messages[1].content"),
    ("tool_answering_no_call", CHAT, _chat(messages=[*CALLED, {"role": "tool",
     "tool_call_id": "call_2", "content": "x"}]), 400, "messages[2].tool_call_id"),
    ("tool_before_its_call", CHAT, _chat(messages=[*MESSAGES, {"role": "tool",
     "tool_call_id": "call_1", "content": "x"}, *CALLED[1:]]), 400, "messages[1].tool_call_id"),
    ("tool_without_content", CHAT, _chat(messages=[*CALLED, {"role": "tool",
     "tool_call_id": "call_1"}]), 400, "messages[2].content"),
    ("user_with_tool_calls", CHAT, _chat(messages=[{"role": "user", "content": "x",
     "tool_calls": [CALL]}]), 400, "messages[0].tool_calls"),
    ("user_with_tool_call_id", CHAT, _chat(messages=[{"role": "user", "content": "x",
     "tool_call_id": "call_1"}]), 400, "messages[0].tool_call_id"),
    ("call_with_empty_id", CHAT, _chat(messages=[*MESSAGES, {"role": "assistant",
     "tool_calls": [{**CALL, "id": ""}]}]), 400, "messages[1].tool_calls[0].id"),
    ("call_without_function", CHAT, _chat(messages=[*MESSAGES, {"role": "assistant",
     "tool_calls": [{"id": "c", "type": "function"}]}]), 400, "messages"),
    ("unknown_role", CHAT, _chat(messages=[{"role": "robot", "content": "x"}]), 400,
     "messages[0].role"),
    # tools and tool_choice
    ("tool_bad_name", CHAT, _chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
     400, "tools[0].function.name"),
    ("tool_name_twice", CHAT, _chat(tools=[FUNCTION, FUNCTION]), 400, "tools[1].function.name"),
    ("tool_not_a_function", CHAT, _chat(tools=[{"type": "retrieval"}]), 400, "tools"),
    ("too_many_tools", CHAT, _chat(tools=[{"type": "function", "function": {"name": f"f{i}"}}
     for i in range(129)]), 400, "tools"),
    ("tool_choice_without_tools", CHAT, _chat(tool_choice="required"), 400, "tool_choice"),
    ("tool_choice_unknown_mode", CHAT, _chat(tools=[FUNCTION], tool_choice="always"), 400,
     "tool_choice"),
    ("tool_choice_names_no_tool", CHAT, _chat(tools=[FUNCTION], tool_choice={"type": "function",
     "function": {"name": "g"}}), 400, "tool_choice"),
    ("forced_call_ignoring_eos", CHAT, _chat(tools=[FUNCTION], tool_choice="required",
     ignore_eos=True), 400, "ignore_eos"),
    ("functions", CHAT, _chat(functions=[{"name": "f"}]), 400, "functions"),
    ("forced_call_and_response_format", CHAT, _chat(tools=[FUNCTION], tool_choice="required",
     response_format={"type": "json_object"}), 400, "tool_choice"),
    ("empty_prompt", COMPLETIONS, _completion(prompt=""), 400, "prompt"),
    ("token_out_of_vocab", COMPLETIONS, _completion(prompt=[1, 99999]), 400, "prompt"),
    ("empty_stop", COMPLETIONS, _completion(stop=[""]), 400, "stop"),
    ("prompt_too_long", COMPLETIONS, _completion(prompt="y" * MAX_MODEL_LEN), 400, "prompt"),
    ("prompt_plus_max_tokens_too_long", COMPLETIONS, TOO_MANY_TOKENS, 400, "max_tokens"),
    ("unknown_model", COMPLETIONS, _completion(model="gpt-9"), 404, "model"),
    # strict types: nothing is coerced
    ("stream_string", COMPLETIONS, _completion(stream="yes"), 400, "stream"),
    ("temperature_bool", COMPLETIONS, _completion(temperature=True), 400, "temperature"),
    ("prompt_bools", COMPLETIONS, _completion(prompt=[True]), 400, "prompt"),
    ("max_tokens_float", COMPLETIONS, _completion(max_tokens=2.5), 400, "max_tokens"),
    ("content_number", CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400, "messages"),
    ("temperature_nan", COMPLETIONS, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400,
     "temperature"),
    # ranges checked before any conversion
    ("top_k_2_32", COMPLETIONS, _completion(top_k=2**32), 400, "top_k"),
    ("seed_2_64", COMPLETIONS, _completion(seed=2**64), 400, "seed"),
    ("token_id_2_40", COMPLETIONS, _completion(prompt=[2**40]), 400, "prompt"),
    ("temperature_huge", COMPLETIONS, _completion(temperature=1e39), 400, "temperature"),
    ("max_completion_tokens_zero", CHAT, _chat(max_completion_tokens=0), 400,
     "max_completion_tokens"),
    # what the JSON parser refuses
    ("lone_surrogate_prompt", COMPLETIONS, b'{"model": "tiny", "prompt": "a\\ud800b"}', 400, None),
    ("lone_surrogate_chat", CHAT,
     b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', 400, None),
    ("nested_5000", COMPLETIONS, b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     400, None),
    ("int_4301_digits", COMPLETIONS, b'{"model": "tiny", "prompt": "x", "max_tokens": '
     + b"9" * 4301 + b"}", 400, None),
    ("not_utf8", COMPLETIONS, b'{"model": "tiny", "prompt": "\xff"}', 400, None),
    ("long_model_name", COMPLETIONS, _completion(model="m" * 300), 400, "model"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "param"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS]
)
async def test_bad_request_gets_openai_error_and_starts_nothing(
    pd: Cluster, name: str, path: str, body: Any, status: int, param: str | None
) -> None:
    async with pd.http() as http:
        if isinstance(body, bytes):
            response = await http.post(
                path, content=body, headers={"content-type": "application/json"}
            )
        else:
            response = await http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param
    if status == 404:
        assert (error["code"], error["type"]) == ("model_not_found", "not_found_error")
    elif "too_long" in name:
        assert error["code"] == "prompt_too_long"
    else:
        assert (error["code"], error["type"]) == ("invalid_request", "invalid_request_error")
    assert pd.prefills[0].requests == []
    assert pd.decodes[0].allocations == []


async def test_too_long_prompt_reports_prompt_too_long(pd: Cluster) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await pd.openai().completions.create(model=MODEL_NAME, prompt="z" * 300, max_tokens=4)
    assert raised.value.code == "prompt_too_long"
    assert pd.prefills[0].requests == []


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "param"),
    [("y" * MAX_MODEL_LEN, 2, "prompt"), ("y", MAX_MODEL_LEN, "max_tokens")],
    ids=["prompt", "max_tokens"],
)
async def test_past_the_model_length_is_invalid_argument_over_grpc(
    pd: Cluster, prompt: str, max_tokens: int, param: str
) -> None:
    request = generation_pb2.GenerateRequest(
        model=MODEL_NAME, text=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens)
    )
    async with insecure_channel(pd.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            [r async for r in stub.Generate(request)]
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    error = from_rpc_error(raised.value)
    assert (error.reason, error.metadata.get("param")) == (ErrorReason.PROMPT_TOO_LONG, param)
    assert pd.prefills[0].requests == []


async def test_unknown_model_is_404_through_the_sdk(pd: Cluster) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        await pd.openai().chat.completions.create(model="nope", messages=MESSAGES)  # type: ignore[arg-type]
    assert raised.value.code == "model_not_found"


async def test_a_constraint_is_checked_once_off_the_event_loop(
    pd: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grammar can take llguidance a few hundred ms to check: on a worker thread, once."""
    checked_on: list[threading.Thread] = []
    check = constraints.check

    def spy(constraint: Constraint) -> str:
        checked_on.append(threading.current_thread())
        return check(constraint)

    monkeypatch.setattr(constraints, "check", spy)
    with pytest.raises(openai.BadRequestError) as raised:
        await pd.openai().chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, extra_body={"guided_grammar": 'root ::= "a"{3,1}'}
        )
    assert "range end must be >= start" in raised.value.message
    assert raised.value.param == "guided_grammar"  # type: ignore[attr-defined]
    assert len(checked_on) == 1 and checked_on[0] is not threading.current_thread()
    assert pd.prefills[0].requests == []


async def test_a_gbnf_grammar_reaches_the_instances_in_lark_syntax(pd: Cluster) -> None:
    await pd.openai().chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=2,
        extra_body={"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
    )
    (sent,) = [r.sampling.constraint for r in pd.prefills[0].requests]
    assert sent.WhichOneof("kind") == "grammar"
    assert sent.grammar == constraints.as_lark('root ::= "a" | "b"')
    assert sent.grammar.startswith("%llguidance") and "start:" in sent.grammar


async def test_a_model_is_retrieved_by_name_through_the_sdk(pd: Cluster) -> None:
    client = pd.openai()
    model = await client.models.retrieve(MODEL_NAME)
    listed = (await client.models.list()).data
    assert [m.id for m in listed] == [MODEL_NAME]
    assert model.id == MODEL_NAME and model.object == "model"
    assert model.model_dump() == listed[0].model_dump() | {"created": model.created}
    with pytest.raises(openai.NotFoundError) as raised:
        await client.models.retrieve("org/nope")
    assert raised.value.code == "model_not_found"
    assert "'org/nope' does not exist" in raised.value.message


@pytest.mark.parametrize("api_key", [None, "wrong"])
async def test_missing_or_wrong_api_key_is_401(cluster: Cluster, api_key: str | None) -> None:
    await cluster.start_gateway(api_key="s3cret")
    prefill = await cluster.add_prefill()
    await cluster.add_decode()
    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    async with cluster.http() as http:
        for path in (COMPLETIONS, CHAT):
            response = await http.post(
                path, json={"model": MODEL_NAME, "prompt": "x"}, headers=headers
            )
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "unauthenticated"
        assert (await http.get("/v1/models", headers=headers)).status_code == 401
        assert (await http.get(f"/v1/models/{MODEL_NAME}", headers=headers)).status_code == 401
        assert (await http.get("/health")).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        await cluster.openai(api_key or "not-the-key").completions.create(
            model=MODEL_NAME, prompt="x"
        )
    ok = await cluster.openai("s3cret").completions.create(
        model=MODEL_NAME, prompt="x", max_tokens=2
    )
    assert ok.usage is not None and ok.usage.completion_tokens == 2
    assert len(prefill.requests) == 1

    request = generation_pb2.GenerateRequest(
        model=MODEL_NAME, text="x", sampling=common_pb2.SamplingParams(max_tokens=2)
    )
    metadata = () if api_key is None else (("authorization", f"Bearer {api_key}"),)
    async with insecure_channel(cluster.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as rpc_error:
            [r async for r in stub.Generate(request, metadata=metadata)]
        assert rpc_error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", "Bearer s3cret"),)
        responses = [r async for r in stub.Generate(request, metadata=good)]
    assert responses[-1].usage.num_completion_tokens == 2


async def test_no_instances_is_503_with_retry_after(cluster: Cluster) -> None:
    await cluster.start_gateway(unavailable_retry_after_s=3.0)
    prefill = await cluster.add_prefill()  # a prefill but no decode: no pair
    async with cluster.http() as http:
        response = await http.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": "x"})
        assert response.status_code == 503
        assert response.headers["retry-after"] == "3"
        assert response.json()["error"]["code"] == "no_healthy_instances"
        assert (await http.get("/v1/models")).json()["data"] == []
    assert prefill.requests == []
