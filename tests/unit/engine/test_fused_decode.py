"""A decode step's layers in one compiled call (`pdserve.engine.fused_decode`), in float32 and
in bfloat16: the same logits and the same K/V as the layer-by-layer path, bit for bit; steps and
models it does not take run layer by layer, and the log says why a model's layers do not fuse."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from structlog.testing import capture_logs
from support.converted_gguf import converted_tiny_gguf
from support.gguf_files import NUM_LAYERS, TinyGgufSpec

from pdserve.engine import CacheConfig, EngineConfig, ScheduledChunk, cpu_kernels
from pdserve.engine.fused_decode import CHUNK_ROWS, FusedDecode
from pdserve.engine.layers import silu_mul, takes_silu_mul
from pdserve.engine.model_store import ResolvedModel
from pdserve.engine.runner import ModelRunner

F32 = pytest.mark.skipif(
    not cpu_kernels.f32_available(), reason="the float32 kernels need AVX2, FMA and F16C"
)
BF16 = pytest.mark.skipif(not cpu_kernels.available(), reason="the bf16 kernels need AVX512-BF16")
DTYPES = [pytest.param("float32", marks=F32), pytest.param("bfloat16", marks=BF16)]

BLOCK_SIZE = 16
BLOCKS_PER_SEQ = 8
MAX_STREAMS = 2 * CHUNK_ROWS + 2


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The kernels run where torch runs one thread (each engine gets its share of the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load(
    model: Path, *, fused: bool = True, dtype: str = "float32", **settings: object
) -> ModelRunner:
    config = EngineConfig(
        model=str(model),
        **{"dtype": dtype, "quantization": "auto", **settings},  # type: ignore[arg-type]
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=BLOCKS_PER_SEQ * (MAX_STREAMS + 1)),
    )
    runner = ModelRunner.load(config)
    if not fused:
        with mock.patch.object(FusedDecode, "why_not", return_value="layer by layer"):
            assert runner.model.fused_decode() is None
    return runner


class Streams:
    """Prompts prefilled into a runner's cache, then decoded a token a step."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]]) -> None:
        self.runner = runner
        self.tokens = [list(p) for p in prompts]
        self.tables = [
            list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)) for i in range(len(prompts))
        ]
        # NOTE: each prompt but its last token, which the first decode step takes.
        for tokens, table in zip(self.tokens, self.tables, strict=True):
            runner.execute([ScheduledChunk(tokens[:-1], 0, table)])

    def step(self, rows: int, per_call: int | None = None) -> torch.Tensor:
        """A decode of the first `rows` streams' last tokens (in calls of `per_call` rows, or
        one): their logits."""
        chunks = [
            ScheduledChunk([self.tokens[i][-1]], len(self.tokens[i]) - 1, self.tables[i])
            for i in range(rows)
        ]
        per_call = per_call or rows
        return torch.cat(
            [self.runner.execute(chunks[i : i + per_call]) for i in range(0, rows, per_call)]
        )

    def hidden_states(self) -> list[torch.Tensor]:
        """Records, from now on, the hidden states after the last layer of every forward."""
        recorded: list[torch.Tensor] = []
        self.runner.model.model.norm.register_forward_pre_hook(
            lambda _, args: recorded.append(args[0].clone())
        )
        return recorded

    def advance(self, picks: list[int]) -> None:
        """Appends each of the first streams' next token."""
        for tokens, pick in zip(self.tokens, picks, strict=False):
            tokens.append(pick)


