"""`convert_gguf` on the architectures beyond Llama and Qwen2, checked against transformers.

Round trip: a tiny transformers model is written to GGUF the way llama.cpp converts it
(`support.gguf_from_hf`), converted back, and the directory must hold the checkpoint that
``save_pretrained`` wrote (names, shapes, values) and a config under which transformers computes
the original model's logits. Where transformers' own GGUF loader reads the architecture, its model
of the same file must compute the same logits too. The K-quants are covered on Qwen3 by a random
quantized file (`support.gguf_files`) against transformers' loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.numpy import load_file
from support.gguf_files import TinyGgufSpec, write_tiny_gguf
from support.gguf_from_hf import TinyHfSpec, tiny_hf_model, write_hf_as_gguf
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, ScheduledChunk
from pdserve.engine.gguf_import import convert_gguf

# fp32 on CPU: the same weights, differing only in summation order.
LOGITS_ATOL = 1e-4
# Gemma's norms come back as (w + 1) - 1 in float32.
WEIGHT_ATOL = 1e-6
PROMPT_LENGTH = 24

SPECS = {
    # NOTE: head_dim 128 differs from hidden_size / num_heads (64), as in Qwen3; transformers'
    # GGUF loader assumes 128 for qwen3, so its model of the file is comparable too.
    "qwen3": TinyHfSpec("qwen3", "qwen3", {"num_hidden_layers": 2, "head_dim": 128}),
    # NOTE: transformers' GGUF loader does not read expert_feed_forward_length and assumes 768.
    "qwen3_moe": TinyHfSpec(
        "qwen3_moe",
        "qwen3moe",
        {
            "num_hidden_layers": 2,
            "head_dim": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
        },
    ),
    "mixtral": TinyHfSpec(
        "mixtral",
        "llama",
        {"num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
        vocab="llama",
    ),
    # NOTE: Mixtral files from before 2024 hold one tensor per expert (blk.N.ffn_gate.E).
    "mixtral-per-expert-tensors": TinyHfSpec(
        "mixtral",
        "llama",
        {"num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
        vocab="llama",
        is_expert_stacked=False,
    ),
    # NOTE: six layers make the sixth a global one; a window of 4 under a 24-token prompt, a
    # 1/sqrt(head_dim) query scale and linear RoPE scaling on the global layer all show.
    "gemma3_text": TinyHfSpec(
        "gemma3_text",
        "gemma3",
        {
            "num_hidden_layers": 6,
            "head_dim": 64,
            "query_pre_attn_scalar": 64,
            "sliding_window": 4,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        },
        vocab="gemma",
    ),
    "phi3": TinyHfSpec("phi3", "phi3", {"num_hidden_layers": 2}, vocab="llama"),
    # NOTE: Phi-4-mini (a phi3 file) rotates 3/4 of each head; the file says so only through
    # rope.dimension_count, which transformers' GGUF loader does not read.
    "phi3-partial-rotary": TinyHfSpec(
        "phi3", "phi3", {"num_hidden_layers": 2, "partial_rotary_factor": 0.5}, vocab="llama"
    ),
}
# The files transformers' own GGUF loader reads right (it reads mixtral as llama, leaves gemma3's
# query scale and RoPE scaling and phi3's partial rotary at their defaults).
READ_BY_TRANSFORMERS = ("qwen3", "qwen3_moe", "phi3")
# Config values a GGUF does not carry (training settings, defaults of the class).
NOT_IN_GGUF = {
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "initializer_range",
    "use_cache", "attention_dropout", "router_aux_loss_coef", "output_router_logits",
    "router_jitter_noise", "embd_pdrop", "resid_pdrop", "max_window_layers",
    "use_sliding_window", "use_bidirectional_attention", "architectures",
    # the tokenizer's ids, which the tiny originals leave unset
    "bos_token_id", "eos_token_id", "pad_token_id",
}  # fmt: skip


def same_value(converted: object, original: object) -> bool:
    # NOTE: GGUF stores floats as float32 (rms_norm_eps).
    if isinstance(original, float) and isinstance(converted, float):
        return converted == pytest.approx(original, rel=1e-6)
    return converted == original


def logits(model: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def convert(gguf_path: Path) -> Path:
    out_dir = gguf_path.parent / "converted"
    out_dir.mkdir()
    convert_gguf(gguf_path, out_dir)
    return out_dir


def load(model_dir: Path, gguf_file: str | None = None) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=gguf_file, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()


class RoundTrip(NamedTuple):
    """One architecture's original model, its GGUF and the directory converted from that."""

    name: str
    spec: TinyHfSpec
    model: PreTrainedModel
    gguf_path: Path
    model_dir: Path


