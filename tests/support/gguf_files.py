"""Tiny llama.cpp GGUF files, written the way llama.cpp's ``convert_hf_to_gguf.py`` writes them.

The weights are random. Every 2-D weight is stored in one tensor type (norms and biases stay
F32, as llama.cpp keeps 1-D tensors), and the Llama query/key rows are permuted as llama.cpp
permutes them. The tokenizer is a small gpt2-style byte-level BPE vocabulary with merges,
control tokens, user-defined tokens and a chat template.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize
from transformers.convert_slow_tokenizer import bytes_to_unicode

# NOTE: the K-quants pack 256 elements (QK_K) into a block along a row, so every row of a 2-D
# weight (its last, input dimension) holds a multiple of 256 elements.
HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 512
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
# NOTE: Qwen3 decouples head_dim from hidden_size / num_heads; 128 is also what transformers'
# GGUF loader assumes for qwen3 (it does not read attention.key_length there).
QWEN3_HEAD_DIM = 128
CONTEXT_LENGTH = 512
ROPE_FREQ_BASE = 50000.0
RMS_NORM_EPS = 1e-5
# NOTE: a wide spread of weights spreads the logits, so greedy choices are not near-ties.
WEIGHT_STD = 0.25

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# NOTE: llama.cpp stores a user-defined token as its text, so "\t\t" is spelled outside the
# byte alphabet and is no vocabulary key; transformers encodes that text through the merges.
USER_DEFINED_TOKENS = ("<think>", "\t\t")
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|im_end|>", "<|endoftext|>"
# Words whose merges the vocabulary holds: leading spaces, accents, digits, newlines.
MERGED_WORDS = (
    "the", " the", "hello", " hello", " world", "ing", " café", " naïve", "é", "12", "123",
    "  ", "\n\n", "user", "assistant", "system",
)  # fmt: skip
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class BlockScales(NamedTuple):
    """Where a K-quant block keeps its fp16 scales.

    Attributes:
        d_offset: Byte offset of ``d``, which scales the quants.
        dmin_offset: Byte offset of ``dmin``, which scales the subtracted minimums, if any.
        mean_quant: The mean quant of random bytes; ``dmin = d * mean_quant`` centers the
            weights on zero (the sub-block scales and minimums have the same distribution).
    """

    d_offset: int
    dmin_offset: int | None = None
    mean_quant: float = 0.0


# NOTE: gguf 0.19 has no numpy quantizer for the K-quants, so their blocks are random bytes with
# small finite fp16 scales. Layouts as gguf/quants.py reads them (QK_K = 256):
#   Q2_K: scales[16] qs[64] d dmin      Q3_K: hmask[32] qs[64] scales[12] d
#   Q4_K: d dmin scales[12] qs[128]     Q5_K: d dmin scales[12] qh[32] qs[128]
#   Q6_K: ql[128] qh[64] scales[16] d
RAW_BLOCK_SCALES = {
    GGMLQuantizationType.Q2_K: BlockScales(80, 82, mean_quant=1.5),
    GGMLQuantizationType.Q3_K: BlockScales(108),
    GGMLQuantizationType.Q4_K: BlockScales(0, 2, mean_quant=7.5),
    GGMLQuantizationType.Q5_K: BlockScales(0, 2, mean_quant=15.5),
    GGMLQuantizationType.Q6_K: BlockScales(208),
}


@dataclass(frozen=True)
class TinyGgufSpec:
    """What one tiny GGUF file holds.

    Attributes:
        architecture: ``general.architecture``: ``llama`` (permuted q/k rows), ``qwen2``
            (q/k/v biases) or ``qwen3`` (q/k norms, head_dim 128); anything else is written with
            Llama's tensors.
        tensor_type: The type of every 2-D weight.
        tokenizer_model: ``tokenizer.ggml.model``.
        tokenizer_pre: ``tokenizer.ggml.pre``, which picks the pre-tokenizer split.
        add_bos_token: ``tokenizer.ggml.add_bos_token``.
        tie_word_embeddings: Leave out ``output.weight``, so the embedding is the LM head.
        seed: Seeds the weights.
    """

    architecture: str = "llama"
    tensor_type: GGMLQuantizationType = GGMLQuantizationType.F32
    tokenizer_model: str = "gpt2"
    tokenizer_pre: str = "llama-bpe"
    add_bos_token: bool = True
    tie_word_embeddings: bool = False
    seed: int = 0


class TinyVocab(NamedTuple):
    """A byte-level BPE vocabulary as llama.cpp stores it."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]


