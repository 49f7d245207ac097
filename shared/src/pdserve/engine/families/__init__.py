"""The model families the engine serves: one module of this package per family, found here.

A family module (named after its ``model_type``) defines ``FAMILY``, a `Family`: how its
``config.json`` turns into the engine's `ModelConfig` fields (over the rules every family
shares, `pdserve.engine.hf_config`), how its checkpoint's tensor names and layouts differ
from what the engine loads, what llama.cpp calls it in a GGUF file and how that file's
metadata and tensors become the family's Hugging Face directory, and any layer only that
family has. The shared layers (attention, MLA, MoE, norms, RoPE, projections) stay in their
own modules.

The registry imports every module of the package the first time it is asked (`families`), so
a family whose layers the engine already has is added by adding its module, and nothing
else. A module whose name starts with ``_`` is not a family.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.gguf_architectures import ArchitectureRules
from pdserve.engine.hf_config import shared_fields

ConfigGetter = Callable[..., Any]
"""Reads ``{arch}.<key>`` from a GGUF file's metadata: ``get(key, default=None)``; raises if
absent."""
GgufConfigRules = Callable[[dict[str, Any], ConfigGetter, set[str]], None]
"""Completes the ``config.json`` of one family from a GGUF file: (config, get, the file's
tensor names)."""
ConfigRules = Callable[[Mapping[str, Any], dict[str, Any]], None]
"""Sets a family's own `ModelConfig` fields: (the parsed ``config.json``, the fields as the
shared rules read them), changed in place."""
TensorRule = Callable[[str, Any, Any], Any]
"""Readies one checkpoint tensor for loading: (its name after `Family.renames`, the tensor,
the `ModelConfig`) -> the tensor as the engine loads it, or None to leave it out."""
Renames = tuple[tuple[re.Pattern[str], str], ...]


@dataclass(frozen=True)
class GgufFamily:
    """What llama.cpp calls a family and how its GGUF files become the family's directory.

    Attributes:
        architecture: ``general.architecture`` of the family's files.
        tensors: How the file's tensors become Hugging Face tensors.
        config: The family's own ``config.json`` keys from the file's metadata (the keys every
            family has are read by `pdserve.engine.gguf_config`).
        claims: When two families share an architecture name (Mixtral's files are ``llama``
            files with experts), whether a file is this family's; the family without one
            takes the files no other claims.
        reads_rope_freqs: The file may hold Llama 3's RoPE scaling as ``rope_freqs`` divisors.
    """

    architecture: str
    tensors: ArchitectureRules
    config: GgufConfigRules | None = None
    claims: Callable[[Mapping[str, Any]], bool] | None = None
    reads_rope_freqs: bool = False


@dataclass(frozen=True)
class Family:
    """One model family (one ``model_type``).

    Attributes:
        model_type: The ``model_type`` of its ``config.json``; the module's name.
        config: Its own `ModelConfig` fields; None: the shared rules alone (Llama's).
        renames: (pattern, replacement) pairs that turn its checkpoint's tensor names into
            the names the engine loads (Mixtral's ``block_sparse_moe`` into ``mlp``).
        load_tensor: Readies a tensor for loading (reorders, refuses, or leaves out).
        decoder_layer: Its decoder layer (``cls(config, layer_index, backend, group)``) where
            it is not the shared pre-norm one.
        gguf: Its GGUF files, None when llama.cpp writes none the engine reads.
        refused: Near-miss ``model_type`` values (another model of the family that the engine
            does not serve) -> what to say when one is asked for.
    """

    model_type: str
    config: ConfigRules | None = None
    renames: Renames = ()
    load_tensor: TensorRule | None = None
    decoder_layer: type[Any] | None = None
    gguf: GgufFamily | None = None
    refused: Mapping[str, str] = field(default_factory=dict)

    def renamed(self, hf_name: str) -> str:
        """The name the engine loads checkpoint tensor `hf_name` under."""
        for pattern, replacement in self.renames:
            hf_name = pattern.sub(replacement, hf_name)
        return hf_name


@functools.cache
def families() -> dict[str, Family]:
    """Every family, by ``model_type``, from the modules of this package (read once).

    Raises:
        TypeError: For a module without a `Family` named ``FAMILY`` or one named otherwise
            than its ``model_type``.
    """
    found: dict[str, Family] = {}
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, Family) or family.model_type != module_info.name:
            raise TypeError(
                f"{module.__name__} must define FAMILY, a Family whose model_type is "
                f"{module_info.name!r}"
            )
        found[family.model_type] = family
    return found


def supported_model_types() -> tuple[str, ...]:
    """The ``model_type`` of every family, sorted."""
    return tuple(families())


def family_of(model_type: str) -> Family:
    """The family of a ``model_type``.

    Raises:
        ValueError: For a ``model_type`` no family has, naming the supported ones.
    """
    found = families().get(model_type)
    if found is not None:
        return found
    hint = "".join(
        f" ({message})"
        for family in families().values()
        for refused, message in family.refused.items()
        if refused == model_type
    )
    raise ValueError(
        f"unsupported model_type {model_type!r}{hint}; "
        f"supported: {', '.join(supported_model_types())}"
    )


def supported_architectures() -> tuple[str, ...]:
    """Every GGUF architecture (``general.architecture``) a family reads, sorted."""
    return tuple(sorted({f.gguf.architecture for f in families().values() if f.gguf is not None}))


def gguf_family(metadata: Mapping[str, Any]) -> Family:
    """The family of a GGUF file, by its ``general.architecture`` (and, where families share
    one, by what their `GgufFamily.claims` say of the file).

    Raises:
        ValueError: For an architecture no family reads, naming it and the supported ones.
    """
    arch = str(metadata.get("general.architecture", ""))
    candidates = [
        f for f in families().values() if f.gguf is not None and f.gguf.architecture == arch
    ]
    for family in candidates:
        assert family.gguf is not None
        if family.gguf.claims is not None and family.gguf.claims(metadata):
            return family
    for family in candidates:
        assert family.gguf is not None
        if family.gguf.claims is None:
            return family
    raise ValueError(
        f"unsupported GGUF architecture {arch!r} (general.architecture); "
        f"supported: {', '.join(supported_architectures())} (llama with experts is Mixtral)"
    )


def model_config_fields(
    hf: Mapping[str, Any], generation: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The `ModelConfig` fields of a parsed ``config.json`` (and ``generation_config.json``):
    the rules every family shares, then the family's own.

    Raises:
        ValueError: For an unknown ``model_type`` or a setting the engine does not implement.
        KeyError: For a setting the config must have and lacks.
    """
    family = family_of(str(hf.get("model_type", "")))
    fields = shared_fields(hf, generation)
    if family.config is not None:
        family.config(hf, fields)
    return fields


__all__ = [
    "ConfigGetter",
    "ConfigRules",
    "Family",
    "GgufConfigRules",
    "GgufFamily",
    "Renames",
    "TensorRule",
    "families",
    "family_of",
    "gguf_family",
    "model_config_fields",
    "supported_architectures",
    "supported_model_types",
]
