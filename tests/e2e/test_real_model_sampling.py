"""The OpenAI sampling surface on SmolLM2-135M-Instruct through gateway, prefill and decode
processes, against transformers on the same GGUF: logprobs and their alternatives, prompt
logprobs (echo, as lm-evaluation-harness asks for them), repetition penalty, presence and
frequency penalties with logit_bias, and n choices. The first token is sampled on the prefill
and the rest on the decode, so every check spans the split."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import openai
import pytest
import torch
from support.process_cluster import ProcessCluster

from pdserve.engine.model_store import DEFAULT_MODEL
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

TOLERANCE = 1e-4
MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(smollm2_processes: ProcessCluster) -> ProcessCluster:
    return smollm2_processes  # NOTE: shared with the other files that only send it requests


def chat_prompt(reference: tuple[Any, Any]) -> list[int]:
    tokenizer, _ = reference
    encoded = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)
    return list(encoded["input_ids"])


def log_softmax_rows(reference: tuple[Any, Any], token_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `token_ids` (row i predicts i + 1)."""
    _, model = reference
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_top_matches(top: list[tuple[str, float]], row: torch.Tensor, tokenizer: Any) -> None:
    """Alternatives equal the reference's, tokens compared where the values are not tied."""
    expected = row.topk(len(top))
    assert [v for _, v in top] == pytest.approx(expected.values.tolist(), abs=TOLERANCE)
    ids = expected.indices.tolist()
    values = expected.values.tolist()
    for rank, (token, _) in enumerate(top):
        neighbours = [values[j] for j in (rank - 1, rank + 1) if 0 <= j < len(values)]
        if all(abs(values[rank] - v) > 10 * TOLERANCE for v in neighbours):
            assert token == tokenizer.decode([ids[rank]])


async def test_greedy_logprobs_equal_transformers_at_every_position(
    cluster: ProcessCluster, smollm2_reference: tuple[Any, Any]
) -> None:
    prompt = chat_prompt(smollm2_reference)
    response = await cluster.openai().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=NUM_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = response.choices[0]
    generated = (choice.model_extra or {})["token_ids"]
    assert len(generated) == NUM_TOKENS
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content  # the SDK's typed objects
    assert len(content) == NUM_TOKENS
    rows = log_softmax_rows(smollm2_reference, prompt + generated)
    tokenizer, _ = smollm2_reference
    for i, entry in enumerate(content):
        row = rows[len(prompt) - 1 + i]
        assert entry.logprob == pytest.approx(float(row[generated[i]]), abs=TOLERANCE)
        assert entry.token == tokenizer.decode([generated[i]])
        assert bytes(entry.bytes or []) == entry.token.encode()
        top = [(t.token, t.logprob) for t in entry.top_logprobs]
        assert len(top) == 5
        assert_top_matches(top, row, tokenizer)
        assert top[0][1] == pytest.approx(entry.logprob, abs=TOLERANCE)  # greedy: the best


async def test_streamed_logprobs_equal_the_whole_response(cluster: ProcessCluster) -> None:
    settings: dict[str, Any] = {
        "model": DEFAULT_MODEL,
        "messages": MESSAGES,
        "max_tokens": NUM_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    client = cluster.openai()
    whole = await client.chat.completions.create(**settings)
    stream = await client.chat.completions.create(**settings, stream=True)
    streamed = []
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed.extend(choice.logprobs.content)
    assert whole.choices[0].logprobs is not None
    expected = whole.choices[0].logprobs.content or []
    assert [e.token for e in streamed] == [e.token for e in expected]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in expected])