def tiny_vocab() -> TinyVocab:
    """The 256 byte tokens, the tokens of `MERGED_WORDS`' merges, then the added tokens."""
    alphabet = bytes_to_unicode()
    tokens = [alphabet[byte] for byte in range(256)]
    merges: list[str] = []
    for word in MERGED_WORDS:
        spelled = "".join(alphabet[byte] for byte in word.encode("utf-8"))
        for end in range(2, len(spelled) + 1):
            if spelled[:end] not in tokens:
                merges.append(f"{spelled[: end - 1]} {spelled[end - 1]}")
                tokens.append(spelled[:end])
    token_types = [TokenType.NORMAL] * len(tokens)
    tokens += [*SPECIAL_TOKENS, *USER_DEFINED_TOKENS]
    token_types += [TokenType.CONTROL] * len(SPECIAL_TOKENS)
    token_types += [TokenType.USER_DEFINED] * len(USER_DEFINED_TOKENS)
    return TinyVocab(tokens, [int(t) for t in token_types], merges)


def llama_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: interleaves the rotary halves of each head's rows.

    Works on float rows and on rows of quantized bytes alike, since it only moves whole rows.
    """
    # weight: [num_heads * head_dim, ...]
    grouped = weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def random_weight(
    rng: np.random.Generator, shape: tuple[int, int], tensor_type: GGMLQuantizationType
) -> np.ndarray:
    """A random ``[rows, cols]`` weight encoded as `tensor_type` (floats, or bytes per row)."""
    layout = RAW_BLOCK_SCALES.get(tensor_type)
    if layout is None:
        return quantize(rng.normal(0.0, WEIGHT_STD, shape).astype(np.float32), tensor_type)
    block_elements, block_bytes = GGML_QUANT_SIZES[tensor_type]
    num_blocks = shape[0] * shape[1] // block_elements
    # blocks: [num_blocks, block_bytes]
    blocks = rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8)
    d = rng.uniform(0.5, 1.0, num_blocks)

    def set_scales(d: np.ndarray) -> None:
        fields = [(layout.d_offset, d), (layout.dmin_offset, d * layout.mean_quant)]
        for offset, values in fields:
            if offset is not None:
                fp16_bytes = values.astype(np.float16).view(np.uint8).reshape(-1, 2)
                blocks[:, offset : offset + 2] = fp16_bytes

    # NOTE: the weights are linear in the scales, so one measurement brings their spread to
    # WEIGHT_STD whatever the type's range of codes.
    set_scales(d)
    set_scales(d * WEIGHT_STD / dequantize(blocks, tensor_type).std())
    return blocks.reshape(shape[0], -1)


def write_tiny_gguf(path: Path, spec: TinyGgufSpec = TinyGgufSpec()) -> Path:
    """Writes the GGUF file `spec` describes to `path` and returns `path`."""
    vocab = tiny_vocab()
    writer = GGUFWriter(path, spec.architecture)
    writer.add_name(f"tiny-{spec.architecture}-{spec.tensor_type.name}")
    writer.add_block_count(NUM_LAYERS)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(HIDDEN_SIZE)
    writer.add_feed_forward_length(INTERMEDIATE_SIZE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_freq_base(ROPE_FREQ_BASE)
    writer.add_layer_norm_rms_eps(RMS_NORM_EPS)
    head_dim = QWEN3_HEAD_DIM if spec.architecture == "qwen3" else HEAD_DIM
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(len(vocab.tokens))
    writer.add_tokenizer_model(spec.tokenizer_model)
    writer.add_tokenizer_pre(spec.tokenizer_pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.tokens.index(BOS_TOKEN))
    writer.add_eos_token_id(vocab.tokens.index(EOS_TOKEN))
    writer.add_pad_token_id(vocab.tokens.index(PAD_TOKEN))
    writer.add_add_bos_token(spec.add_bos_token)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, data in tiny_tensors(spec, len(vocab.tokens)).items():
        raw_dtype = spec.tensor_type if data.ndim == 2 else GGMLQuantizationType.F32
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_tensors(spec: TinyGgufSpec, vocab_size: int) -> dict[str, np.ndarray]:
    """llama.cpp tensor name -> data: 2-D weights encoded as ``spec.tensor_type``, 1-D F32."""
    rng = np.random.default_rng(spec.seed)

    def weight(rows: int, cols: int) -> np.ndarray:
        return random_weight(rng, (rows, cols), spec.tensor_type)

    def vector(size: int, mean: float) -> np.ndarray:
        return (mean + rng.normal(0.0, WEIGHT_STD, size)).astype(np.float32)

    head_dim = QWEN3_HEAD_DIM if spec.architecture == "qwen3" else HEAD_DIM
    q_size, kv_size = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
    tensors = {"token_embd.weight": weight(vocab_size, HIDDEN_SIZE)}
    for layer in range(NUM_LAYERS):
        q, k = weight(q_size, HIDDEN_SIZE), weight(kv_size, HIDDEN_SIZE)
        if spec.architecture == "llama":
            q, k = llama_permute(q, NUM_HEADS), llama_permute(k, NUM_KV_HEADS)
        block = {
            "attn_norm.weight": vector(HIDDEN_SIZE, 1.0),
            "attn_q.weight": q,
            "attn_k.weight": k,
            "attn_v.weight": weight(kv_size, HIDDEN_SIZE),
            "attn_output.weight": weight(HIDDEN_SIZE, q_size),
            "ffn_norm.weight": vector(HIDDEN_SIZE, 1.0),
            "ffn_gate.weight": weight(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            "ffn_up.weight": weight(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            "ffn_down.weight": weight(HIDDEN_SIZE, INTERMEDIATE_SIZE),
        }
        if spec.architecture == "qwen3":
            block |= {
                "attn_q_norm.weight": vector(head_dim, 1.0),
                "attn_k_norm.weight": vector(head_dim, 1.0),
            }
        if spec.architecture == "qwen2":
            block |= {
                "attn_q.bias": vector(HIDDEN_SIZE, 0.0),
                "attn_k.bias": vector(kv_size, 0.0),
                "attn_v.bias": vector(kv_size, 0.0),
            }
        tensors |= {f"blk.{layer}.{name}": data for name, data in block.items()}
    tensors["output_norm.weight"] = vector(HIDDEN_SIZE, 1.0)
    if not spec.tie_word_embeddings:
        tensors["output.weight"] = weight(vocab_size, HIDDEN_SIZE)
    return tensors


def requantized(source: Path, target: Path, tensor_types: dict[str, GGMLQuantizationType]) -> Path:
    """Writes `source` (an F32 GGUF file) again as `target`, every tensor whose name ends with
    a key of `tensor_types` quantized to that type (as ``llama-quantize`` would store it), the
    rest and every setting as they are."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(source)
    architecture = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(target, architecture)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] is GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        # data: [..., rows, cols] float32, the last dimension the input one
        data = np.asarray(tensor.data).reshape(tuple(reversed(tensor.shape.tolist())))
        wanted = next((t for end, t in tensor_types.items() if tensor.name.endswith(end)), None)
        if wanted is None:
            writer.add_tensor(tensor.name, data)
        else:
            writer.add_tensor(tensor.name, quantize(data, wanted), raw_dtype=wanted)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
