"""GGUF files as people get them: llama.cpp's ``convert_hf_to_gguf.py`` output, served exactly.

For every family pdserve serves, a tiny random transformers checkpoint (`support.tiny_models`,
with the byte-level demo tokenizer) is converted to a float32 GGUF by llama.cpp's own converter
(`support.llama_convert`), and that file is converted back with `convert_gguf`. The directory
must hold the original checkpoint's tensors, tokenize as the original tokenizer does, and the
engine on it must produce transformers' greedy tokens on the original checkpoint. Llama,
Mistral, Phi-3 and Gemma 3 are converted a second time with a SentencePiece ``tokenizer.model``,
the converter's other vocabulary path; ERNIE 4.5, whose converter reads only that path, has a
SentencePiece tokenizer alone, and GLM-4.5 the special tokens its converter looks up. Our own
test writer (`support.gguf_from_hf`) is held to the converter's tensors and metadata on the
same checkpoints of the families it writes.

A checkpoint is changed only where the converter cannot represent it (the GGUF carries no such
setting, so llama.cpp itself serves the model without it): no sliding window on Mistral and
Mixtral (``llama`` files have none), no dense layers between Qwen3-MoE's expert layers, and
Gemma 3 with llama.cpp's fixed layout (every sixth layer global, queries scaled by
``1/sqrt(head_dim)``), SmolLM3 with its released layout (RoPE left out of every fourth layer),
gpt-oss with llama.cpp's fixed SwiGLU limit (7, as released). DeepSeek-V3's checkpoint states
its sigmoid routing (``scoring_func``, as the released config does; transformers does not
write it), without which the converter writes a file llama.cpp routes by softmax.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import sentencepiece
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader
from safetensors.numpy import load_file, save_file
from structlog.testing import capture_logs
from support.gguf_files import requantized
from support.gguf_from_hf import TinyHfSpec, gguf_tensors
from support.hf_reference import hf_greedy
from support.llama_convert import CONVERTER, ConversionJob, convert_with_llama_cpp
from support.tiny_models import EAGER_ONLY, build_hf_model, pack_mxfp4
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import pdserve.engine.int4_kernel as int4_kernel
from pdserve.engine import (
    CacheConfig,
    EngineConfig,
    LLMEngine,
    SamplingParams,
    ScheduledChunk,
    demo_tokenizer,
)
from pdserve.engine.demo import write_demo_model
from pdserve.engine.gguf_config import hf_config
from pdserve.engine.gguf_import import convert_gguf, read_metadata
from pdserve.engine.loader import load_model
from pdserve.engine.moe import E2M1_TABLE, Experts, KeptExperts, SparseMoeBlock
from pdserve.engine.quant import weight_bytes
from pdserve.tokenizer import Tokenizer

# fp32 on CPU: the same weights, differing only in summation order.
LOGITS_ATOL = 1e-4
# Gemma's norms come back as (w + 1) - 1 in float32.
WEIGHT_ATOL = 1e-6
NUM_NEW_TOKENS = 40
PROMPT_LENGTHS = (12, 20, 29)
TEXTS = ("hello world", " the café is naïve ", "👋 12345\n\n\tx", "<|user|>hi<|end|>\n")
CHAT = [{"role": "system", "content": "Sé breve"}, {"role": "user", "content": "hello 👋"}]
SENTENCEPIECE_TEXTS = ("hello world", " the café is naïve ", "👋 12345\n\n\tx", "  two  spaces",
                       "<s>hi</s>", "ünïcödé ☃")  # fmt: skip
SENTENCEPIECE_CORPUS = (
    "hello world the café is naïve", "the quick brown fox jumps over the lazy dog 12345",
    "if x:\n\treturn y", "hello hello world world the the",
)  # fmt: skip
SENTENCEPIECE_VOCAB_SIZE = 320

# tiny_models name -> config overrides the converter needs (see the module docstring)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama3": {},  # Llama 3.1 RoPE scaling: the converter writes it as rope_freqs
    "llama_tied": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {},
    "phi3": {},
    "mixtral": {"sliding_window": None},
    "qwen3_moe": {"mlp_only_layers": []},
    "qwen2_moe": {},
    "gemma3": {"num_hidden_layers": 6, "layer_types": None, "query_pre_attn_scalar": 32},
    "olmo2": {},
    "smollm3": {"num_hidden_layers": 4, "no_rope_layer_interval": 4},
    "ernie4_5": {},
    "ernie4_5_moe": {},
    "glm4_moe": {},
    "gpt_oss": {"swiglu_limit": 7.0},
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
}
# tiny_models name -> the converter's other output types it is also written in, and how far a
# weight may move: bf16 and f16 round to 8 and 11 significant bits; Q8_0 stores a block of 32 as
# int8 times a float16 step of max|w| / 127 (half a step off, and 127 times the step's rounding).
QUANTIZED = {"llama3": "q8_0", "qwen3_moe": "q8_0", "gemma3": "bf16", "phi3": "f16"}
QUANTIZED_RTOL = {"bf16": 2**-8, "f16": 2**-11}
# tiny_models name -> the tokenizer class of a SentencePiece (tokenizer.model) checkpoint
SENTENCEPIECE = {
    "llama_tied": "LlamaTokenizer",
    "mistral": "LlamaTokenizer",
    "phi3": "LlamaTokenizer",
    "gemma3": "GemmaTokenizer",
}
# tiny_models name -> the tokenizer class of a family whose converter reads tokenizer.model only
SENTENCEPIECE_ONLY = {"ernie4_5": "LlamaTokenizer", "ernie4_5_moe": "LlamaTokenizer"}
# NOTE: the special tokens GLM-4.5's converter looks up by name (bos is [gMASK]).
GLM_TOKENS = ("[gMASK]", "<sop>", "<|endoftext|>", "<|observation|>")
# tiny_models name -> how our test writer writes the family
OUR_WRITER = {
    "llama3": TinyHfSpec("llama", "llama"),
    "llama_tied": TinyHfSpec("llama", "llama"),
    "mistral": TinyHfSpec("mistral", "llama"),
    "qwen2": TinyHfSpec("qwen2", "qwen2"),
    "qwen2_moe": TinyHfSpec("qwen2_moe", "qwen2moe"),
    "mixtral": TinyHfSpec("mixtral", "llama"),
    "qwen3": TinyHfSpec("qwen3", "qwen3"),
    "qwen3_moe": TinyHfSpec("qwen3_moe", "qwen3moe"),
    "gemma3": TinyHfSpec("gemma3_text", "gemma3"),
    "phi3": TinyHfSpec("phi3", "phi3"),
    "olmo2": TinyHfSpec("olmo2", "olmo2"),
    "smollm3": TinyHfSpec("smollm3", "smollm3"),
}

pytestmark = pytest.mark.skipif(
    not CONVERTER.is_file(),
    reason=f"llama.cpp's converter is not at {CONVERTER}: make llama-convert",
)


MXFP4 = "gpt_oss-mxfp4"
"""gpt-oss as released: experts in MXFP4, which the converter keeps (the other weights f32)."""
OLMO3 = "olmo3"
"""A family the converter writes and pdserve refuses: OLMo 3, an olmo2 file with windows."""
SPM = "-sentencepiece"
"""The suffix of a family's checkpoint with a SentencePiece tokenizer."""