def prompts(num: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 60, (num,), generator=generator).tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` hold the same rows, bit for bit, in any order."""
    return sorted(map(tuple, a.tolist())) == sorted(map(tuple, b.tolist()))


def assert_fused_equals_layer_by_layer(
    model: Path, vocab: int, row_counts: list[int], dtype: str
) -> None:
    """Decode steps of `row_counts` rows (each row its stream's greedy pick) on a fused runner
    and on a layer-by-layer one (given `CHUNK_ROWS` rows a call, as the fused step takes
    them; more rows there take a GEMM over the dequantized weights): the same hidden states
    after the last layer at every step, the same logits where the LM head had the same rows,
    and the same cache after."""
    fused, layers = load(model, dtype=dtype), load(model, fused=False, dtype=dtype)
    assert fused.model.fused_decode() is not None
    assert fused.kv_cache.kv.dtype == getattr(torch, dtype)
    batch = prompts(max(row_counts), vocab, seed=len(row_counts))
    ours, theirs = Streams(fused, batch), Streams(layers, batch)
    our_hidden, their_hidden = ours.hidden_states(), theirs.hidden_states()
    with mock.patch.object(FusedDecode, "run", side_effect=FusedDecode.run, autospec=True) as run:
        for rows in row_counts:
            got, want = ours.step(rows), theirs.step(rows, per_call=CHUNK_ROWS)
            # NOTE: the runner orders a step's decodes by context length: compare the rows as
            # sets (the logits come back in the chunks' order).
            assert same_rows(our_hidden.pop(), torch.cat(their_hidden)), f"{rows} rows"
            their_hidden.clear()
            if rows <= CHUNK_ROWS:
                assert torch.equal(got, want), f"{rows} rows"
            picks = want.argmax(dim=-1).tolist()
            ours.advance(picks)
            theirs.advance(picks)
    assert run.call_count == len(row_counts)
    assert torch.equal(fused.kv_cache.kv, layers.kv_cache.kv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tensor_type",
    [
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q6_K,
    ],
    ids=["Q4_1", "Q4_K", "Q8_0", "Q6_K"],
)
def test_a_fused_step_is_the_layer_by_layer_step_bit_for_bit(
    tmp_path: Path, tensor_type: GGMLQuantizationType, dtype: str
) -> None:
    model = converted_tiny_gguf(tmp_path, TinyGgufSpec(tensor_type=tensor_type))
    with capture_logs() as logs:
        load(model, dtype=dtype).model.fused_decode()
    [line] = [e for e in logs if e["event"] == "fused_decode"]
    assert line["enabled"] is True and line["num_layers"] == NUM_LAYERS
    assert line["dtype"] == dtype
    vocab = load(model, fused=False).model.config.vocab_size
    assert_fused_equals_layer_by_layer(model, vocab, [1, 3, CHUNK_ROWS, 2, MAX_STREAMS, 1], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_default_model_decodes_fused_as_layer_by_layer(
    smollm2: ResolvedModel, dtype: str
) -> None:
    """SmolLM2's Q4_1 file as ``--dtype auto`` serves it (bfloat16 on a CPU with native bf16,
    float32 elsewhere): its 30 layers fuse, and steps of 1 to 18 rows give the layer-by-layer
    path's bits."""
    rows = [1, 1, 5, CHUNK_ROWS, MAX_STREAMS]
    assert_fused_equals_layer_by_layer(smollm2.path, 49152, rows, dtype)


def test_a_kernel_team_decodes_the_same_bits(tmp_path: Path) -> None:
    """A fused one-row step with its GEMMs shared by two threads (``--kernel-threads 2``): the
    logits and K/V of one thread's step. The engine sets the team from its config."""
    model = converted_tiny_gguf(tmp_path, TinyGgufSpec(tensor_type=GGMLQuantizationType.Q4_K))
    alone, team = load(model), load(model, kernel_threads=2)
    try:
        assert cpu_kernels.team_threads() == 2
        vocab = alone.model.config.vocab_size
        batch = prompts(3, vocab, seed=11)
        ours, theirs = Streams(team, batch), Streams(alone, batch)
        for _ in range(3):
            cpu_kernels.set_team_threads(2)
            got = ours.step(1)
            cpu_kernels.set_team_threads(1)
            want = theirs.step(1)
            assert torch.equal(got, want)
            picks = want.argmax(dim=-1).tolist()
            ours.advance(picks)
            theirs.advance(picks)
        assert torch.equal(team.kv_cache.kv, alone.kv_cache.kv)
    finally:
        cpu_kernels.set_team_threads(1)


def test_a_step_with_a_prefill_runs_layer_by_layer(tmp_path: Path) -> None:
    """A prefill beside a decode: the layers one by one, with the same logits as a runner that
    never fuses."""
    model = converted_tiny_gguf(tmp_path, TinyGgufSpec(tensor_type=GGMLQuantizationType.Q4_0))
    fused, layers = load(model), load(model, fused=False)
    vocab = layers.model.config.vocab_size
    batch = prompts(2, vocab, seed=3)
    ours, theirs = Streams(fused, batch), Streams(layers, batch)
    extra = prompts(1, vocab, seed=4)[0]
    table = list(range(BLOCKS_PER_SEQ * MAX_STREAMS, BLOCKS_PER_SEQ * (MAX_STREAMS + 1)))
    mixed = [
        ScheduledChunk([ours.tokens[0][-1]], len(ours.tokens[0]) - 1, ours.tables[0]),
        ScheduledChunk(extra, 0, table),
    ]
    with mock.patch.object(FusedDecode, "run", side_effect=AssertionError("fused")):
        assert torch.equal(fused.execute(mixed), layers.execute(mixed))
    assert torch.equal(ours.step(2), theirs.step(2))


@pytest.mark.parametrize(
    ("spec", "settings", "reason"),
    [
        (
            TinyGgufSpec(tensor_type=GGMLQuantizationType.Q4_0),
            {"dtype": "float16"},
            "needs bfloat16 or float32",
        ),
        (
            TinyGgufSpec(tensor_type=GGMLQuantizationType.Q4_0),
            {"quantization": "none"},
            "qkv_proj is Linear",
        ),
        (TinyGgufSpec(tensor_type=GGMLQuantizationType.Q4_0), {"deterministic": True}, "attention"),
        (
            TinyGgufSpec(architecture="qwen3", tensor_type=GGMLQuantizationType.Q4_0),
            {},
            "q/k norms",
        ),
    ],
    ids=["float16", "float32-weights", "deterministic", "qk-norms"],
)
def test_a_model_whose_layers_do_not_fuse_says_why(
    tmp_path: Path, spec: TinyGgufSpec, settings: dict[str, object], reason: str
) -> None:
    model = converted_tiny_gguf(tmp_path, spec)
    with capture_logs() as logs:
        runner = load(model, **settings)
        assert runner.model.fused_decode() is None
    [line] = [e for e in logs if e["event"] == "fused_decode"]
    assert line["enabled"] is False and reason in line["reason"], line


def test_silu_mul_is_torchs_swiglu_within_float32_rounding_row_by_row() -> None:
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(5, 2 * 1544, generator=generator) * 6
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -87.0, 200.0, -200.0])
    assert takes_silu_mul(gate_up)
    out = silu_mul(gate_up)
    gate, up = gate_up.split(1544, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=2e-6, atol=1e-30)
    assert all(torch.equal(silu_mul(gate_up[i : i + 1])[0], out[i]) for i in range(5))
    assert not takes_silu_mul(gate_up.half())
    assert not takes_silu_mul(gate_up[:, ::2])


@BF16
def test_bf16_silu_mul_rounds_as_torchs_two_bf16_ops() -> None:
    """SiLU in float32 rounded to bf16, then the product rounded: torch's ``F.silu(gate) * up``
    in bf16, but for the rare value whose float32 SiLU (its own exp) lies across a bf16
    rounding boundary from torch's; each row alone."""
    generator = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(4, 2 * 1536, generator=generator) * 6).bfloat16()
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 88.0, -87.0, 200.0, -200.0])
    out = silu_mul(gate_up)
    gate, up = gate_up.split(1536, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(out, want)
    assert (out == want).float().mean() > 0.999
    assert all(torch.equal(silu_mul(gate_up[i : i + 1])[0], out[i]) for i in range(4))
    assert takes_silu_mul(gate_up)
    assert not takes_silu_mul(torch.zeros(1, 2 * 8, dtype=torch.bfloat16))
