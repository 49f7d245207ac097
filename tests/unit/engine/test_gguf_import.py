"""`convert_gguf` against transformers reading the same GGUF file: logits, greedy tokens, tokenizer.

Each test writes a tiny random GGUF the way llama.cpp's converter does (see
`tests.support.gguf_files`), converts it, and runs pdserve on the result next to transformers'
own GGUF loader, which is the reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from support.gguf_files import TinyGgufSpec, write_tiny_gguf
from support.hf_reference import hf_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, ScheduledChunk
from pdserve.engine.gguf_import import (
    SUPPORTED_TENSOR_TYPES,
    convert_gguf,
    supported_architectures,
)
from pdserve.tokenizer import Tokenizer
from pdserve.tokenizer.gguf_metadata import SUPPORTED_TOKENIZER_MODELS

# fp32 on CPU: both sides dequantize the same blocks and differ only in summation order (pdserve's
# float32 RMSNorm sums its squares in eight lanes: Q5_1's largest gap was 1.1e-4 with it).
LOGITS_ATOL = 2e-4
NUM_NEW_TOKENS = 8
GGUF_NAME = "model.gguf"
CHAT = [{"role": "user", "content": "hello world 123"}]
MESSAGES = [
    {"role": "system", "content": "Sé breve 👋"},
    {"role": "user", "content": "hello <think>\n\n12345"},
]
TEXTS = (
    "hello world",
    "the café is naïve ",
    "👋 emoji 👨\u200d👩\u200d👧",
    "<|im_start|>user\nhello<|im_end|><|endoftext|>",
    "<think>x</think>",
    "  leading spaces",
    "\n\nnew lines\n",
    "if x:\n\t\treturn 12345",
    "it's you'll",
)


def write_gguf(tmp_path: Path, spec: TinyGgufSpec) -> Path:
    return write_tiny_gguf(tmp_path / GGUF_NAME, spec)


def convert(gguf_path: Path) -> Path:
    out_dir = gguf_path.parent / "converted"
    out_dir.mkdir()
    convert_gguf(gguf_path, out_dir)
    return out_dir


def load_transformers(gguf_path: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()


def assert_matches_transformers(gguf_path: Path) -> None:
    """pdserve on the converted directory gives transformers' logits and greedy tokens."""
    model_dir = convert(gguf_path)
    config = EngineConfig(
        model=str(model_dir), dtype="float32", seed=0, cache=CacheConfig(num_blocks=8)
    )
    engine = LLMEngine(config)
    reference = load_transformers(gguf_path)
    prompt = Tokenizer.from_pretrained(model_dir).encode_chat(CHAT)

    chunk = ScheduledChunk(prompt, 0, engine.block_pool.allocate(2))
    logits = engine.runner.execute([chunk])[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0)

    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    assert engine.generate([prompt], params)[0] == hf_greedy(reference, prompt, NUM_NEW_TOKENS)


@pytest.mark.parametrize("tensor_type", SUPPORTED_TENSOR_TYPES, ids=lambda t: t.name)
def test_llama_in_every_tensor_type_matches_transformers(
    tmp_path: Path, tensor_type: GGMLQuantizationType
) -> None:
    """Dequantization, renaming, the q/k row un-permutation and an untied LM head."""
    assert_matches_transformers(write_gguf(tmp_path, TinyGgufSpec(tensor_type=tensor_type)))


def test_qwen2_with_biases_and_tied_embeddings_matches_transformers(tmp_path: Path) -> None:
    spec = TinyGgufSpec(
        architecture="qwen2",
        tensor_type=GGMLQuantizationType.Q8_0,
        tokenizer_pre="qwen2",
        add_bos_token=False,
        tie_word_embeddings=True,
    )
    assert_matches_transformers(write_gguf(tmp_path, spec))


@pytest.mark.parametrize(
    ("tokenizer_pre", "add_bos_token"),
    [("llama-bpe", True), ("qwen2", False), ("smollm", False), ("tekken", False)],
)
def test_tokenizer_matches_transformers(
    tmp_path: Path, tokenizer_pre: str, add_bos_token: bool
) -> None:
    """Pre-tokenizer split, merges, special and user-defined tokens, BOS, the chat template."""
    spec = TinyGgufSpec(tokenizer_pre=tokenizer_pre, add_bos_token=add_bos_token)
    gguf_path = write_gguf(tmp_path, spec)
    ours = Tokenizer.from_pretrained(convert(gguf_path))
    theirs = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)

    assert ours.vocab_size == len(theirs)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    assert ours.apply_chat_template(MESSAGES) == theirs.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    assert ours.encode_chat(MESSAGES) == theirs.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_dict=False
    )
    assert ours.eos_token_ids == (theirs.eos_token_id,)


@pytest.mark.parametrize(
    ("spec", "unsupported", "supported"),
    [
        (TinyGgufSpec(architecture="gpt2"), "gpt2", supported_architectures()),
        (
            TinyGgufSpec(tensor_type=GGMLQuantizationType.TQ1_0),
            "TQ1_0",
            [t.name for t in SUPPORTED_TENSOR_TYPES],
        ),
        (TinyGgufSpec(tokenizer_model="bert"), "bert", SUPPORTED_TOKENIZER_MODELS),
    ],
    ids=["architecture", "tensor_type", "tokenizer_model"],
)
def test_unsupported_file_is_refused_with_what_is_supported(
    tmp_path: Path, spec: TinyGgufSpec, unsupported: str, supported: list[str]
) -> None:
    gguf_path = write_gguf(tmp_path, spec)
    out_dir = tmp_path / "converted"
    out_dir.mkdir()
    with pytest.raises(ValueError) as error:
        convert_gguf(gguf_path, out_dir)
    message = str(error.value)
    assert unsupported in message
    assert all(name in message for name in supported), message
    assert not any(out_dir.iterdir())
