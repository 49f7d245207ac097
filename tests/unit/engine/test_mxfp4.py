"""gpt-oss as released: its experts in MXFP4 (``*_blocks``, ``*_scales``) load as the values they
hold, bit for bit what transformers' own MXFP4 dequantization gives, so the model is the same
checkpoint's in floats: the same logits and greedy tokens as transformers on it, the same
bfloat16 weights as the bfloat16 copy; a pair missing its half is refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.hf_reference import hf_greedy
from support.tiny_models import build_hf_model, pack_mxfp4
from transformers import AutoModelForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, ScheduledChunk
from pdserve.engine.loader import load_model
from pdserve.engine.model_config import ModelLoadError
from pdserve.engine.mxfp4 import dequantize

LOGITS_ATOL = 1e-4
NUM_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the float checkpoint, the same model with its experts packed in MXFP4)."""
    root = tmp_path_factory.mktemp("mxfp4")
    build_hf_model("gpt_oss").save_pretrained(root / "float")
    pack_mxfp4(root / "float", root / "mxfp4")
    return root / "float", root / "mxfp4"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_values_are_transformers_mxfp4_dequantization_bit_for_bit(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 140, (3, 40, 4), dtype=torch.uint8, generator=generator)
    ours = dequantize(blocks, scales, dtype)
    assert ours.shape == (3, 40, 128) and ours.dtype == dtype
    expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [3, 128, 40]
    assert torch.equal(ours.transpose(1, 2), expected)
    assert torch.equal(ours.float(), dequantize(blocks, scales, torch.float32))  # exact in bf16


def test_the_released_form_equals_transformers_on_its_floats(
    checkpoints: tuple[Path, Path],
) -> None:
    floats, packed = checkpoints
    reference = AutoModelForCausalLM.from_pretrained(
        floats, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    engine = LLMEngine(
        EngineConfig(model=str(packed), dtype="float32", seed=0, cache=CacheConfig(num_blocks=32))
    )
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


def test_bfloat16_weights_equal_the_bfloat16_copys(checkpoints: tuple[Path, Path]) -> None:
    floats, packed = checkpoints
    from_floats = dict(load_model(floats, torch.bfloat16).named_parameters())
    from_packed = dict(load_model(packed, torch.bfloat16).named_parameters())
    assert from_floats.keys() == from_packed.keys()
    experts = [name for name in from_packed if ".experts." in name]
    assert experts
    for name, value in from_packed.items():
        assert torch.equal(value, from_floats[name]), name


def test_a_pair_missing_its_half_is_refused_by_name(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    _, packed = checkpoints
    broken = tmp_path / "broken"
    shutil.copytree(packed, broken)
    tensors = load_file(broken / "model.safetensors")
    lost = next(name for name in tensors if name.endswith("down_proj_scales"))
    del tensors[lost]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    kept = lost.removesuffix("_scales") + "_blocks"
    with pytest.raises(ModelLoadError, match=f"{kept!r} has no {lost!r}"):
        load_model(broken, torch.float32)
