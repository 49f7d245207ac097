"""Model architecture read from a Hugging Face ``config.json`` (Llama, Qwen2, Mistral)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters.

    Attributes:
        theta: Base wavelength (``rope_theta``).
        rope_type: ``default``, ``linear`` or ``llama3``.
        factor: Scaling factor (``linear`` and ``llama3``).
        low_freq_factor: ``llama3`` only.
        high_freq_factor: ``llama3`` only.
        original_max_position_embeddings: ``llama3`` only: the pre-training context length.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError("rope theta and factor must be positive")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope needs high_freq_factor > low_freq_factor")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeConfig:
        """Reads ``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling``."""
        params = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {}
        merged = {**scaling, **params}
        theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = merged.get("rope_type", merged.get("type", "default"))
        return cls(
            theta=float(theta),
            rope_type=str(rope_type),
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                merged.get("original_max_position_embeddings", 8192)
            ),
        )


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family decoder.

    Qwen2 is Llama with a bias on q/k/v; Mistral is Llama with an optional sliding window.

    Attributes:
        model_type: ``llama``, ``qwen2`` or ``mistral``.
        sliding_windows: Per layer, the attention window in tokens or ``None`` (full attention).
        eos_token_ids: End-of-sequence ids from ``config.json`` and ``generation_config.json``.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_windows: tuple[int | None, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                "num_attention_heads must be a multiple of num_key_value_heads "
                f"({self.num_attention_heads} vs {self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.sliding_windows and len(self.sliding_windows) != self.num_hidden_layers:
            raise ValueError("sliding_windows needs one entry per layer")

    @property
    def num_queries_per_kv(self) -> int:
        """How many query heads share one KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    def sliding_window(self, layer_index: int) -> int | None:
        """The attention window of a layer in tokens, ``None`` for full attention."""
        return self.sliding_windows[layer_index] if self.sliding_windows else None

    @classmethod
    def from_hf_config(
        cls, hf: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Builds the config from the parsed ``config.json`` (and ``generation_config.json``)."""
        model_type = str(hf.get("model_type", ""))
        num_layers = int(hf["num_hidden_layers"])
        num_heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // num_heads
        hidden_act = hf.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; only silu is implemented")
        attention_bias = bool(hf.get("attention_bias", False))
        eos = _as_id_tuple(hf.get("eos_token_id"))
        if generation:
            eos = tuple(dict.fromkeys(eos + _as_id_tuple(generation.get("eos_token_id"))))
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_proj_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            rope=RopeConfig.from_hf(hf),
            sliding_windows=_sliding_windows(hf, model_type, num_layers),
            eos_token_ids=eos,
            bos_token_id=hf.get("bos_token_id"),
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Reads ``config.json`` (and ``generation_config.json`` if present) from a directory."""
        path = Path(model_dir)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"no config.json in model directory {str(path)!r}")
        hf = json.loads(config_file.read_text())
        generation_file = path / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
        return cls.from_hf_config(hf, generation)


def _sliding_windows(
    hf: dict[str, Any], model_type: str, num_layers: int
) -> tuple[int | None, ...]:
    """Per-layer sliding windows, following each architecture's own rules in transformers."""
    window = hf.get("sliding_window")
    if model_type == "qwen2" and not hf.get("use_sliding_window", False):
        window = None
    if model_type == "llama" or window is None:
        return ()
    layer_types = hf.get("layer_types")
    if model_type == "qwen2" and layer_types is None:
        first_sliding = int(hf.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first_sliding else None for i in range(num_layers))
    if layer_types is not None:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    return tuple(int(window) for _ in range(num_layers))