async def test_logprobs_tokens_join_to_the_content_the_end_of_turn_left_out(
    cluster: ProcessCluster,
) -> None:
    """A reply that ends by itself ends with ``<|im_end|>``: counted in the usage, never in the
    content, and so never among the content's logprobs (as OpenAI's), streamed or not."""
    settings: dict[str, Any] = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 64,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    client = cluster.openai()
    whole = await client.chat.completions.create(**settings, extra_body={"return_token_ids": True})
    choice = whole.choices[0]
    assert choice.finish_reason == "stop", "the reply did not end by itself"
    assert choice.logprobs is not None and choice.logprobs.content
    tokens = [entry.token for entry in choice.logprobs.content]
    assert "".join(tokens) == choice.message.content
    assert "<|im_end|>" not in tokens
    token_ids = (choice.model_extra or {})["token_ids"]
    assert whole.usage is not None and whole.usage.completion_tokens == len(token_ids)
    assert len(tokens) == len(token_ids) - 1  # every token but the end of the turn
    stream = await client.chat.completions.create(**settings, stream=True)
    content, streamed = "", []
    async for chunk in stream:
        for streamed_choice in chunk.choices:
            content += streamed_choice.delta.content or ""
            if streamed_choice.logprobs is not None:
                streamed += [e.token for e in streamed_choice.logprobs.content or ()]
    assert "".join(streamed) == content == choice.message.content
    # NOTE: vLLM's options: the end of the turn is a stop token, left out even where special
    # tokens are kept, and in the text (and its logprobs) with include_stop_str_in_output.
    kept = {"skip_special_tokens": False}
    for extra, ending in [(kept, ""), ({**kept, "include_stop_str_in_output": True}, "<|im_end|>")]:
        shown = (await client.chat.completions.create(**settings, extra_body=extra)).choices[0]
        assert shown.message.content == choice.message.content + ending
        assert shown.logprobs is not None and shown.logprobs.content
        assert "".join(entry.token for entry in shown.logprobs.content) == shown.message.content


@pytest.mark.parametrize("max_tokens", [0, 1])
async def test_loglikelihood_request_of_lm_eval_harness(
    cluster: ProcessCluster, smollm2_reference: tuple[Any, Any], max_tokens: int
) -> None:
    """What lm-evaluation-harness's local-completions sends to score choices: a list of
    token-id prompts, echo, logprobs 1, temperature 0 (max_tokens 1; 0 scores alone)."""
    tokenizer, _ = smollm2_reference
    prompts = [
        tokenizer.encode("The capital of France is Paris"),
        tokenizer.encode("The capital of France is a banana"),
    ]
    body = {
        "model": DEFAULT_MODEL,
        "prompt": prompts,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
        "seed": 1234,
    }
    async with httpx.AsyncClient(base_url=cluster.rest_url, timeout=60) as http:
        response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for prompt, choice in zip(prompts, choices, strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + max_tokens
        assert logprobs["token_logprobs"][0] is None
        rows = log_softmax_rows(smollm2_reference, prompt)
        for i in range(1, len(prompt)):
            expected = float(rows[i - 1, prompt[i]])
            assert logprobs["token_logprobs"][i] == pytest.approx(expected, abs=TOLERANCE)
            assert len(logprobs["top_logprobs"][i]) in (1, 2)  # the best, and the token itself
        assert choice["text"].startswith(tokenizer.decode(prompt))
    paris, banana = (sum(c["logprobs"]["token_logprobs"][1:][: len(p) - 1]) for p, c in
                     zip(prompts, choices, strict=True))  # fmt: skip
    assert paris > banana
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == 2 * max_tokens


async def test_repetition_penalty_equals_transformers_generate(
    cluster: ProcessCluster, smollm2_reference: tuple[Any, Any]
) -> None:
    _, model = smollm2_reference
    prompt = chat_prompt(smollm2_reference)
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NUM_TOKENS,
            min_new_tokens=NUM_TOKENS,
            do_sample=False,
            repetition_penalty=1.3,
            pad_token_id=0,
        )
    expected = output[0, len(prompt) :].tolist()
    response = await cluster.openai().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=NUM_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "repetition_penalty": 1.3, "ignore_eos": True},
    )
    assert (response.choices[0].model_extra or {})["token_ids"] == expected


async def test_presence_frequency_and_logit_bias_equal_a_reference(
    cluster: ProcessCluster, smollm2_reference: tuple[Any, Any]
) -> None:
    _, model = smollm2_reference
    prompt = chat_prompt(smollm2_reference)
    presence, frequency, bias = 0.8, 0.6, {"28": 3.0, "30": -100.0}
    sequence = list(prompt)
    expected: list[int] = []
    with torch.no_grad():
        for _ in range(NUM_TOKENS):
            logits = model(torch.tensor([sequence])).logits[0, -1].float()
            for token, value in bias.items():
                logits[int(token)] += value
            for token in set(expected):
                logits[token] -= frequency * expected.count(token) + presence
            expected.append(int(logits.argmax()))
            sequence.append(expected[-1])
    response = await cluster.openai().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=NUM_TOKENS,
        temperature=0,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logit_bias=bias,  # type: ignore[arg-type]
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert (response.choices[0].model_extra or {})["token_ids"] == expected


