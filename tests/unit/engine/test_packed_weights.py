"""Checkpoints as released with packed weights load as the values they hold: gpt-oss's MXFP4
experts (``*_blocks``, ``*_scales``), bit for bit what transformers' own MXFP4 dequantization
gives, DeepSeek-V3's block FP8 projections (float8 e4m3 with ``*_scale_inv``; Qwen3's FP8
releases have the same form), as transformers' FP8 dequantization computes them, and
compressed-tensors' FP8 (a ``*_scale`` per row; the static ``input_scale`` left out). Each
model is then the same checkpoint's in floats: the same logits and greedy tokens as
transformers on it, the same bfloat16 weights as the bfloat16 copy; a pair missing its half,
and any other quantization (GPTQ, AWQ, ...), is refused by name."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file
from structlog.testing import capture_logs
from support.hf_reference import hf_greedy
from support.tiny_models import (
    EAGER_ONLY,
    build_hf_model,
    pack_fp8,
    pack_fp8_channels,
    pack_mxfp4,
)
from transformers import AutoModelForCausalLM
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import pdserve.engine.cpu_kernels as cpu_kernels
import pdserve.engine.int4_kernel as int4_kernel
import pdserve.engine.int8_kernel as int8_kernel
from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, ScheduledChunk
from pdserve.engine.loader import KERNEL_IMAGE_DIR, load_model
from pdserve.engine.model_config import ModelLoadError, MoeConfig
from pdserve.engine.moe import E2M1_TABLE, Experts, KeptExperts
from pdserve.engine.packed_weights import (
    E2M1_VALUES,
    dequantize_fp8,
    dequantize_mxfp4,
    mxfp4_as_int8,
    mxfp4_codes,
)
from pdserve.engine.quant import weight_bytes

LOGITS_ATOL = 1e-4
NUM_NEW_TOKENS = 24
FP8_BLOCK = (16, 16)  # NOTE: smaller than the tiny weights, with partial blocks at their ends


class Released(NamedTuple):
    """A tiny model as released with packed weights, and the same model in floats."""

    family: str
    floats: Path
    packed: Path


PACKERS: dict[str, tuple[str, Callable[[Path, Path], None]]] = {
    "mxfp4": ("gpt_oss", pack_mxfp4),
    "fp8": ("deepseek_v3", lambda floats, packed: pack_fp8(floats, packed, FP8_BLOCK)),
    "fp8-qwen3": ("qwen3", lambda floats, packed: pack_fp8(floats, packed, FP8_BLOCK)),
    "fp8-channels": ("llama3", pack_fp8_channels),
}


@pytest.fixture(scope="module", params=sorted(PACKERS))
def released(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Released:
    family, pack = PACKERS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    build_hf_model(family).save_pretrained(root / "float")
    pack(root / "float", root / "packed")
    return Released(family, root / "float", root / "packed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_values_are_transformers_dequantization_bit_for_bit(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 140, (3, 40, 4), dtype=torch.uint8, generator=generator)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    assert ours.shape == (3, 40, 128) and ours.dtype == dtype
    expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [3, 128, 40]
    assert torch.equal(ours.transpose(1, 2), expected)
    # NOTE: exact in bfloat16 too
    assert torch.equal(ours.float(), dequantize_mxfp4(blocks, scales, torch.float32))
    # NOTE: and as int8 groups of 32 with a power-of-two scale each
    values, halves = mxfp4_as_int8(blocks, scales)
    assert values.dtype == torch.int8 and int(values.abs().max()) <= 12
    assert torch.equal(values.float() * halves.repeat_interleave(32, dim=-1), ours.float())
    # NOTE: and as one code a value with its block's scale
    codes, powers = mxfp4_codes(blocks, scales)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    table = torch.tensor(E2M1_VALUES)
    assert torch.equal(table[codes.long()] * powers.repeat_interleave(32, dim=-1), ours.float())


@pytest.mark.parametrize("shape", [(40, 70), (2, 33, 48)])
def test_fp8_values_are_transformers_dequantization(shape: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(shape, generator=generator) * 50).to(torch.float8_e4m3fn)
    grid = (*shape[:-2], -(-shape[-2] // 16), -(-shape[-1] // 16))
    scale_inv = torch.rand(grid, generator=generator) / 100
    ours = dequantize_fp8(weight, scale_inv, FP8_BLOCK, torch.float32)
    expected = _dequantize_fp8_weight(weight, scale_inv, list(FP8_BLOCK), torch.float32)
    assert torch.equal(ours, expected)
    with pytest.raises(ModelLoadError, match="has scales"):
        dequantize_fp8(weight, scale_inv[..., :-1], FP8_BLOCK, torch.float32)


def test_the_released_form_equals_transformers_on_its_floats(released: Released) -> None:
    reference = AutoModelForCausalLM.from_pretrained(
        released.floats,
        dtype=torch.float32,
        attn_implementation="eager" if released.family in EAGER_ONLY else "sdpa",
    ).eval()
    config = EngineConfig(
        model=str(released.packed), dtype="float32", seed=0, cache=CacheConfig(num_blocks=32)
    )
    engine = LLMEngine(config)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 290, (n,), generator=generator).tolist() for n in (7, 19, 33)]
    chunk = ScheduledChunk(prompts[-1], 0, engine.block_pool.allocate(3))
    logits = engine.runner.execute([chunk])[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompts[-1]])).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0)
    engine.block_pool.free(chunk.block_ids)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    for prompt, output in zip(prompts, engine.generate(prompts, params), strict=True):
        assert output == hf_greedy(reference, prompt, NUM_NEW_TOKENS)


def test_bfloat16_weights_equal_the_bfloat16_copys(released: Released) -> None:
    from_floats = dict(load_model(released.floats, torch.bfloat16).named_parameters())
    packed = load_model(released.packed, torch.bfloat16, quantization="none")
    from_packed = dict(packed.named_parameters())
    assert from_floats.keys() == from_packed.keys()
    for name, value in from_packed.items():
        assert torch.equal(value, from_floats[name]), name


def test_a_pair_missing_its_half_is_refused_by_name(released: Released, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(released.packed, broken)
    tensors = load_file(broken / "model.safetensors")
    halves = ("down_proj_scales", "_scale_inv", "down_proj.weight_scale")
    lost = next(name for name in tensors if name.endswith(halves))
    del tensors[lost]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    if lost.endswith("_scales"):
        words = f"packed tensor {lost.removesuffix('_scales') + '_blocks'!r} has no {lost!r}"
    else:
        words = f"the float8 tensor {lost.rpartition('_scale')[0]!r} has no scale"
    with pytest.raises(ModelLoadError, match=re.escape(words)):
        load_model(broken, torch.float32)


@pytest.mark.parametrize(
    ("quantization", "named"),
    [({"quant_method": "gptq", "bits": 4}, "gptq"),
     ({"quant_method": "awq"}, "awq"),
     ({"quant_method": "compressed-tensors", "format": "pack-quantized"},
      "compressed-tensors (pack-quantized)")],
)  # fmt: skip
def test_other_quantization_is_refused_by_name_before_any_weight_is_read(
    tmp_path: Path, quantization: dict[str, object], named: str
) -> None:
    other = tmp_path / "other"
    build_hf_model("llama3").save_pretrained(other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ModelLoadError, match=re.escape(f"quantized with {named}, which")):
        load_model(other, torch.float32)


def _mxfp4_released(tmp_path: Path) -> Path:
    build_hf_model("gpt_oss").save_pretrained(tmp_path / "float")
    pack_mxfp4(tmp_path / "float", tmp_path / "packed")
    return tmp_path / "packed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_stay_the_checkpoints_values(tmp_path: Path, dtype: torch.dtype) -> None:
    """The experts keep their 4-bit codes (on the int4 kernels' e2m1 table, bf16 and
    float32): each weight the checkpoint's value."""
    packed = _mxfp4_released(tmp_path)
    kept = load_model(packed, dtype)
    floats = load_model(packed, dtype, quantization="none")
    assert weight_bytes(kept) < 0.75 * weight_bytes(floats)
    form = "mxfp4"
    for layer, reference in zip(kept.model.layers, floats.model.layers, strict=True):
        experts = layer.mlp.experts
        assert isinstance(experts, KeptExperts) and type(reference.mlp.experts) is Experts
        for which, float_weight in (("gate_up", reference.mlp.experts.gate_up_proj),
                                    ("down", reference.mlp.experts.down_proj)):  # fmt: skip
            values, scales = (
                getattr(experts, f"{which}_values"),
                getattr(experts, f"{which}_scales"),
            )
            assert experts.forms[which] == form and scales.dtype == torch.float16
            if form == "mxfp4":
                # NOTE: two codes a byte, no mins: 4.5 bits a weight with the scales
                assert values.dtype == torch.uint8 and values.numel() * 2 == float_weight.numel()
                assert getattr(experts, f"{which}_mins") is None
                weight = torch.stack([int4_kernel.dequantize(v, s, None, dtype, E2M1_TABLE)
                                      for v, s in zip(values, scales, strict=True)])  # fmt: skip
            else:
                assert values.dtype == torch.int8
                weight = values.float() * scales.float().repeat_interleave(32, dim=-1)
            # NOTE: [experts, out, in] here, [experts, in, out] in floats: the same values
            assert torch.equal(weight.transpose(1, 2).to(dtype), float_weight.detach())


