"""`pdserve up --prefill-args="--tensor-parallel-size 2" --decode-args="--tensor-parallel-size 3"`:
the default model (9 query and 3 KV heads) with a prefill split over two ranks (unevenly: one
KV head and its 3 query heads on one rank, two and 6 on the other) and a decode split over
three answers exactly as transformers, i.e. as unsplit instances do."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from support.hf_reference import chat_greedy
from support.process_cluster import ProcessCluster, events_named, running_cluster

from pdserve.engine.model_store import DEFAULT_MODEL, ResolvedModel

MAX_TOKENS = 24
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def split_cluster(
    smollm2: ResolvedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessCluster]:
    with running_cluster(
        smollm2.path,
        tmp_path_factory.mktemp("logs"),
        prefill_args="--tensor-parallel-size 2 --num-threads 1",
        decode_args="--tensor-parallel-size 3 --num-threads 1",
    ) as running:
        yield running


def expected_ids(smollm2_reference: tuple[Any, Any]) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy ids up to and including the end token) from transformers."""
    return chat_greedy(smollm2_reference, MESSAGES, MAX_TOKENS)


async def test_split_decode_serves_the_default_model_exactly(
    split_cluster: ProcessCluster, smollm2_reference: tuple[Any, Any]
) -> None:
    (prefill,), (decode,) = split_cluster.prefills, split_cluster.decodes
    assert events_named(prefill, "tensor_parallel_ready")[0]["world_size"] == 2
    assert events_named(decode, "tensor_parallel_ready")[0]["world_size"] == 3
    prompt_ids, expected = expected_ids(smollm2_reference)
    response = await split_cluster.openai().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    extra = response.choices[0].model_extra or {}
    assert extra["prompt_token_ids"] == prompt_ids
    assert extra["token_ids"] == expected
