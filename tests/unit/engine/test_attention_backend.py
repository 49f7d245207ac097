"""Which attention runs: flash-attn 4 or 2 where usable, SDPA otherwise, and what is reported."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.engine import LLMEngine, flash_attention, rank_model
from pdserve.engine.flash_attention import FlashImplementation, flash_attn_unusable_reason
from pdserve.engine.rank_model import attention_backend_name, resolve_attention_backend

CUDA = torch.device("cuda")


def test_without_flash_attn_auto_is_sdpa_and_flash_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(flash_attention, "FLASH", None)
    assert resolve_attention_backend("auto", CUDA, torch.bfloat16, 16) == "sdpa"
    with pytest.raises(ValueError, match="not installed"):
        resolve_attention_backend("flash", CUDA, torch.bfloat16, 16)


@pytest.mark.parametrize(
    ("name", "multiple", "block_size", "expected"),
    [
        ("flash-attn-4", 1, 16, "flash"),
        ("flash-attn-2", 256, 16, "sdpa"),
        ("flash-attn-2", 256, 256, "flash"),
    ],
)
def test_auto_takes_flash_attn_where_its_page_rule_holds(
    monkeypatch: pytest.MonkeyPatch, name: str, multiple: int, block_size: int, expected: str
) -> None:
    implementation = FlashImplementation(name, object(), multiple)
    monkeypatch.setattr(flash_attention, "FLASH", implementation)
    monkeypatch.setattr(rank_model, "FLASH", implementation)
    assert resolve_attention_backend("auto", CUDA, torch.bfloat16, block_size) == expected
    assert attention_backend_name(expected) == (name if expected == "flash" else "sdpa")


def test_flash_attn_never_runs_on_cpu_or_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flash_attention, "FLASH", FlashImplementation("flash-attn-4", None, 1))
    assert flash_attn_unusable_reason(torch.device("cpu"), torch.bfloat16, 16) is not None
    assert flash_attn_unusable_reason(CUDA, torch.float32, 16) is not None
    assert resolve_attention_backend("auto", torch.device("cpu"), torch.bfloat16, 16) == "sdpa"


def test_the_engine_reports_the_attention_it_runs(make_engine: Callable[..., LLMEngine]) -> None:
    assert make_engine().runner.attention_backend == "sdpa"