def test_mxfp4_experts_the_int4_kernel_cannot_take_are_int8_groups_of_their_values() -> None:
    """An input width that is not a multiple of 64 (the int4 kernel's step) but of 32 (the
    int8 kernel's group): int8 groups, each the checkpoint's value."""
    moe = MoeConfig(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=96,
                    norm_topk_prob=False, moe_layers=(True,))  # fmt: skip
    assert KeptExperts.mxfp4_form(128, 96, torch.bfloat16) == "int8"
    experts = KeptExperts(moe, 128, "silu").to(torch.bfloat16)
    generator = torch.Generator().manual_seed(4)
    for part, (out, cols) in {"gate_up_proj": (192, 128), "down_proj": (128, 96)}.items():
        blocks = torch.randint(0, 256, (2, out, cols // 32, 16), dtype=torch.uint8,
                               generator=generator)  # fmt: skip
        scales = torch.randint(118, 130, (2, out, cols // 32), dtype=torch.uint8,
                               generator=generator)  # fmt: skip
        experts.load_mxfp4(part, mxfp4_codes(blocks, scales), torch.bfloat16)
        which = part.removesuffix("_proj")
        values, halves = getattr(experts, f"{which}_values"), getattr(experts, f"{which}_scales")
        weight = values.float() * halves.float().repeat_interleave(32, dim=-1)
        assert torch.equal(weight, dequantize_mxfp4(blocks, scales, torch.float32))
    assert experts.forms == {"gate_up": "int8", "down": "int8"}


def test_mxfp4_experts_kept_map_one_image_that_every_load_shares(tmp_path: Path) -> None:
    """The experts repacked for the kernel are written once to an image in the checkpoint's
    directory (not a shard of it) and every later load maps the same pages."""
    packed = _mxfp4_released(tmp_path)
    loads = []
    for _ in range(2):
        with capture_logs() as logs:
            model = load_model(packed, torch.bfloat16)
        (mapped,) = [entry for entry in logs if entry["event"] == "kernel_image_mapped"]
        loads.append((model, mapped))
    assert [mapped["written"] for _, mapped in loads] == [True, False]
    image = Path(loads[0][1]["path"])
    assert image.parent == packed / KERNEL_IMAGE_DIR and not list(packed.glob("kernels-*"))
    inodes = set()
    for model, _ in loads:
        for layer in model.model.layers:
            experts = layer.mlp.experts
            assert isinstance(experts, KeptExperts) and set(experts.forms.values()) == {"mxfp4"}
            inodes |= {_mapped_inode(buffer) for buffer in experts.buffers()}
    assert inodes == {image.stat().st_ino}


def _mapped_inode(tensor: torch.Tensor) -> int:
    """The inode of the file mapping `tensor` lies in (0: none)."""
    pointer = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= pointer < high:
                return int(fields[4])
    return 0


def test_mxfp4_experts_kept_give_the_dequantized_ones_logits_in_bfloat16(
    tmp_path: Path,
) -> None:
    """Within bfloat16's rounding: another summation order (the int4 kernel's) moves a
    logit by a few units of its last place, which can flip a random tiny model's near-ties;
    greedy tokens against transformers are compared in float32 above."""
    packed = _mxfp4_released(tmp_path)
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 290, (40,), generator=generator).tolist()
    logits = {}
    for quantization in ("auto", "none"):
        engine = LLMEngine(
            EngineConfig(
                model=str(packed),
                dtype="bfloat16",
                seed=0,
                quantization=quantization,
                cache=CacheConfig(num_blocks=32),
            )
        )
        assert isinstance(engine.runner.model.model.layers[0].mlp.experts, KeptExperts) == (
            quantization == "auto"
        )
        chunk = ScheduledChunk(prompt, 0, engine.block_pool.allocate(3))
        logits[quantization] = engine.runner.execute([chunk])[0].float()
    scale = float(logits["none"].abs().max())
    torch.testing.assert_close(logits["auto"], logits["none"], atol=0.02 * scale, rtol=0)


def test_mxfp4_experts_that_the_kernel_cannot_take_are_dequantized_and_say_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed = _mxfp4_released(tmp_path)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with capture_logs() as logs:
        model = load_model(packed, torch.bfloat16)
    assert type(model.model.layers[0].mlp.experts) is Experts
    (line,) = [entry for entry in logs if entry["event"] == "mxfp4_experts"]
    assert line["became"] == "bfloat16"
    assert line["why_not"] == int8_kernel.why_not(torch.bfloat16, 64)
    assert "2 threads" in line["why_not"] or cpu_kernels.why_unavailable(torch.bfloat16)
