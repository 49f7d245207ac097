"""`n` completions of one prompt through gateway, prefill and decode processes (the demo model,
two decodes): each choice equals a separate request with its seed, token for token, while the
prompt is computed once and its full KV blocks travel to the decode once (the choices share
them there); afterwards every pool is whole."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.process_cluster import (
    ProcessCluster,
    running_cluster,
    stream_choices,
    stream_token_ids,
)
from support.real_cluster import Reference

BLOCK_SIZE = 16  # the instances' default
NUM_CHOICES = 4
# NOTE: the later choices share the first one's blocks only while it runs: they start at its
# first token, and on a busy machine their prefill and lease can take a good part of a 24-token
# stream (~0.1 s here); 96 tokens were once not enough beside a CPU hog, 320 leave them more.
MAX_TOKENS = 320
GREEDY: dict[str, Any] = {"temperature": 0.0}
SEEDED: dict[str, Any] = {"temperature": 0.8, "top_p": 0.95, "seed": 41}


@pytest.fixture(scope="module")
def reference(demo_model_dir: Path) -> Reference:
    return Reference(demo_model_dir)


@pytest.fixture(scope="module")
def cluster(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running_cluster(
        demo_model_dir,
        tmp_path_factory.mktemp("logs"),
        decodes=2,
        prefill_args="--num-blocks 512",
        decode_args="--num-blocks 512",
    ) as running:
        yield running


async def decode_counter(cluster: ProcessCluster, name: str) -> float:
    """A ``pdserve_decode_<name>`` counter summed over the decodes."""
    return sum(
        [await cluster.instance_counter(d, f"pdserve_decode_{name}") for d in cluster.decodes]
    )


async def prefill_counter(cluster: ProcessCluster, name: str) -> float:
    return await cluster.instance_counter(cluster.prefills[0], f"pdserve_prefill_{name}")


def choice_sampling(sampling: dict[str, Any], index: int) -> dict[str, Any]:
    """What choice `index` of a request with `sampling` samples with: its seed plus the index."""
    if "seed" not in sampling:
        return dict(sampling)
    return {**sampling, "seed": sampling["seed"] + index}


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_n_choices_equal_separate_requests_and_the_prompt_travels_once(
    cluster: ProcessCluster, reference: Reference, sampling: dict[str, Any]
) -> None:
    name = "seeded" if "seed" in sampling else "greedy"
    prompt = f"Shared {name} prompt: " + " ".join(f"tide{i % 11} shell{i % 5}" for i in range(18))
    num_tokens = len(reference.tokenizer.encode(prompt))
    num_full = num_tokens // BLOCK_SIZE
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    assert num_full >= 8 and num_blocks == num_full + 1  # a partial last block

    received = await decode_counter(cluster, "kv_received_bytes")
    shared = await decode_counter(cluster, "shared_blocks")
    computed = await prefill_counter(cluster, "prompt_tokens")
    async with cluster.openai() as client:
        choices = await stream_choices(
            client,
            cluster.model_name,
            prompt,
            max_tokens=MAX_TOKENS,
            n=NUM_CHOICES,
            **copy.deepcopy(sampling),
        )
        as_n = await decode_counter(cluster, "kv_received_bytes") - received
        shared_as_n = await decode_counter(cluster, "shared_blocks") - shared
        computed_as_n = await prefill_counter(cluster, "prompt_tokens") - computed
        received = await decode_counter(cluster, "kv_received_bytes")
        separate = [
            await stream_token_ids(
                client,
                cluster.model_name,
                prompt,
                max_tokens=MAX_TOKENS,
                **choice_sampling(sampling, i),
            )
            for i in range(NUM_CHOICES)
        ]
        as_separate = await decode_counter(cluster, "kv_received_bytes") - received

    assert [ids for ids, _ in choices] == separate
    expected = [
        reference.completion(prompt, max_tokens=MAX_TOKENS, **choice_sampling(sampling, i))
        for i in range(NUM_CHOICES)
    ]
    assert separate == expected
    if "seed" in sampling:
        assert len({tuple(ids) for ids in separate}) > 1  # four random streams
    # The three later choices took the prompt's full blocks from the first one's lease and
    # received only their partial block: (num_blocks + 3) blocks moved instead of 4 x num_blocks.
    assert shared_as_n == (NUM_CHOICES - 1) * num_full
    assert as_n * NUM_CHOICES * num_blocks == as_separate * (num_blocks + NUM_CHOICES - 1)
    assert as_n < as_separate / 3
    # The prompt is computed once: the later choices only their tokens after its full blocks.
    assert computed_as_n <= num_tokens + (NUM_CHOICES - 1) * BLOCK_SIZE
    await cluster.wait_whole()