async def test_n_choices_each_equal_a_single_request_with_its_seed(
    cluster: ProcessCluster,
) -> None:
    client = cluster.openai()
    settings: dict[str, Any] = {
        "model": DEFAULT_MODEL,
        "messages": MESSAGES,
        "max_tokens": NUM_TOKENS,
        "temperature": 1.0,
        "logprobs": True,
        "extra_body": {"return_token_ids": True},
    }
    response = await client.chat.completions.create(**settings, n=3, seed=7)
    assert [c.index for c in response.choices] == [0, 1, 2]
    tokens = [(c.model_extra or {})["token_ids"] for c in response.choices]
    assert len({tuple(t) for t in tokens}) > 1  # three random streams
    for index, choice in enumerate(response.choices):
        single = await client.chat.completions.create(**settings, seed=7 + index)
        assert (single.choices[0].model_extra or {})["token_ids"] == tokens[index]
        assert choice.logprobs is not None and single.choices[0].logprobs is not None
        assert [e.logprob for e in choice.logprobs.content or []] == pytest.approx(
            [e.logprob for e in single.choices[0].logprobs.content or []], abs=TOLERANCE
        )
    assert response.usage is not None
    assert response.usage.completion_tokens == sum(len(t) for t in tokens)
    stream = await client.chat.completions.create(
        **settings, n=3, seed=7, stream=True, stream_options={"include_usage": True}
    )
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            streamed[choice.index].extend((choice.model_extra or {}).get("token_ids", []))
    assert [streamed[i] for i in range(3)] == tokens
    assert usage is not None and usage.completion_tokens == response.usage.completion_tokens


async def test_grpc_stub_gets_n_choices_with_logprobs_and_penalties(
    cluster: ProcessCluster,
) -> None:
    """A gRPC stub gets what the REST API gets: n, logprobs, penalties, logit_bias."""
    sampling = common_pb2.SamplingParams(
        max_tokens=NUM_TOKENS,
        temperature=0.9,
        seed=11,
        presence_penalty=0.5,
        repetition_penalty=1.1,
        logit_bias={28: 1.0},
        logprobs=3,
        ignore_eos=True,
    )
    request = generation_pb2.GenerateRequest(
        model=DEFAULT_MODEL, chat=generation_pb2.ChatMessages(
            messages=[generation_pb2.ChatMessage(role="user", content=MESSAGES[0]["content"])]
        ), sampling=sampling, n=2,
    )  # fmt: skip
    async with grpc.aio.insecure_channel(cluster.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        responses = [r async for r in stub.Generate(request)]
    by_choice: dict[int, list[Any]] = {0: [], 1: []}
    for response in responses:
        by_choice[response.index].append(response)
    rest = await cluster.openai().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=NUM_TOKENS,
        temperature=0.9,
        seed=11,
        presence_penalty=0.5,
        logit_bias={"28": 1.0},
        logprobs=True,
        top_logprobs=3,
        n=2,
        extra_body={"return_token_ids": True, "repetition_penalty": 1.1, "ignore_eos": True},
    )
    for index in (0, 1):
        tokens = [t for r in by_choice[index] for t in r.token_ids]
        logprobs = [lp for r in by_choice[index] for lp in r.logprobs]
        assert tokens == (rest.choices[index].model_extra or {})["token_ids"]
        assert len(logprobs) == len(tokens) == NUM_TOKENS
        assert all(len(lp.top_token_ids) == 3 for lp in logprobs)
        content = rest.choices[index].logprobs.content or []  # type: ignore[union-attr]
        # NOTE: two runs batch the choices differently: equal to float noise.
        assert [lp.logprob for lp in logprobs] == pytest.approx(
            [e.logprob for e in content], abs=TOLERANCE
        )
        assert by_choice[index][-1].usage.num_completion_tokens == NUM_TOKENS


