"""Which attention runs: flash-attn 4 or 2 where usable, SDPA otherwise, and what is reported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pdserve.engine import LLMEngine, flash_attention, rank_model
from pdserve.engine.attention_metadata import AttentionMetadata
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


@pytest.mark.parametrize("name", ["flash-attn-4", "flash-attn-2"])
@pytest.mark.parametrize("window", [None, 8])
def test_flash_attention_passes_each_implementation_its_own_arguments(
    monkeypatch: pytest.MonkeyPatch, name: str, window: int | None
) -> None:
    """The call is made on CPU with a recording stand-in for the kernel: each implementation
    gets the packed lengths, the block table under its own keyword and its own window form."""
    calls: list[dict[str, Any]] = []

    def varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
        calls.append(kwargs)
        out = torch.zeros_like(q)
        return (out, None) if name == "flash-attn-4" else out

    monkeypatch.setattr(flash_attention, "FLASH", FlashImplementation(name, varlen_func, 1))
    metadata = AttentionMetadata(
        block_size=4,
        slot_mapping=torch.arange(5),
        block_table=torch.tensor([[0, 1], [2, 0]]),
        context_lens=torch.tensor([6, 2]),
        query_lens=torch.tensor([1, 2]),
        num_decodes=1,
        prefills=[],
    )
    attention = flash_attention.FlashAttention(4, 2, 8, window, scale=0.5)
    q = torch.zeros(3, 4, 8)
    k_cache = v_cache = torch.zeros(3, 4, 2, 8)
    out = attention._attend(q, q, q, (k_cache, v_cache, metadata))

    assert out.shape == q.shape
    (kwargs,) = calls
    assert kwargs["cu_seqlens_q"].tolist() == [0, 1, 3]
    assert (kwargs["max_seqlen_q"], kwargs["max_seqlen_k"]) == (2, 6)
    assert (kwargs["softmax_scale"], kwargs["causal"]) == (0.5, True)
    table = kwargs["page_table" if name == "flash-attn-4" else "block_table"]
    assert table.dtype == torch.int32 and table.tolist() == [[0, 1], [2, 0]]
    if name == "flash-attn-4":
        assert kwargs["seqused_k"].tolist() == [6, 2] and "cu_seqlens_k" not in kwargs
        assert kwargs["window_size"] == ((None, None) if window is None else (7, 0))
    else:
        assert kwargs["cu_seqlens_k"].tolist() == [0, 6, 8] and "seqused_k" not in kwargs
        assert kwargs["window_size"] == ((-1, -1) if window is None else (7, 0))
