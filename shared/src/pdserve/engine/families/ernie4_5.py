"""ERNIE 4.5 (dense, ERNIE-4.5-0.3B): Llama with a bias on every projection when
``use_bias``, tied embeddings by default, and RoPE over adjacent pairs of a head's dims
(computed in float32, as the reference does; the loader reorders q's and k's rows into the
half-split RoPE the engine runs). The multi-token-prediction layers are not loaded.

GGUF: ``ernie4_5`` files, unpermuted (llama.cpp rotates adjacent pairs too); ``use_bias`` from
the biases in the file.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.families import ConfigGetter, Family, GgufFamily
from pdserve.engine.gguf_architectures import DENSE_LAYER_NAMES, ArchitectureRules
from pdserve.engine.hf_config import ernie_fields


def _load_tensor(name: str, tensor: Any, config: Any) -> Any:
    # NOTE: ERNIE's multi-token-prediction layers (for speculation) are not served.
    return None if "mtp" in name else tensor


def _gguf_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    # NOTE: ERNIE 4.5 has one switch for the biases of every projection.
    config["use_bias"] = config.pop("attention_bias")


FAMILY = Family(
    "ernie4_5",
    config=ernie_fields,
    load_tensor=_load_tensor,
    gguf=GgufFamily(
        "ernie4_5",
        ArchitectureRules("ernie4_5", "Ernie4_5ForCausalLM", DENSE_LAYER_NAMES),
        config=_gguf_config,
    ),
)
