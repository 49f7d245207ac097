"""Tiny transformers models written to GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` does.

A model is built with transformers from a small config and random weights, saved with
``save_pretrained`` (the checkpoint names and layout a Hugging Face repo has), and that checkpoint
is converted as llama.cpp converts it: names through the `gguf` package's own tensor map, Llama
and Mixtral q/k rows permuted, Gemma norms stored plus one, experts stacked into one 3-D tensor
per projection, Llama 3's RoPE scaling as ``rope_freqs``, and the ``{arch}.*`` metadata llama.cpp
writes (no more: a key the converter leaves out is left out here too). Tests then convert the
GGUF back with `convert_gguf` and compare with the original model;
``tests/unit/engine/test_gguf_llama_convert.py`` holds this writer to the converter's own output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map
from safetensors.numpy import load_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from pdserve.engine.gguf_rope import llama3_divisors
from support.gguf_files import WEIGHT_STD, llama_permute, tiny_vocab
from support.gguf_vocabs import (
    SentencePieceVocab,
    add_sentencepiece_vocab,
    gemma_sentencepiece_vocab,
    llama_sentencepiece_vocab,
)

# GGUF architectures llama.cpp's converter writes as Llama's (q/k rows permuted, and so on).
LLAMA_CONVERTED = ("llama", "smollm3")
HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 512
NUM_HEADS = 4
NUM_KV_HEADS = 2
CONTEXT_LENGTH = 256
_EXPERT_PARTS = {
    # HF checkpoint expert projection -> llama.cpp stacked tensor
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
}


@dataclass(frozen=True)
class TinyHfSpec:
    """A tiny transformers model and the GGUF architecture llama.cpp writes it as.

    Attributes:
        model_type: The transformers ``model_type``.
        gguf_architecture: llama.cpp's ``general.architecture`` for it.
        config: Config values beyond the shared sizes.
        vocab: Which tiny vocabulary the file carries: ``llama``, ``gemma`` (SentencePiece) or
            ``gpt2`` (byte-level BPE).
        is_expert_stacked: Stack the experts into one 3-D tensor per projection (as llama.cpp
            does since 2024); otherwise one ``blk.N.ffn_gate.E`` tensor per expert, as older
            Mixtral files have.
        seed: Seeds the weights.
    """

    model_type: str
    gguf_architecture: str
    config: dict[str, Any] = field(default_factory=dict)
    vocab: str = "gpt2"
    is_expert_stacked: bool = True
    seed: int = 0


def _vocab_size(spec: TinyHfSpec) -> int:
    if spec.vocab == "gpt2":
        return len(tiny_vocab().tokens)
    return len(_sentencepiece(spec).tokens)


def _sentencepiece(spec: TinyHfSpec) -> SentencePieceVocab:
    return gemma_sentencepiece_vocab() if spec.vocab == "gemma" else llama_sentencepiece_vocab()


def tiny_hf_model(spec: TinyHfSpec) -> PreTrainedModel:
    """The model `spec` describes, in float32, with weights spread wide enough to matter."""
    config = AutoConfig.for_model(
        spec.model_type,
        vocab_size=_vocab_size(spec),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=CONTEXT_LENGTH,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        **spec.config,
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # NOTE: Gemma's norms scale by (1 + weight); every other model's by weight.
    norm_mean = 0.0 if spec.vocab == "gemma" else 1.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            mean = norm_mean if "norm" in name else 0.0
            param.normal_(mean, WEIGHT_STD)
    return model.eval()


def write_hf_as_gguf(model: PreTrainedModel, spec: TinyHfSpec, work_dir: Path) -> Path:
    """Saves `model` to ``work_dir/hf`` and writes ``work_dir/model.gguf`` as llama.cpp would."""
    hf_dir = work_dir / "hf"
    model.save_pretrained(hf_dir)
    checkpoint = load_file(str(hf_dir / "model.safetensors"))
    path = work_dir / "model.gguf"
    writer = GGUFWriter(path, spec.gguf_architecture)
    writer.add_name(f"tiny-{spec.model_type}")
    add_hparams(writer, model.config, spec)
    if spec.vocab == "gpt2":
        _add_byte_level_vocab(writer)
    else:
        vocab = _sentencepiece(spec)
        if spec.model_type == "phi3":
            # NOTE: Phi-3's tokenizer names a pad token; without one, transformers' Phi3Config
            # assumes id 32000, outside the tiny vocabulary.
            vocab = vocab._replace(pad_token_id=vocab.unk_token_id)
        add_sentencepiece_vocab(writer, vocab)
    for name, data in gguf_tensors(checkpoint, model.config, spec).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_hparams(writer: GGUFWriter, config: Any, spec: TinyHfSpec) -> None:
    """The ``{arch}.*`` settings llama.cpp's converter writes for `config`, and only those."""
    arch = spec.gguf_architecture
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    if spec.model_type == "gemma3_text":
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        rope = rope["full_attention"]
        writer.add_sliding_window(config.sliding_window)
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_rope_scaling_factor(rope["factor"])
    # NOTE: the converter states the head size only where the config does (Gemma: always),
    # the vocabulary size and the rotary dimension only for Llama-converted files (and phi3's
    # rotary one).
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if config.to_dict().get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in LLAMA_CONVERTED:
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if spec.model_type == "phi3":
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if spec.model_type in ("qwen2_moe", "qwen3_moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if spec.model_type == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _add_byte_level_vocab(writer: GGUFWriter) -> None:
    vocab = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    writer.add_eos_token_id(vocab.tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)


def gguf_tensors(
    checkpoint: dict[str, np.ndarray], config: Any, spec: TinyHfSpec
) -> dict[str, np.ndarray]:
    """llama.cpp tensor name -> float32 data for a Hugging Face checkpoint."""
    arch = next(a for a, name in MODEL_ARCH_NAMES.items() if name == spec.gguf_architecture)
    name_map = get_tensor_name_map(arch, config.num_hidden_layers)
    transforms: list[Callable[[str, np.ndarray], np.ndarray]] = []
    if spec.gguf_architecture in LLAMA_CONVERTED:
        transforms.append(lambda name, data: _permute_qk(name, data, config))
    if spec.gguf_architecture == "gemma3":
        # llama.cpp's Gemma3Model: "only this norm has +1 applied"
        transforms.append(lambda name, data: data + 1 if name.endswith("norm.weight") else data)
    tensors: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, data in checkpoint.items():
        for transform in transforms:
            data = transform(hf_name, data)
        base, _, suffix = hf_name.rpartition(".")
        parts = base.split(".")
        if "experts" in parts:
            # model.layers.{L}.{mlp|block_sparse_moe}.experts.{E}.{proj}
            layer, expert, proj = parts[2], int(parts[-2]), parts[-1]
            if not spec.is_expert_stacked:
                part = _EXPERT_PARTS[proj].removesuffix("_exps")
                tensors[f"blk.{layer}.{part}.{expert}.{suffix}"] = data.astype(np.float32)
                continue
            experts.setdefault(f"blk.{layer}.{_EXPERT_PARTS[proj]}.{suffix}", {})[expert] = data
            continue
        gguf_name = name_map.get_name(base)
        if gguf_name is None:
            raise KeyError(f"no llama.cpp name for {hf_name}")
        tensors[f"{gguf_name}.{suffix}"] = data.astype(np.float32)
    for name, by_expert in experts.items():
        # stacked: [num_experts, rows, cols]
        tensors[name] = np.stack([by_expert[e] for e in sorted(by_expert)]).astype(np.float32)
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":
        # NOTE: llama.cpp's converter stores Llama 3's RoPE scaling as per-frequency divisors.
        head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        divisors = llama3_divisors(rope, rope["rope_theta"], head_dim)
        tensors["rope_freqs.weight"] = divisors.astype(np.float32)
    return tensors


def _permute_qk(name: str, data: np.ndarray, config: Any) -> np.ndarray:
    if name.endswith("q_proj.weight"):
        return llama_permute(data, config.num_attention_heads)
    if name.endswith("k_proj.weight"):
        return llama_permute(data, config.num_key_value_heads)
    return data