class Family(NamedTuple):
    """One family's original checkpoint, the converter's GGUF of it and our directory of that."""

    hf_dir: Path
    gguf_path: Path
    model_dir: Path


def save_checkpoint(name: str, hf_dir: Path, demo_dir: Path) -> None:
    """The tiny model with the demo's tokenizer; its vocabulary as transformers loads the tokenizer
    for the family (Qwen's tokenizer class adds ``<|endoftext|>``)."""
    settings = {
        "vocab_size": demo_tokenizer.VOCAB_SIZE,
        "bos_token_id": demo_tokenizer.BOS_TOKEN_ID,
        "eos_token_id": demo_tokenizer.EOS_TOKEN_ID,
        "pad_token_id": demo_tokenizer.PAD_TOKEN_ID,
        **FAMILIES[name],
    }
    hf_dir.mkdir(parents=True)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(demo_dir / file, hf_dir / file)
    if name == "glm4_moe":
        add_glm_tokens(hf_dir)
    if name == "phi3":
        # NOTE: the converter reads a Phi-3 vocabulary from tokenizer.model unless the tokenizer
        # is GPT-2's, as Phi-4-mini's is.
        config_path = hf_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["tokenizer_class"] = "GPT2Tokenizer"
        config_path.write_text(json.dumps(config))
    # NOTE: transformers picks the tokenizer class by the config's model_type.
    build_hf_model(name, **settings).save_pretrained(hf_dir)
    vocab_size = len(AutoTokenizer.from_pretrained(hf_dir))
    if vocab_size != settings["vocab_size"]:
        build_hf_model(name, **{**settings, "vocab_size": vocab_size}).save_pretrained(hf_dir)
    if name == "glm4_moe":
        add_mtp_layer(hf_dir)


