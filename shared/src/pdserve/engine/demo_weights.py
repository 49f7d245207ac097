"""The demo models' architecture and weights: a seeded, platform-independent random init.

The weights come from a seeded `torch.Generator` as integers and are scaled with exactly
rounded arithmetic, so every platform gets the same bytes (`weights_sha256` is their digest).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from typing import Any

import torch

from pdserve.engine import demo_tokenizer as tok

DEMO_MODEL_NAME = "demo-llama-v1"
DEMO_MOE_MODEL_NAME = "demo-mixtral-v1"


@dataclasses.dataclass(frozen=True)
class DemoModelSpec:
    """Architecture and initialization of the demo model.

    Channel 0 of the residual stream is reserved: every embedding holds `bias_channel_value`
    there and no layer reads or writes it, so through the final norm it acts as a constant
    input to ``lm_head``, whose column 0 then adds a fixed bias per token. The bias favours
    printable ASCII (letters and spaces most) and suppresses special tokens, so the random
    model writes varied readable gibberish and practically never ends on its own.
    """

    num_hidden_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 352
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    seed: int = 20250101
    embedding_std: float = 1.0
    layer_std: float = 0.15
    lm_head_std: float = 0.4
    bias_channel_value: float = 16.0
    # NOTE: the reserved channel reaches lm_head as about 4 after the final RMSNorm.
    bias_channel_scale: float = 4.0
    # NOTE: with experts the demo is a Mixtral: every feed-forward routes to 2 of them.
    num_experts: int = 0
    num_experts_per_tok: int = 2

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def name(self) -> str:
        """The directory name of the model in the cache."""
        return DEMO_MOE_MODEL_NAME if self.num_experts else DEMO_MODEL_NAME

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_attention_heads

    def hf_config(self) -> dict[str, Any]:
        """The contents of ``config.json``."""
        experts: dict[str, Any] = {}
        if self.num_experts:
            experts = {
                "architectures": ["MixtralForCausalLM"],
                "model_type": "mixtral",
                "num_local_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
            }
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": tok.VOCAB_SIZE,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": tok.BOS_TOKEN_ID,
            "eos_token_id": tok.EOS_TOKEN_ID,
            "pad_token_id": tok.PAD_TOKEN_ID,
            "torch_dtype": "float32",
            **experts,
        }


DEMO_SPEC = DemoModelSpec()
DEMO_MOE_SPEC = DemoModelSpec(num_experts=4, seed=20261128)
"""The demo as a mixture of experts (Mixtral, 4 experts, 2 per token): the MoE test model."""


def _uniform(generator: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """Uniform values with standard deviation `std`, bit-identical on every platform.

    NOTE: torch's float samplers may use vectorized transcendental code that differs across
    CPUs; integers from the generator plus one exactly rounded multiply do not.
    """
    # ints: [*shape] in [0, 2**24)
    ints = torch.randint(0, 1 << 24, shape, generator=generator, dtype=torch.int64)
    half_width = std * math.sqrt(3.0)
    return ((ints.double() - ((1 << 23) - 0.5)) * (half_width / (1 << 23))).float()


def _token_bias() -> torch.Tensor:
    """Per-token logit bias: printable ASCII up, lowercase letters and space more, specials down."""
    bias = torch.zeros(tok.VOCAB_SIZE, dtype=torch.float64)
    bias[0x20:0x7F] = 10.0
    bias[ord("\n")] = 10.0
    bias[ord(" ")] += 6.0
    for char in "abcdefghijklmnopqrstuvwxyz":
        bias[ord(char)] += 6.0 if char in "etaoinshr" else 4.0
    bias[tok.NUM_BYTE_TOKENS :] = -8.0
    return bias


def build_weights(spec: DemoModelSpec = DEMO_SPEC) -> dict[str, torch.Tensor]:
    """Generates the weights under their Hugging Face names (float32, untied ``lm_head``)."""
    generator = torch.Generator().manual_seed(spec.seed)
    hidden, inter = spec.hidden_size, spec.intermediate_size
    q_size = spec.num_attention_heads * spec.head_dim
    kv_size = spec.num_key_value_heads * spec.head_dim
    weights: dict[str, torch.Tensor] = {}
    # embed: [vocab_size, hidden_size]
    embed = _uniform(generator, (tok.VOCAB_SIZE, hidden), spec.embedding_std)
    embed[:, 0] = spec.bias_channel_value
    weights["model.embed_tokens.weight"] = embed
    for layer in range(spec.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        shapes = {
            "self_attn.q_proj": (q_size, hidden),
            "self_attn.k_proj": (kv_size, hidden),
            "self_attn.v_proj": (kv_size, hidden),
            "self_attn.o_proj": (hidden, q_size),
        }
        if spec.num_experts:
            shapes["block_sparse_moe.gate"] = (spec.num_experts, hidden)
            for expert in range(spec.num_experts):
                shapes[f"block_sparse_moe.experts.{expert}.w1"] = (inter, hidden)
                shapes[f"block_sparse_moe.experts.{expert}.w3"] = (inter, hidden)
                shapes[f"block_sparse_moe.experts.{expert}.w2"] = (hidden, inter)
        else:
            shapes["mlp.gate_proj"] = (inter, hidden)
            shapes["mlp.up_proj"] = (inter, hidden)
            shapes["mlp.down_proj"] = (hidden, inter)
        for name, shape in shapes.items():
            weight = _uniform(generator, shape, spec.layer_std)
            if name in ("self_attn.o_proj", "mlp.down_proj") or name.endswith(".w2"):
                weight[0, :] = 0.0  # never write the reserved channel
            else:
                weight[:, 0] = 0.0  # never read it
            weights[f"{prefix}{name}.weight"] = weight
        weights[f"{prefix}input_layernorm.weight"] = torch.ones(hidden)
        weights[f"{prefix}post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    lm_head = _uniform(generator, (tok.VOCAB_SIZE, hidden), spec.lm_head_std)
    lm_head[:, 0] = (_token_bias() / spec.bias_channel_scale).float()
    weights["lm_head.weight"] = lm_head
    return weights


def weights_sha256(weights: Mapping[str, torch.Tensor]) -> str:
    """A digest of names, dtypes, shapes and raw bytes, independent of the file format."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].contiguous()
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}\n".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
