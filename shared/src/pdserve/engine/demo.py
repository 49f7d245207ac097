"""The demo model: a tiny random-weight Llama generated locally, identical on every machine.

``ensure_demo_model()`` writes a Hugging Face model directory (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``) into the cache the first time and reuses it afterwards, so a
fresh CPU machine can serve without downloading anything. Run
``python -m pdserve.engine.demo [--cache-dir DIR]`` to create it and print its path.

The weights come from a seeded `torch.Generator` as integers and are scaled with exactly
rounded arithmetic, so every platform gets the same bytes; ``manifest.json`` records their
digest so prefill and decode instances can check that they serve the same model.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors.torch import save_file

from pdserve.common.env import cache_dir as default_cache_dir
from pdserve.engine import demo_tokenizer as tok

DEMO_MODEL_NAME = "demo-llama-v1"
DEMO_MOE_MODEL_NAME = "demo-mixtral-v1"
MANIFEST_FILE = "manifest.json"

log = structlog.get_logger()


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


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_demo_model(directory: Path, spec: DemoModelSpec = DEMO_SPEC) -> str:
    """Writes every file of the demo model into an existing, empty `directory`.

    Returns:
        The weights digest (see `weights_sha256`), also recorded in ``manifest.json``.
    """
    weights = build_weights(spec)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _write_json(directory / "config.json", spec.hf_config())
    _write_json(
        directory / "generation_config.json",
        {
            "bos_token_id": tok.BOS_TOKEN_ID,
            "eos_token_id": [tok.EOS_TOKEN_ID, tok.END_TOKEN_ID],
            "pad_token_id": tok.PAD_TOKEN_ID,
        },
    )
    (directory / "tokenizer.json").write_text(
        tok.build_demo_tokenizer().to_str(pretty=True) + "\n", encoding="utf-8"
    )
    _write_json(directory / "tokenizer_config.json", tok.tokenizer_config())
    digest = weights_sha256(weights)
    files = {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
    }
    # NOTE: the manifest is written last; its presence marks a complete directory.
    manifest = {"name": spec.name, "weights_sha256": digest, "files": files}
    _write_json(directory / MANIFEST_FILE, manifest)
    for path in directory.iterdir():
        path.chmod(0o644)  # NOTE: readable by services running as other users
    return digest


def ensure_demo_model(cache_dir: Path | None = None, spec: DemoModelSpec = DEMO_SPEC) -> Path:
    """Returns the demo model directory, generating it on first use.

    The model is written to a temporary directory next to the target and renamed into place,
    so concurrent processes never see a partial model; the loser of a race discards its copy.

    Args:
        cache_dir: Where to keep it; defaults to `pdserve.common.env.cache_dir()`
            (``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``).
        spec: Which demo: `DEMO_SPEC` (Llama) or `DEMO_MOE_SPEC` (Mixtral).

    Returns:
        ``<cache_dir>/<spec.name>`` (``demo-llama-v1``), a Hugging Face model directory.

    Raises:
        RuntimeError: If the target exists but is not a complete demo model.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = spec.name
    target = root / name
    if (target / MANIFEST_FILE).is_file():
        return target
    if target.exists():
        raise RuntimeError(f"{target} exists but is not a complete demo model; delete it")
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private
        digest = write_demo_model(staging, spec)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / MANIFEST_FILE).is_file():
                raise
            log.info("demo_model_reused", path=str(target))
            return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("demo_model_written", path=str(target), weights_sha256=digest)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: generates the demo model if needed and prints its directory on stdout."""
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.engine.demo",
        description="Create the tiny deterministic demo model (if needed) and print its path.",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache directory (default: $PDSERVE_CACHE_DIR or ~/.cache/pdserve)",
    )
    args = parser.parse_args(argv)
    # NOTE: stdout carries only the path (scripts capture it); log events go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    print(ensure_demo_model(args.cache_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
