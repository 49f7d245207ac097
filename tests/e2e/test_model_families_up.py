"""`pdserve up --model DIR` on a checkpoint directory of a newer family: a dense one with
Gemma 3's layers, ERNIE 4.5 (RoPE over adjacent pairs, a bias on every projection) and
mixtures of experts (Qwen3-MoE; gpt-oss with attention sinks and sliding layers; DeepSeek-V3
with latent attention, whose latent is what the cache holds and the transfer moves), each as
separate gateway, prefill and decode processes, with greedy output equal to transformers'.
(Every family goes through a real prefill and decode over every transport in
tests/integration/prefill.)"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from support.hf_reference import hf_greedy
from support.process_cluster import ProcessCluster
from support.tiny_models import servable_tiny_model

from pdserve.launcher.config import ClusterConfig
from pdserve.tokenizer import Tokenizer

NUM_TOKENS = 24


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe", "ernie4_5", "gpt_oss", "deepseek_v3"])
def test_pdserve_up_serves_a_family_directory_like_transformers(
    family: str, demo_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = servable_tiny_model(family, tmp_path / family, demo_model_dir)
    prompt = "The quick brown fox jumps over the lazy dog"
    prompt_ids = Tokenizer.from_pretrained(model_dir).encode(prompt)
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    expected = hf_greedy(reference, prompt_ids, NUM_TOKENS)
    config = ClusterConfig(
        model=str(model_dir),
        port=0,
        grpc_port=0,
        internal_port=0,
        log_dir=str(tmp_path / "logs"),
        startup_timeout_s=120,
        # NOTE: float32, as the reference (the default picks bfloat16 on a CPU with bf16).
        prefill_args="--dtype float32",
        decode_args="--dtype float32",
    )
    # NOTE: the launcher's cluster on the test process's shared fork server (one fork server's
    # start per family saved); tests/e2e/test_pdserve_up.py starts one of its own.
    cluster = ProcessCluster(config)
    cluster.start()
    try:
        client = openai.OpenAI(base_url=f"{cluster.rest_url}/v1", api_key="unused", max_retries=0)
        model = next(m.id for m in client.models.list())
        assert model == family
        response = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=NUM_TOKENS,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        assert response.choices[0].model_extra["token_ids"] == expected
    finally:
        cluster.stop(timeout_s=20)
