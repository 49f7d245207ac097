"""Per-model tokenizer and limits, fetched from a prefill's GetModelInfo or read from a directory.

The gateway has no access to model files: by default it asks a prefill instance that serves
the model for its ``tokenizer.json``, tokenizer config, chat template and EOS ids, and caches
the result per model name. ``--tokenizer DIR`` replaces that with a local directory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.memory import return_freed_memory
from pdserve.tokenizer import Tokenizer

log = structlog.get_logger("pdserve.gateway.fleet.model_info")


@dataclass(frozen=True)
class ModelFiles:
    """What a prefill sends about its model (GetModelInfoResponse, as plain data)."""

    model_name: str
    tokenizer_json: str
    tokenizer_config: Mapping[str, Any] | None
    chat_template: str | None
    eos_token_ids: tuple[int, ...]
    max_model_len: int


@dataclass(frozen=True)
class ModelInfo:
    """Everything the gateway needs to tokenize and validate requests for one model.

    Attributes:
        max_model_len: Longest sequence the source reported; 0 when unknown (a local
            tokenizer directory), in which case the instances' registered limit applies.
    """

    model_name: str
    tokenizer: Tokenizer
    max_model_len: int = 0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a completion unless ignore_eos is set."""
        return self.tokenizer.eos_token_ids


FetchModelFiles = Callable[[str], Awaitable[ModelFiles]]
"""Fetches `ModelFiles` from the prefill at an address; raises on failure."""


def _build_tokenizer(files: ModelFiles) -> Tokenizer:
    tokenizer = Tokenizer.from_files(
        files.tokenizer_json,
        dict(files.tokenizer_config) if files.tokenizer_config else None,
        files.chat_template,
        eos_token_ids=files.eos_token_ids,
    )
    # NOTE: parsing tokenizer.json leaves more free memory in this thread's arena than the
    # tokenizer keeps (25 of 42 MB on the default model).
    return_freed_memory()
    return tokenizer


class ModelInfoStore:
    """Caches one `ModelInfo` per model name.

    Args:
        fetch: Gets a prefill's `ModelFiles` by address.
        tokenizer_dir: A model directory whose tokenizer serves every model instead.

    Raises:
        FileNotFoundError, ValueError: If `tokenizer_dir` holds no usable tokenizer.
    """

    def __init__(self, fetch: FetchModelFiles, tokenizer_dir: str | None = None) -> None:
        self._fetch = fetch
        self._local_tokenizer = (
            Tokenizer.from_pretrained(Path(tokenizer_dir)) if tokenizer_dir else None
        )
        self._infos: dict[str, ModelInfo] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def cached(self, model_name: str) -> ModelInfo | None:
        """The model's info if it is known already."""
        if self._local_tokenizer is not None:
            return ModelInfo(model_name, self._local_tokenizer)
        return self._infos.get(model_name)

    def forget(self, model_name: str) -> None:
        """Drops a cached entry (for example when no instance serves the model any more)."""
        self._infos.pop(model_name, None)

    async def get(self, model_name: str, prefill_addresses: Sequence[str]) -> ModelInfo:
        """The model's info, fetched from the first prefill in `prefill_addresses` that answers.

        Raises:
            PdserveError: NO_HEALTHY_INSTANCES when it is not cached and no prefill answers.
        """
        info = self.cached(model_name)
        if info is not None:
            return info
        lock = self._locks.setdefault(model_name, asyncio.Lock())
        async with lock:
            info = self._infos.get(model_name)
            if info is not None:
                return info
            for address in prefill_addresses:
                try:
                    files = await self._fetch(address)
                    tokenizer = await asyncio.to_thread(_build_tokenizer, files)
                except Exception as exc:  # any failure: try the next prefill
                    log.warning(
                        "model_info_fetch_failed", model=model_name, address=address, error=str(exc)
                    )
                    continue
                if files.model_name and files.model_name != model_name:
                    log.warning(
                        "model_info_name_mismatch",
                        model=model_name,
                        address=address,
                        reported_model=files.model_name,
                    )
                    continue
                info = ModelInfo(model_name, tokenizer, files.max_model_len)
                self._infos[model_name] = info
                log.info(
                    "model_info_loaded",
                    model=model_name,
                    address=address,
                    vocab_size=tokenizer.vocab_size,
                    max_model_len=files.max_model_len,
                )
                return info
        raise PdserveError(
            ErrorReason.NO_HEALTHY_INSTANCES,
            f"no prefill instance of model {model_name!r} returned its tokenizer",
            {"model": model_name},
            retry_delay_s=1.0,
        )