@pytest.fixture(params=list(SPECS), scope="module")
def round_trip(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> RoundTrip:
    spec = SPECS[request.param]
    work_dir = tmp_path_factory.mktemp(request.param)
    model = tiny_hf_model(spec)
    gguf_path = write_hf_as_gguf(model, spec, work_dir)
    return RoundTrip(request.param, spec, model, gguf_path, convert(gguf_path))


def test_converted_checkpoint_equals_save_pretrained(round_trip: RoundTrip) -> None:
    """Every tensor under the name and shape transformers writes, with the original values."""
    expected = load_file(str(round_trip.gguf_path.parent / "hf" / "model.safetensors"))
    converted = load_file(str(round_trip.model_dir / "model.safetensors"))

    assert sorted(converted) == sorted(expected)
    for name, values in expected.items():
        np.testing.assert_allclose(converted[name], values, rtol=0, atol=WEIGHT_ATOL, err_msg=name)


def test_converted_config_equals_the_original(round_trip: RoundTrip) -> None:
    original = round_trip.model.config.to_dict()
    converted = AutoConfig.from_pretrained(round_trip.model_dir).to_dict()
    if original.get("head_dim", 0) is None:
        # NOTE: the conversion states the head size (Mixtral's config leaves it implied).
        original["head_dim"] = original["hidden_size"] // original["num_attention_heads"]

    assert converted["model_type"] == round_trip.spec.model_type
    differing = {
        key: (value, converted.get(key))
        for key, value in original.items()
        if key not in NOT_IN_GGUF and not same_value(converted.get(key), value)
    }
    assert not differing


def test_converted_model_computes_the_original_logits(round_trip: RoundTrip) -> None:
    model = round_trip.model
    prompt = np.random.default_rng(1).integers(0, model.config.vocab_size, PROMPT_LENGTH).tolist()

    torch.testing.assert_close(
        logits(load(round_trip.model_dir), prompt),
        logits(model, prompt),
        atol=LOGITS_ATOL,
        rtol=0,
    )


def test_transformers_reads_the_same_gguf_as_the_converted_model(round_trip: RoundTrip) -> None:
    if round_trip.name not in READ_BY_TRANSFORMERS:
        pytest.skip(f"transformers' GGUF loader does not read {round_trip.name} right")
    vocab_size = round_trip.model.config.vocab_size
    prompt = np.random.default_rng(2).integers(0, vocab_size, PROMPT_LENGTH).tolist()
    gguf_path = round_trip.gguf_path
    reference = load(gguf_path.parent, gguf_file=gguf_path.name)

    torch.testing.assert_close(
        logits(load(round_trip.model_dir), prompt),
        logits(reference, prompt),
        atol=LOGITS_ATOL,
        rtol=0,
    )


@pytest.mark.parametrize(
    "tensor_type",
    [GGMLQuantizationType[name] for name in ("Q4_K", "Q5_K", "Q6_K", "Q8_0")],
    ids=lambda t: t.name,
)
def test_quantized_qwen3_matches_transformers(
    tmp_path: Path, tensor_type: GGMLQuantizationType
) -> None:
    """K-quants and Q8_0 dequantize the same on an architecture with q/k norms and head_dim."""
    spec = TinyGgufSpec(architecture="qwen3", tensor_type=tensor_type, tokenizer_pre="qwen2")
    gguf_path = write_tiny_gguf(tmp_path / "model.gguf", spec)
    reference = load(tmp_path, gguf_file=gguf_path.name)
    prompt = list(range(3, 3 + PROMPT_LENGTH))

    torch.testing.assert_close(
        logits(load(convert(gguf_path)), prompt),
        logits(reference, prompt),
        atol=LOGITS_ATOL,
        rtol=0,
    )


def test_the_engine_serves_the_converted_directory_with_the_original_logits(
    round_trip: RoundTrip,
) -> None:
    model = round_trip.model
    prompt = np.random.default_rng(3).integers(0, model.config.vocab_size, PROMPT_LENGTH).tolist()
    config = EngineConfig(
        model=str(round_trip.model_dir), dtype="float32", cache=CacheConfig(num_blocks=8)
    )
    engine = LLMEngine(config)
    block_ids = engine.block_pool.allocate(2)
    chunk = ScheduledChunk(prompt, 0, block_ids)
    _, every = engine.runner.execute_with_positions([chunk], every_position=(0,))
    # NOTE: the engine's fused projections (and oneDNN GEMMs) sum in another order than
    # transformers; at these widths (hidden 256) that moves a few logits by about 1e-4.
    torch.testing.assert_close(every[0], logits(model, prompt), atol=2 * LOGITS_ATOL, rtol=0)
