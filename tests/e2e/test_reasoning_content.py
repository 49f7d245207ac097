"""A chat completion's reasoning as the official `openai` SDK reads it: with
``--reasoning-parser think``, what the model writes between ``<think>`` and ``</think>`` comes
back as ``reasoning_content`` (in the message, and streamed as deltas), the rest as
``content``. The demo model is made to write a think block by a regex constraint."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.process_cluster import ProcessCluster, running_cluster

THINKING = r"<think>[a-z]{3,8}( [a-z]{3,8}){1,3}</think>\n\n[a-z]{3,8}( [a-z]{3,8}){0,2}"
REQUEST: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Is it raining?"}],
    "max_tokens": 120,
    "temperature": 0.8,
    "seed": 7,
    "extra_body": {"structured_outputs": {"regex": THINKING}},
}


@pytest.fixture(scope="module")
def cluster(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessCluster]:
    with running_cluster(
        demo_model_dir,
        tmp_path_factory.mktemp("reasoning-logs"),
        gateway_args="--reasoning-parser think",
    ) as running:
        yield running


async def test_reasoning_content_and_content_whole_and_streamed(cluster: ProcessCluster) -> None:
    async with cluster.openai() as client:
        whole = await client.chat.completions.create(model=cluster.model_name, **REQUEST)
        message = whole.choices[0].message
        reasoning = (message.model_extra or {}).get("reasoning_content")
        assert reasoning and message.content
        assert re.fullmatch(THINKING, f"<think>{reasoning}</think>\n\n{message.content}")
        assert whole.choices[0].finish_reason == "stop"

        stream = await client.chat.completions.create(
            model=cluster.model_name, stream=True, **REQUEST
        )
        streamed_reasoning, streamed_content = "", ""
        async for chunk in stream:
            for choice in chunk.choices:
                streamed_reasoning += (choice.delta.model_extra or {}).get(
                    "reasoning_content"
                ) or ""
                streamed_content += choice.delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, message.content)
