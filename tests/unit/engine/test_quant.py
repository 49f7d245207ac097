"""Weight-only int8 / int4 projections: the stored values, the kernels, and the engine."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.engine import LLMEngine, ScheduledChunk
from pdserve.engine.model import Linear
from pdserve.engine.quant import (
    INT4_GROUP_SIZE,
    INT8_KERNEL_MAX_ROWS,
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    quantize_int4,
    quantize_int8,
    quantize_linears,
)

EngineFactory = Callable[..., LLMEngine]
PromptFactory = Callable[..., list[list[int]]]


def random_linear(in_features: int, out_features: int, dtype: torch.dtype) -> Linear:
    linear = Linear(in_features, out_features, bias=True)
    generator = torch.Generator().manual_seed(in_features + out_features)
    with torch.no_grad():
        linear.weight_t.copy_(torch.randn(in_features, out_features, generator=generator))
        assert linear.bias is not None
        linear.bias.copy_(torch.randn(out_features, generator=generator))
    return linear.to(dtype)


def test_int8_rounds_each_weight_to_within_half_a_step() -> None:
    weight = torch.randn(48, 96) * torch.rand(48, 1) * 4
    values, scales = quantize_int8(weight)
    assert values.dtype == torch.int8 and scales.shape == (48,)
    error = (values.float() * scales[:, None] - weight).abs()
    assert (error <= scales[:, None] / 2 + 1e-6).all()
    # the largest weight of each row takes the full range
    assert (values.abs().amax(dim=1) == 127).all()


def test_int4_rounds_each_weight_to_within_half_a_step() -> None:
    weight = torch.randn(32, 128) + torch.linspace(-3, 3, 128)
    values, scale_zeros = quantize_int4(weight, INT4_GROUP_SIZE)
    assert values.min() >= 0 and values.max() <= 15
    assert scale_zeros.shape == (128 // INT4_GROUP_SIZE, 32, 2)
    scales = scale_zeros[..., 0].t().repeat_interleave(INT4_GROUP_SIZE, dim=1)
    error = (dequantize_int4(values, scale_zeros) - weight).abs()
    assert (error <= scales / 2 + 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [5, INT8_KERNEL_MAX_ROWS + 1])
def test_int8_linear_computes_with_its_dequantized_weight(
    dtype: torch.dtype, num_rows: int
) -> None:
    """Both paths (torch's int8 kernel for few rows, a GEMM on the converted weight for more)."""
    linear = random_linear(96, 48, dtype)
    quantized = Int8Linear(linear)
    values, scales = quantize_int8(linear.weight_t.t(), dtype)
    assert linear.bias is not None
    dequantized = values.float() * scales.float()[:, None]
    x = torch.randn(num_rows, 96).to(dtype)
    expected = x.float() @ dequantized.t() + linear.bias.float()
    out = quantized(x)
    assert out.dtype == dtype
    tolerance = 1e-3 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_computes_with_its_dequantized_weight(dtype: torch.dtype) -> None:
    """The kernel's scale and zero convention is the one `quantize_int4` writes."""
    linear = random_linear(128, 48, dtype)
    quantized = Int4Linear.from_linear(linear)
    values, scale_zeros = quantize_int4(linear.weight_t.t(), INT4_GROUP_SIZE, dtype)
    assert linear.bias is not None
    x = torch.randn(5, 128).to(dtype)
    expected = x.float() @ dequantize_int4(values, scale_zeros).t() + linear.bias.float()
    out = quantized(x)
    assert out.dtype == dtype
    tolerance = 1e-3 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=0.01)


def test_quantize_linears_keeps_the_skipped_and_the_shapes_int4_refuses() -> None:
    model = torch.nn.ModuleDict(
        {
            "fits": random_linear(64, 32, torch.bfloat16),
            "odd_out": random_linear(64, 24, torch.bfloat16),
            "head": random_linear(64, 32, torch.bfloat16),
        }
    )
    report = quantize_linears(model, "int4", skip=[model["head"]])
    assert isinstance(model["fits"], Int4Linear)
    assert isinstance(model["odd_out"], Linear) and isinstance(model["head"], Linear)
    assert (report.num_quantized, report.num_kept) == (1, 2)
    with pytest.raises(ValueError, match="int2"):
        quantize_linears(model, "int2")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_engine_stays_close_to_bf16(
    quantization: str, make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    """Every decoder projection is quantized, the LM head is not, and the logits move little."""
    # NOTE: llama_tied: its LM head is the embedding, which must stay shared and unquantized.
    reference = make_engine("llama_tied", dtype="bfloat16")
    engine = make_engine("llama_tied", dtype="bfloat16", quantization=quantization)
    model = engine.runner.model
    kind = Int8Linear if quantization == "int8" else Int4Linear
    num_layers = len(model.model.layers)
    assert sum(isinstance(m, kind) for m in model.modules()) == 4 * num_layers
    assert [m for m in model.modules() if isinstance(m, Linear)] == [model.lm_head]
    sequence = prompts(1, seed=4, min_len=40, max_len=40)[0]
    logits = []
    for each in (reference, engine):
        chunk = ScheduledChunk(sequence, 0, each.block_pool.allocate(3))
        logits.append(each.runner.execute([chunk])[0])
    error = (logits[1] - logits[0]).norm() / logits[0].norm()
    # NOTE: int4 of the tiny model's wide random weights moves its logits by 0.45 (a scrambled
    # weight layout: about 1.4); the real model's perplexity moves by 0.4% (bench/perplexity.py).
    assert 0 < error < (0.05 if quantization == "int8" else 0.6)