def add_mtp_layer(hf_dir: Path) -> None:
    """A multi-token-prediction layer after the last one, as GLM-4.5's checkpoints hold (and
    transformers leaves unloaded): the last layer's tensors again, with the MTP projection and
    norms."""
    path = hf_dir / "model.safetensors"
    tensors = load_file(str(path))
    last = json.loads((hf_dir / "config.json").read_text())["num_hidden_layers"] - 1
    prefix, mtp = f"model.layers.{last}.", f"model.layers.{last + 1}."
    generator = np.random.default_rng(0)
    extra = {mtp + name.removeprefix(prefix): generator.normal(size=values.shape)
             for name, values in tensors.items() if name.startswith(prefix)}  # fmt: skip
    hidden_size = tensors["model.norm.weight"].shape[0]
    extra[mtp + "eh_proj.weight"] = generator.normal(size=(hidden_size, 2 * hidden_size))
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        extra[f"{mtp}{norm}.weight"] = generator.normal(size=hidden_size)
    extra = {name: values.astype(np.float32) for name, values in extra.items()}
    save_file(tensors | extra, str(path), metadata={"format": "pt"})


def add_glm_tokens(hf_dir: Path) -> None:
    """The demo tokenizer as GLM-4.5's: its special tokens, [gMASK] as BOS, which its chat
    template writes rather than the tokenizer adding it."""
    tokenizer_path, config_path = hf_dir / "tokenizer.json", hf_dir / "tokenizer_config.json"
    tokenizer = json.loads(tokenizer_path.read_text())
    first_id = 1 + max(token["id"] for token in tokenizer["added_tokens"])
    tokenizer["added_tokens"] += [
        {"id": first_id + i, "content": content, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
        for i, content in enumerate(GLM_TOKENS)
    ]  # fmt: skip
    tokenizer["post_processor"] = None
    tokenizer_path.write_text(json.dumps(tokenizer))
    config = json.loads(config_path.read_text())
    config["bos_token"] = GLM_TOKENS[0]
    config_path.write_text(json.dumps(config))


def save_mxfp4_checkpoint(hf_dir: Path, mxfp4_dir: Path, demo_dir: Path) -> None:
    """A tiny gpt-oss whose experts MXFP4 holds exactly: `hf_dir` with the weights as floats,
    `mxfp4_dir` with them packed as the released checkpoints are."""
    save_checkpoint("gpt_oss", hf_dir, demo_dir)
    pack_mxfp4(hf_dir, mxfp4_dir)


def save_olmo3_checkpoint(hf_dir: Path, demo_dir: Path) -> None:
    """A tiny OLMo 3 (sliding layers, every fourth global), which the converter writes as an
    ``olmo2`` file with a sliding window."""
    config = AutoConfig.for_model(
        "olmo3", vocab_size=demo_tokenizer.VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, sliding_window=24,
        bos_token_id=demo_tokenizer.BOS_TOKEN_ID, eos_token_id=demo_tokenizer.EOS_TOKEN_ID,
        pad_token_id=demo_tokenizer.PAD_TOKEN_ID,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(hf_dir)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(demo_dir / file, hf_dir / file)


def save_sentencepiece_checkpoint(name: str, hf_dir: Path) -> None:
    """The tiny model with a SentencePiece BPE ``tokenizer.model`` trained here, as Llama 2,
    Mistral, Phi-3 mini and Gemma ship theirs (Gemma's adds no leading ``▁``)."""
    hf_dir.mkdir(parents=True)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCEPIECE_CORPUS * 20), model_writer=model, model_type="bpe",
        vocab_size=SENTENCEPIECE_VOCAB_SIZE, byte_fallback=True, split_digits=True,
        add_dummy_prefix=name != "gemma3", normalization_rule_name="identity",
        remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    (hf_dir / "tokenizer.model").write_bytes(model.getvalue())
    tokenizer_class = {**SENTENCEPIECE, **SENTENCEPIECE_ONLY}[name]
    config = {"tokenizer_class": tokenizer_class, "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}  # fmt: skip
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    vocab_size = len(AutoTokenizer.from_pretrained(hf_dir))
    settings = {"vocab_size": vocab_size, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    build_hf_model(name, **{**settings, **FAMILIES[name]}).save_pretrained(hf_dir)


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Family]:
    """Every family converted by llama.cpp's converter (one process) and back by pdserve."""
    root = tmp_path_factory.mktemp("llama_convert")
    (root / "demo").mkdir()
    write_demo_model(root / "demo")
    names = [*FAMILIES, *(f"{name}{SPM}" for name in SENTENCEPIECE), OLMO3, MXFP4]
    converted = {name: Family(root / name / "hf", root / name / "model.gguf", root / name / "out")
                 for name in names}  # fmt: skip
    for name, family in converted.items():
        if name == OLMO3:
            save_olmo3_checkpoint(family.hf_dir, root / "demo")
        elif name == MXFP4:
            save_mxfp4_checkpoint(family.hf_dir, root / name / "hf-mxfp4", root / "demo")
        elif name.endswith(SPM) or name in SENTENCEPIECE_ONLY:
            save_sentencepiece_checkpoint(name.removesuffix(SPM), family.hf_dir)
        else:
            save_checkpoint(name, family.hf_dir, root / "demo")
    for name, outtype in QUANTIZED.items():
        hf_dir = converted[name].hf_dir
        gguf_path = root / name / f"model-{outtype}.gguf"
        converted[f"{name}-{outtype}"] = Family(hf_dir, gguf_path, root / name / f"out-{outtype}")
    # NOTE: the MXFP4 gpt-oss is converted from its packed checkpoint.
    sources = {name: f.hf_dir.with_name("hf-mxfp4") if name == MXFP4 else f.hf_dir
               for name, f in converted.items()}  # fmt: skip
    jobs = [ConversionJob(sources[n], f.gguf_path, f.gguf_path.stem.partition("-")[2] or "f32")
            for n, f in converted.items()]  # fmt: skip
    convert_with_llama_cpp(jobs)
    for name, family in converted.items():
        if name == OLMO3:
            continue
        family.model_dir.mkdir()
        convert_gguf(family.gguf_path, family.model_dir)
    return converted


@pytest.fixture(params=[*FAMILIES, MXFP4])
def family(request: pytest.FixtureRequest, families: dict[str, Family]) -> Family:
    return families[request.param]


def test_checkpoint_equals_the_original(family: Family) -> None:
    """Every tensor transformers loads (not multi-token-prediction layers); MXFP4 experts as
    the released checkpoint packs them, byte for byte."""
    num_layers = json.loads((family.hf_dir / "config.json").read_text())["num_hidden_layers"]
    is_mxfp4 = family.hf_dir.parent.name == MXFP4
    source = family.hf_dir.with_name("hf-mxfp4") if is_mxfp4 else family.hf_dir
    tensors = load_file(str(source / "model.safetensors"))
    layer = re.compile(r"^model\.layers\.(\d+)\.")
    expected = {name: values for name, values in tensors.items()
                if not (match := layer.match(name)) or int(match[1]) < num_layers}  # fmt: skip
    converted = load_file(str(family.model_dir / "model.safetensors"))

    assert sorted(converted) == sorted(expected)
    for name, values in expected.items():
        if values.dtype == np.uint8:
            np.testing.assert_array_equal(converted[name], values, err_msg=name)
        else:
            np.testing.assert_allclose(
                converted[name], values, rtol=0, atol=WEIGHT_ATOL, err_msg=name
            )
    assert any(name.endswith("_blocks") for name in converted) == is_mxfp4


def test_engine_is_greedy_equal_to_transformers(family: Family) -> None:
    model_type = AutoConfig.from_pretrained(family.hf_dir).model_type
    reference = AutoModelForCausalLM.from_pretrained(
        family.hf_dir,
        dtype=torch.float32,
        attn_implementation="eager" if model_type in EAGER_ONLY else "sdpa",
    ).eval()
    config = EngineConfig(
        model=str(family.model_dir), dtype="float32", seed=0, cache=CacheConfig(num_blocks=32)
    )
    engine = LLMEngine(config)
    generator = torch.Generator().manual_seed(11)
    prompts = [
        torch.randint(3, demo_tokenizer.NUM_BYTE_TOKENS, (n,), generator=generator).tolist()
        for n in PROMPT_LENGTHS
    ]

    chunk = ScheduledChunk(prompts[-1], 0, engine.block_pool.allocate(2))
    logits = engine.runner.execute([chunk])[0]
    engine.block_pool.free(chunk.block_ids)
    with torch.no_grad():
        expected = reference(torch.tensor([prompts[-1]])).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == hf_greedy(reference, prompt, NUM_NEW_TOKENS)


def test_tokenizer_encodes_as_the_original(family: Family) -> None:
    ours = Tokenizer.from_pretrained(family.model_dir)
    name = family.hf_dir.parent.name
    is_sentencepiece = name in SENTENCEPIECE_ONLY
    # NOTE: the class the checkpoint names (AutoTokenizer goes by ERNIE's model_type instead).
    tokenizer_class = getattr(transformers, SENTENCEPIECE_ONLY[name]) if is_sentencepiece else None
    theirs = (tokenizer_class or AutoTokenizer).from_pretrained(family.hf_dir)

    assert ours.vocab_size == len(theirs)
    for text in SENTENCEPIECE_TEXTS if is_sentencepiece else TEXTS:
        ids = theirs(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    if not is_sentencepiece:
        assert ours.encode_chat(CHAT) == theirs.apply_chat_template(
            CHAT, add_generation_prompt=True, return_dict=False
        )
    assert ours.eos_token_ids == (theirs.eos_token_id,)


@pytest.mark.parametrize(("name", "outtype"), list(QUANTIZED.items()))
def test_quantized_checkpoint_is_the_original_within_the_type(
    families: dict[str, Family], name: str, outtype: str
) -> None:
    """The converter's other output types: 2-D weights in the type, 1-D ones in F32."""
    family = families[f"{name}-{outtype}"]
    expected = load_file(str(family.hf_dir / "model.safetensors"))
    converted = load_file(str(family.model_dir / "model.safetensors"))
    types = {t.name: t.tensor_type.name for t in GGUFReader(family.gguf_path).tensors}

    assert outtype.upper() in types.values()
    assert {types[n] for n in types if n.endswith("norm.weight")} == {"F32"}
    assert sorted(converted) == sorted(expected)
    for tensor_name, values in expected.items():
        if outtype in QUANTIZED_RTOL:
            rtol, atol = QUANTIZED_RTOL[outtype], WEIGHT_ATOL
        else:
            rtol, atol = 0.0, float(np.abs(values).max()) / 127 * (0.5 + 127 * 2**-11)
        np.testing.assert_allclose(
            converted[tensor_name], values, rtol=rtol, atol=atol, err_msg=tensor_name
        )


Q4_EXPERTS = "qwen3_moe-q4"
"""The Qwen3-MoE file with its experts requantized as ``llama-quantize`` stores 4-bit ones:
gate and up Q4_0, down Q4_1 (one group of 32 a row: too narrow for the int4 kernel, so int8)."""


@pytest.fixture(scope="module")
def q4_experts_dir(families: dict[str, Family]) -> Path:
    family = families["qwen3_moe"]
    q4 = GGMLQuantizationType.Q4_0
    types = {"gate_exps.weight": q4, "up_exps.weight": q4,
             "down_exps.weight": GGMLQuantizationType.Q4_1}  # fmt: skip
    path = requantized(family.gguf_path, family.gguf_path.with_name("model-q4.gguf"), types)
    model_dir = family.model_dir.with_name("out-q4")
    model_dir.mkdir()
    convert_gguf(path, model_dir)
    return model_dir


@pytest.mark.parametrize("name", ["qwen3_moe-q8_0", MXFP4, Q4_EXPERTS])
def test_quantized_experts_are_kept_as_the_files_values(
    families: dict[str, Family], request: pytest.FixtureRequest, name: str
) -> None:
    """A GGUF's Q8_0 experts run as int8 groups, its Q4_0 ones as int4 groups, a gpt-oss GGUF's
    MXFP4 ones as their codes (`KeptExperts`): each weight the file's value (the dequantized
    checkpoint's, exactly), in bfloat16 and float32; in float32 (where another summation order
    moves a logit by about 1e-6, not a random tiny model's near-ties as bfloat16's rounding
    does) the same greedy tokens as the experts dequantized."""
    if name == Q4_EXPERTS:
        model_dir: Path = request.getfixturevalue("q4_experts_dir")
    else:
        model_dir = families[name].model_dir
    for dtype in (torch.bfloat16, torch.float32):
        forms = {"gate_up": "int8", "down": "int8"}
        if name == Q4_EXPERTS:
            forms = {"gate_up": "int4", "down": "int8"}
        elif name == MXFP4:
            # NOTE: the file's codes, on the int4 kernel
            forms = {"gate_up": "mxfp4", "down": "mxfp4"}
        _assert_kept_experts_hold_the_dequantized_weights(model_dir, dtype, forms)
    generator = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, demo_tokenizer.NUM_BYTE_TOKENS, (n,), generator=generator).tolist()
        for n in PROMPT_LENGTHS
    ]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = [
        LLMEngine(
            EngineConfig(model=str(model_dir), dtype="float32", seed=0,
                         quantization=quantization, cache=CacheConfig(num_blocks=32))
        ).generate(prompts, params)
        for quantization in ("auto", "none")
    ]  # fmt: skip
    assert outputs[0] == outputs[1]


def _assert_kept_experts_hold_the_dequantized_weights(
    model_dir: Path, dtype: torch.dtype, forms: dict[str, str]
) -> None:
    with capture_logs() as logs:
        kept = load_model(model_dir, dtype)
    (loaded,) = [entry for entry in logs if entry["event"] == "model_loaded"]
    if "MXFP4" in (loaded["tensor_types"] or {}):  # NOTE: the start-up line names the form
        assert loaded["tensor_types"]["MXFP4"] == ", ".join(sorted(set(forms.values())))
    floats = load_model(model_dir, dtype, quantization="none")
    assert weight_bytes(kept) < weight_bytes(floats)
    for layer, reference in zip(kept.model.layers, floats.model.layers, strict=True):
        if not isinstance(reference.mlp, SparseMoeBlock):
            continue
        experts = layer.mlp.experts
        assert isinstance(experts, KeptExperts) and type(reference.mlp.experts) is Experts
        assert experts.forms == forms
        for which in ("gate_up", "down"):
            weight = _kept_weight(experts, which)
            expected = getattr(reference.mlp.experts, f"{which}_proj").detach()
            # NOTE: [experts, out, in] against the floats' [experts, in, out]
            assert torch.equal(weight.transpose(1, 2).to(dtype), expected), which


def _kept_weight(experts: KeptExperts, which: str) -> torch.Tensor:
    """A part's weights in float32, ``[experts, out, in]``."""
    values = getattr(experts, f"{which}_values")
    scales = getattr(experts, f"{which}_scales")
    mins = getattr(experts, f"{which}_mins")
    if experts.forms[which] == "int4":
        return torch.stack([int4_kernel.dequantize(values[e], scales[e], mins[e], torch.float32)
                            for e in range(values.shape[0])])  # fmt: skip
    if experts.forms[which] == "mxfp4":
        return torch.stack([int4_kernel.dequantize(values[e], scales[e], None, torch.bfloat16,
                                                   E2M1_TABLE).float()
                            for e in range(values.shape[0])])  # fmt: skip
    group = values.shape[-1] // scales.shape[-1]
    weight = values.float() * scales.float().repeat_interleave(group, dim=-1)
    if mins is not None:
        weight += mins.repeat_interleave(group, dim=-1)
    return weight


def test_mxfp4_experts_stay_mxfp4_in_the_file(families: dict[str, Family]) -> None:
    """The converter keeps the released gpt-oss's MXFP4 experts (the import reads them)."""
    types = {t.name: t.tensor_type.name for t in GGUFReader(families[MXFP4].gguf_path).tensors}

    experts = {name for name in types if name.endswith("_exps.weight")}
    assert experts
    assert {types[name] for name in experts} == {"MXFP4"}
    assert {types[name] for name in types.keys() - experts} == {"F32"}


def test_olmo3_is_refused(families: dict[str, Family], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sliding window"):
        convert_gguf(families[OLMO3].gguf_path, tmp_path)


@pytest.mark.parametrize("gating", [None, 1])
def test_deepseek2_with_softmax_routing_is_refused(
    families: dict[str, Family], gating: int | None
) -> None:
    """A deepseek2 file without sigmoid gating: llama.cpp routes it by softmax (DeepSeek-V2)."""
    reader = GGUFReader(families["deepseek_v3"].gguf_path)
    metadata = read_metadata(reader)
    assert metadata.pop("deepseek2.expert_gating_func") == 2
    if gating is not None:
        metadata["deepseek2.expert_gating_func"] = gating

    with pytest.raises(ValueError, match="softmax"):
        hf_config(metadata, {t.name for t in reader.tensors})


@pytest.mark.parametrize("name", list(SENTENCEPIECE))
def test_sentencepiece_tokenizer_encodes_as_transformers(
    families: dict[str, Family], name: str
) -> None:
    """The SentencePiece vocabulary as the converter writes it: our tokenizer against
    transformers reading the same GGUF, and against the original tokenizer."""
    family = families[f"{name}{SPM}"]
    ours = Tokenizer.from_pretrained(family.model_dir)
    from_gguf = AutoTokenizer.from_pretrained(
        family.gguf_path.parent, gguf_file=family.gguf_path.name
    )
    # NOTE: the class the checkpoint names (AutoTokenizer goes by Mistral's model_type instead).
    original = getattr(transformers, SENTENCEPIECE[name]).from_pretrained(family.hf_dir)

    assert ours.vocab_size == len(original)
    for text in SENTENCEPIECE_TEXTS:
        ids = ours.encode(text)
        assert ids == from_gguf(text)["input_ids"], text
        # NOTE: a Phi-3 GGUF tokenizes as transformers reads it, like Phi-3's tokenizer.json
        # (a leading space becomes a second ▁), not as transformers' LlamaTokenizer built from
        # tokenizer.model alone.
        if name != "phi3":
            assert ids == original(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == original.decode(ids)


@pytest.mark.parametrize("name", list(OUR_WRITER))
def test_our_writer_writes_what_llama_cpp_writes(families: dict[str, Family], name: str) -> None:
    """Tensor names, shapes and values, and the ``{arch}.*`` settings the import reads."""
    family = families[name]
    spec = OUR_WRITER[name]
    reader = GGUFReader(family.gguf_path)
    theirs = {t.name: np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist())))
              for t in reader.tensors}  # fmt: skip
    hf_config = AutoModelForCausalLM.from_pretrained(family.hf_dir).config
    ours = gguf_tensors(load_file(str(family.hf_dir / "model.safetensors")), hf_config, spec)

    assert sorted(ours) == sorted(theirs)
    for tensor_name, values in ours.items():
        # NOTE: rope_freqs is computed, in float32 by the converter and float64 by us.
        np.testing.assert_allclose(values, theirs[tensor_name], rtol=1e-6, err_msg=tensor_name)
    their_settings = _arch_settings(read_metadata(reader))
    our_path = family.gguf_path.parent / "ours.gguf"
    _write_our_settings(our_path, hf_config, spec)
    our_settings = _arch_settings(read_metadata(GGUFReader(our_path)))
    differing = {key: (our_settings.get(key), their_settings.get(key))
                 for key in our_settings.keys() | their_settings.keys()
                 if our_settings.get(key) != pytest.approx(their_settings.get(key))}  # fmt: skip
    assert not differing


def _arch_settings(metadata: dict[str, Any]) -> dict[str, Any]:
    arch = metadata["general.architecture"]
    return {key: value for key, value in metadata.items() if key.startswith(f"{arch}.")}


def _write_our_settings(path: Path, hf_config: Any, spec: TinyHfSpec) -> None:
    from gguf import GGUFWriter
    from support.gguf_from_hf import add_hparams

    writer = GGUFWriter(path, spec.gguf_architecture)
    add_hparams(writer, hf_config, spec)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