async def test_tokenize_and_detokenize(
    cluster: ProcessCluster, smollm2_reference: tuple[Any, Any]
) -> None:
    async with httpx.AsyncClient(base_url=cluster.rest_url, timeout=60) as http:
        chat = await http.post("/tokenize", json={"model": DEFAULT_MODEL, "messages": MESSAGES})
        text = await http.post("/tokenize", json={"model": DEFAULT_MODEL, "prompt": "Hello sea"})
        tokens = text.json()["tokens"]
        back = await http.post("/detokenize", json={"model": DEFAULT_MODEL, "tokens": tokens})
        bad = await http.post("/detokenize", json={"model": DEFAULT_MODEL, "tokens": [10**6]})
        missing = await http.post("/tokenize", json={"model": DEFAULT_MODEL})
        begun = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
        continued = await http.post(
            "/tokenize",
            json={
                "model": DEFAULT_MODEL,
                "messages": begun,
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
        )
    assert chat.status_code == 200, chat.text
    assert chat.json()["tokens"] == chat_prompt(smollm2_reference)
    assert chat.json()["count"] == len(chat_prompt(smollm2_reference))
    assert chat.json()["max_model_len"] > 0
    tokenizer, _ = smollm2_reference
    assert tokens == tokenizer.encode("Hello sea")
    assert back.json() == {"prompt": "Hello sea"}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert missing.status_code == 400
    assert continued.status_code == 200, continued.text
    assert continued.json()["tokens"] == tokenizer.apply_chat_template(
        begun, add_generation_prompt=False, continue_final_message=True, return_dict=False
    )


async def test_allowed_token_ids_and_bad_words_steer_the_real_model(
    cluster: ProcessCluster, smollm2_reference: tuple[Any, Any]
) -> None:
    """vLLM's filters on the default model, greedy: a bad word's tokens never come out where
    they would finish it (the reply changes), and only allowed ids are sampled."""
    tokenizer, _ = smollm2_reference
    settings: dict[str, Any] = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 24,
        "temperature": 0,
    }
    client = cluster.openai()

    async def reply(**extra: Any) -> tuple[str, list[int]]:
        body = {"return_token_ids": True, **extra}
        choice = (await client.chat.completions.create(**settings, extra_body=body)).choices[0]
        return str(choice.message.content), (choice.model_extra or {})["token_ids"]

    text, token_ids = await reply()
    assert "Paris" in text, text
    banned = [tokenizer.encode(w, add_special_tokens=False) for w in ("Paris", " Paris")]
    steered, steered_ids = await reply(bad_words=["Paris"])
    assert steered_ids != token_ids
    for word in banned:
        assert not any(steered_ids[i : i + len(word)] == word for i in range(len(steered_ids))), (
            steered,
            word,
        )
    allowed = [tokenizer.encode(w, add_special_tokens=False)[0] for w in (" yes", " no", "!")]
    _, picked = await reply(allowed_token_ids=allowed, max_tokens=5)
    assert picked and set(picked) <= set(allowed)


async def test_filters_that_leave_no_token_fail_the_request_by_name(
    cluster: ProcessCluster, smollm2_reference: tuple[Any, Any]
) -> None:
    """Filters that leave out every token end the request with INVALID_REQUEST, on the prefill
    (the first token: a 400) and on the decode (a later one: the stream's error), and the
    cluster goes on serving. Before, the sampler picked token 0, which nothing allowed."""
    tokenizer, _ = smollm2_reference
    bang = tokenizer.encode("!", add_special_tokens=False)[0]
    with pytest.raises(openai.BadRequestError) as refused:
        await cluster.openai().chat.completions.create(
            model=DEFAULT_MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            extra_body={"allowed_token_ids": [bang], "bad_words": ["!"]},
        )
    assert "no token may come next" in refused.value.message
    yes, no = (tokenizer.encode(w, add_special_tokens=False)[0] for w in (" yes", " no"))
    # NOTE: `no` is banned; `yes` comes first, then (yes, yes) bans it: nothing is left.
    sampling = common_pb2.SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0, allowed_token_ids=[yes, no],
        bad_words=[common_pb2.TokenSequence(token_ids=ids) for ids in ([no], [yes, yes])],
    )  # fmt: skip
    request = generation_pb2.GenerateRequest(model=DEFAULT_MODEL, text="Say", sampling=sampling)
    received: list[int] = []
    async with grpc.aio.insecure_channel(cluster.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for response in stub.Generate(request):
                received.extend(response.token_ids)
    assert received == [yes]  # the prefill's token; the decode found none after it
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no token may come next" in str(failed.value.details())
    again = await cluster.openai().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=MESSAGES,
        max_tokens=3,  # type: ignore[arg-type]
    )
    assert again.choices[0].finish_reason == "length"
