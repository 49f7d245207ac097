"""vLLM's allowed_token_ids and bad_words through the gateway: what reaches the prefill (the
words tokenized, the ids checked against the vocabulary), from REST and gRPC, and only to
instances that advertise the "token-filters" feature (fakes whose tokenizer is bytes plus four
special tokens)."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from support.gateway_cluster import Cluster
from support.gateway_fakes import MODEL_NAME, FakePrefill

from pdserve.common.grpc_server import insecure_channel
from pdserve.common.protocol import FEATURES
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc


def _sent(pd: Cluster) -> common_pb2.SamplingParams:
    return pd.prefills[0].requests[-1].sampling


def _words(sampling: common_pb2.SamplingParams) -> list[list[int]]:
    return [list(word.token_ids) for word in sampling.bad_words]


async def test_rest_filters_reach_the_prefill_tokenized(pd: Cluster) -> None:
    await pd.openai().completions.create(
        model=MODEL_NAME,
        prompt="hello",
        max_tokens=4,
        extra_body={"allowed_token_ids": [120, 98, 97, 98], "bad_words": ["ab", "  cd"]},
    )
    sampling = _sent(pd)
    assert list(sampling.allowed_token_ids) == [97, 98, 120]
    # NOTE: leading spaces dropped; with a byte tokenizer a space is a token of its own, so no
    # second, spaced sequence is added.
    assert _words(sampling) == [[97, 98], [99, 100]]
    await pd.openai().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert not _sent(pd).allowed_token_ids and not _sent(pd).bad_words


async def test_grpc_takes_words_and_token_sequences(pd: Cluster) -> None:
    request = generation_pb2.GenerateRequest(
        model=MODEL_NAME,
        text="hello",
        bad_words=["xy"],
        sampling=common_pb2.SamplingParams(
            max_tokens=4,
            allowed_token_ids=[5, 6],
            bad_words=[common_pb2.TokenSequence(token_ids=[1, 2])],
        ),
    )
    async with insecure_channel(pd.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        responses = [response async for response in stub.Generate(request)]
    assert responses[-1].finish_reason
    assert list(_sent(pd).allowed_token_ids) == [5, 6]
    assert _words(_sent(pd)) == [[120, 121], [1, 2]]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"allowed_token_ids": [260]}, "allowed_token_ids"),  # past the vocabulary (260)
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words": ["   "]}, "bad_words"),
        ({"bad_words": ["x" * 257]}, "bad_words"),
        ({"bad_words": [f"w{i}" for i in range(65)]}, "bad_words"),
    ],
)
async def test_bad_filters_are_refused_by_name(
    pd: Cluster, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await pd.openai().completions.create(
            model=MODEL_NAME, prompt="hello", max_tokens=3, extra_body=extra
        )
    assert raised.value.body["param"] == param  # type: ignore[index]
    assert pd.prefills[0].requests == []


async def test_only_instances_with_the_feature_get_filtered_requests(cluster: Cluster) -> None:
    def without_filters(prefill: FakePrefill) -> None:
        prefill.features = tuple(f for f in FEATURES if f != "token-filters")

    await cluster.start_gateway()
    await cluster.add_prefill(setup=without_filters)
    await cluster.add_decode()
    client = cluster.openai()
    plain = await client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2)
    assert plain.choices[0].finish_reason == "length"
    with pytest.raises(openai.APIStatusError) as raised:
        await client.completions.create(
            model=MODEL_NAME, prompt="hello", max_tokens=2, extra_body={"bad_words": ["ab"]}
        )
    assert raised.value.status_code == 503
    assert "token-filters" in str(raised.value)
