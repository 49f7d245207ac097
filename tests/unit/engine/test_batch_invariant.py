"""Batch-invariant numerics (`EngineConfig.deterministic`): a request's logits, tokens and
logprobs are bit for bit the same alone, beside other requests, chunked, with its prefix cached,
and recomputed by a prefill after a move (`pdserve.engine.batch_invariant`).

The real model runs in the dtype ``--dtype auto`` serves on this CPU (`SERVING_DTYPE`): bfloat16
where the CPU has it natively, float32 elsewhere (where bf16 is emulated, a step costs many
times float32's); the tiny models run in bfloat16 everywhere."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from pdserve.engine.arch_config import MoeConfig
from pdserve.engine.batch_invariant import INVARIANT_BACKEND, MIN_ROWS, make_batch_invariant
from pdserve.engine.linear import INVARIANT_MAX_ROWS, Linear, can_pack_for_onednn
from pdserve.engine.model_store import ResolvedModel
from pdserve.engine.moe import Experts, KeptExperts
from pdserve.engine.packed_weights import mxfp4_as_int8, mxfp4_codes
from pdserve.engine.precision import choose_dtype
from pdserve.engine.quant import Int4Linear, Int8Linear

EngineFactory = Callable[..., LLMEngine]
PromptFactory = Callable[..., list[list[int]]]


class Recorder:
    """Wraps an engine's sampler: keeps, per prompt, the float logits of every row sampled for
    it and the sampler's pick (token and logprobs)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.inner = engine.sampler
        self.logits: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self.picks: dict[tuple[int, ...], list[Any]] = {}
        engine.sampler = self  # type: ignore[assignment]

    def __call__(self, logits: torch.Tensor, rows: Sequence[Any]) -> list[int]:
        picks = self.inner.sample(logits, rows)
        for index, row in enumerate(rows):
            key = tuple(row.prompt_token_ids)
            self.logits.setdefault(key, []).append(logits[index].float().clone())
            self.picks.setdefault(key, []).append(picks[index])
        return [pick.token_id for pick in picks]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def run(
    engine: LLMEngine, batch: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> tuple[list[list[int]], Recorder]:
    recorder = Recorder(engine)
    try:
        return engine.generate(batch, params), recorder
    finally:
        engine.sampler = recorder.inner  # type: ignore[assignment]


def assert_bit_equal(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), what
    differing = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if not torch.equal(a, b)]
    assert not differing, f"{what}: logits of steps {differing[:8]} differ"


# --- the real model -------------------------------------------------------------------------

NUM_TOKENS = 24
SERVING_DTYPE = choose_dtype("auto", torch.device("cpu")).dtype


@pytest.fixture(scope="module")
def real_engine(smollm2: ResolvedModel) -> Callable[..., LLMEngine]:
    def make(**scheduler: Any) -> LLMEngine:
        prefix = scheduler.pop("enable_prefix_caching", False)
        config = EngineConfig(
            model=str(smollm2.path),
            dtype=SERVING_DTYPE,
            quantization="none",
            deterministic=True,
            seed=0,
            cache=CacheConfig(block_size=16, num_blocks=256, enable_prefix_caching=prefix),
            scheduler=SchedulerConfig(**scheduler),
        )
        return LLMEngine(config)

    return make


def real_prompts(num: int, seed: int, min_len: int = 5, max_len: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(100, 40000) for _ in range(rng.randrange(min_len, max_len + 1))]
        for _ in range(num)
    ]


def test_the_engine_reports_batch_invariant_numerics(real_engine: EngineFactory) -> None:
    engine = real_engine()
    assert engine.runner.attention_backend == INVARIANT_BACKEND
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.min_rows == MIN_ROWS for m in linears)


def test_greedy_logits_are_bit_equal_alone_beside_others_chunked_cached_and_recomputed(
    real_engine: EngineFactory,
) -> None:
    """The issue's cases in the serving dtype, on the default model: the same prompt alone,
    beside 7 others of other lengths, prefilled in chunks of 16, with 48 of its tokens in the
    prefix cache, and prefilled again with its first 1 and 17 outputs (what a decode that takes
    a moved stream over recomputes). The runs without a scheduler setting of their own share
    one engine: what it ran before must not matter either."""
    target, *others = real_prompts(8, seed=3, min_len=70, max_len=120)
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    engine = real_engine()
    (alone,), recorded = run(engine, [target], greedy)
    want = recorded.logits[tuple(target)]
    assert len(want) == NUM_TOKENS

    outputs, recorded = run(engine, [target, *others], greedy)
    assert outputs[0] == alone
    assert_bit_equal(recorded.logits[tuple(target)], want, "beside 7 others")

    outputs, recorded = run(real_engine(max_num_batched_tokens=16), [target, *others[:3]], greedy)
    assert outputs[0] == alone
    assert_bit_equal(recorded.logits[tuple(target)], want, "chunked by 16")

    cached = real_engine(enable_prefix_caching=True)
    cached.generate([target[:48] + [7] * 20], SamplingParams(temperature=0.0, max_tokens=1))
    assert cached.block_pool.num_cached_blocks >= 3
    outputs, recorded = run(cached, [target], greedy)
    assert outputs[0] == alone
    assert_bit_equal(recorded.logits[tuple(target)], want, "48 tokens cached")

    for num_done in (1, 17):
        moved = target + alone[:num_done]
        rest = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS - num_done, ignore_eos=True)
        outputs, recorded = run(engine, [moved, *others[:2]], rest)
        assert outputs[0] == alone[num_done:]
        assert_bit_equal(recorded.logits[tuple(moved)], want[num_done:], f"moved at {num_done}")


def test_seeded_sampling_and_logprobs_are_equal_alone_and_in_a_batch_of_16(
    real_engine: EngineFactory,
) -> None:
    target, *others = real_prompts(16, seed=9)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True, logprobs=5)
    engine = real_engine()
    (alone,), recorded = run(engine, [target], seeded)
    want = recorded.picks[tuple(target)]
    params = [seeded] + [SamplingParams(temperature=0.7, seed=i, max_tokens=24) for i in range(15)]
    outputs, recorded = run(engine, [target, *others], params)
    assert outputs[0] == alone
    got = recorded.picks[tuple(target)]
    assert [pick.logprobs for pick in got] == [pick.logprobs for pick in want]
    assert all(pick.logprobs is not None for pick in got)


# --- every family the engine serves, tiny ----------------------------------------------------


def test_every_family_is_batch_invariant_and_recomputes_equal(
    arch: str, make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    def engine(**scheduler: Any) -> LLMEngine:
        made = make_engine(arch, dtype="bfloat16", **scheduler)
        config = EngineConfig(**{**vars(made.config), "deterministic": True})
        return LLMEngine(config)

    target, *others = prompts(6, seed=21, min_len=10, max_len=60)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (alone,), recorded = run(engine(), [target], greedy)
    want = recorded.logits[tuple(target)]
    outputs, recorded = run(engine(max_num_batched_tokens=16), [target, *others], greedy)
    assert outputs[0] == alone
    assert_bit_equal(recorded.logits[tuple(target)], want, "beside 5 others, chunked by 16")
    moved = target + alone[:9]
    rest = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)
    outputs, recorded = run(engine(), [moved, *others[:2]], rest)
    assert outputs[0] == alone[9:]
    assert_bit_equal(recorded.logits[tuple(moved)], want[9:], "moved at 9")


# --- the projections ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kind", ["linear", "int8", "int4"])
@pytest.mark.parametrize(("in_features", "out_features"), [(2048, 1536), (4864, 896)])
def test_a_projection_gives_a_row_the_same_result_for_any_number_of_rows(
    kind: str, in_features: int, out_features: int, dtype: torch.dtype
) -> None:
    """Sizes where a one-row GEMM sums in another order on the CPUs measured (a GEMV splitting
    the inner dimension); with `MIN_ROWS` every row count from 1 gives each row the same
    bits. The plain projection runs packed for oneDNN where the engine packs it
    (`can_pack_for_onednn`: bf16 only where oneDNN runs bf16)."""
    generator = torch.Generator().manual_seed(0)
    linear = Linear(in_features, out_features, bias=False)
    weight = torch.randn(in_features, out_features, generator=generator) * 0.05
    linear.weight_t.data = weight.to(dtype)
    module: torch.nn.Module = linear
    if kind == "linear":
        if can_pack_for_onednn(torch.device("cpu"), dtype):
            linear.pack_for_onednn()
    elif kind == "int8":
        module = Int8Linear(linear)
    else:
        module = Int4Linear.from_linear(linear)
    # NOTE: as the engine sets it: an int4 projection runs on the AMX GEMM where the CPU has AMX.
    make_batch_invariant(module)
    assert module.min_rows == MIN_ROWS
    # NOTE: more rows than `INVARIANT_MAX_ROWS`: on a CPU with AMX oneDNN's bf16 GEMM sums a
    # call of more than 32 rows in another order (Intel Xeon: rows 1-32 alike, 33 not).
    x = torch.randn(2 * INVARIANT_MAX_ROWS + 6, in_features, generator=generator).to(dtype)
    with torch.no_grad():
        whole = module(x)
        for rows in (1, 2, 3, 7, 16, 17, INVARIANT_MAX_ROWS, INVARIANT_MAX_ROWS + 1, 48):
            assert torch.equal(module(x[:rows]), whole[:rows]), rows
            assert torch.equal(module(x[rows : rows + 1])[0], whole[rows]), rows


def test_a_prefill_writes_the_kv_a_decode_writes_bit_for_bit(real_engine: EngineFactory) -> None:
    """Positions 60-99 of a sequence: decoded one by one after a 60-token prefill, and
    prefilled at once (what a decode that takes a moved stream, or the KV store, would hold):
    every layer's K and V are the same bytes."""
    from pdserve.engine import ScheduledChunk

    engine = real_engine()
    (sequence,) = real_prompts(1, seed=13, min_len=100, max_len=100)
    num_blocks = -(-len(sequence) // engine.block_size)
    decoded, prefilled = (engine.block_pool.allocate(num_blocks) for _ in range(2))
    runner = engine.runner
    runner.execute([ScheduledChunk(sequence[:60], 0, decoded)])
    for position in range(60, len(sequence)):
        runner.execute([ScheduledChunk([sequence[position]], position, decoded)])
    runner.execute([ScheduledChunk(sequence, 0, prefilled)])
    cache = engine.kv_cache
    for layer in range(cache.layout.num_layers):
        for part in cache.layer(layer):
            # [blocks, block_size, heads, dim] -> [tokens, heads, dim]
            a = part[torch.tensor(decoded)].flatten(0, 1)[: len(sequence)]
            b = part[torch.tensor(prefilled)].flatten(0, 1)[: len(sequence)]
            assert torch.equal(a, b), layer


# NOTE: sizes where a GEMM over the dequantized weight sums in another order than the kernel
_HIDDEN = 2048
_MOE = MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=1536,
                      norm_topk_prob=False, moe_layers=(True,), expert_bias=True,
                      clamped_swiglu=(1.702, 7.0))  # fmt: skip


@pytest.mark.parametrize("form", ["int8", "int4", "mxfp4"])
def test_kept_experts_give_a_token_the_same_result_for_any_number_of_tokens(form: str) -> None:
    """Experts kept quantized (`KeptExperts`), as int8 groups (a GGUF's Q8_0, or gpt-oss's
    MXFP4 ones widened), int4 groups (a GGUF's Q4_0/Q4_1/Q4_K) or MXFP4 codes (gpt-oss's on the
    int4 kernel's table): with `MIN_ROWS` a token's output has the same bits
    whatever the other tokens routed to its experts (more rows than the kernel takes alone,
    `KeptExperts.KERNEL_MAX_ROWS`, run on it too)."""
    if (why_not := KeptExperts.why_not(_MOE, _HIDDEN, torch.bfloat16)) is not None:
        pytest.fail(f"pdserve's int8 kernel does not run here: {why_not}")
    generator = torch.Generator().manual_seed(0)
    experts = KeptExperts(_MOE, _HIDDEN, "silu").to(torch.bfloat16)
    size = _MOE.moe_intermediate_size
    for part, (out, cols) in {
        "gate_up_proj": (2 * size, _HIDDEN),
        "down_proj": (_HIDDEN, size),
    }.items():
        if form == "int4":
            values = torch.randint(0, 256, (4, out, cols // 2), dtype=torch.uint8,
                                   generator=generator)  # fmt: skip
            steps = torch.rand(4, out, cols // 32, generator=generator) * 0.01 + 0.001
            experts.load_int4(part, values, steps, -8 * steps)
            continue
        blocks = torch.randint(0, 256, (4, out, cols // 32, 16), dtype=torch.uint8,
                               generator=generator)  # fmt: skip
        scales = torch.randint(118, 124, (4, out, cols // 32), dtype=torch.uint8,
                               generator=generator)  # fmt: skip
        if form == "mxfp4":
            experts.load_mxfp4(part, mxfp4_codes(blocks, scales), torch.bfloat16)
        else:
            experts.load_int8(part, *mxfp4_as_int8(blocks, scales))
    assert set(experts.forms.values()) == {form}
    with torch.no_grad():
        for bias in (experts.gate_up_proj_bias, experts.down_proj_bias):
            assert bias is not None
            bias.normal_(0, 0.02, generator=generator)
    experts.min_rows = MIN_ROWS
    rows = KeptExperts.KERNEL_MAX_ROWS + 1
    assert_each_token_alike(experts, torch.bfloat16, 3 * KeptExperts.KERNEL_MAX_ROWS, (rows,),
                            generator)  # fmt: skip


def assert_each_token_alike(
    experts: Experts,
    dtype: torch.dtype,
    num: int,
    row_counts: Sequence[int],
    generator: torch.Generator,
) -> None:
    """`num` tokens, every one on experts 0 and 1 (each expert sees up to `num` rows at once):
    a token's output has the same bits alone, among the first of each of `row_counts` tokens,
    and among all `num`."""
    x = torch.randn(num, _HIDDEN, generator=generator).to(dtype)
    ids = torch.tensor([[0, 1]] * num)
    weights = torch.rand(num, 2, generator=generator)
    with torch.no_grad():
        whole = experts(x, ids, weights)
        # NOTE: every token alone: a sum in another order changes a few outputs in 10^4
        alone = torch.cat([experts(x[i : i + 1], ids[i : i + 1], weights[i : i + 1])
                           for i in range(num)])  # fmt: skip
        assert torch.equal(alone, whole)
        for rows in row_counts:
            assert torch.equal(experts(x[:rows], ids[:rows], weights[:rows]), whole[:rows]), rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_dense_experts_give_a_token_the_same_result_for_any_number_of_tokens(
    dtype: torch.dtype,
) -> None:
    """Experts in the serving dtype (`Experts`, a bf16 or float32 checkpoint's): under
    `make_batch_invariant` (oneDNN's GEMM over each expert's ``[out, in]`` layout, at most
    `INVARIANT_MAX_ROWS` rows a call) a token's output has the same bits alone and beside
    others. torch.mm over the ``[in, out]`` weight gives other bits from 7-28 rows in bf16
    on a CPU with AMX."""
    generator = torch.Generator().manual_seed(0)
    experts = Experts(_MOE, _HIDDEN, "silu")
    with torch.no_grad():
        for weight in experts.parameters():
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.02)
    experts = experts.to(dtype)
    assert make_batch_invariant(experts) == (1, 0) and experts.min_rows == MIN_ROWS
    assert experts.gate_up_proj[0].t().is_contiguous()  # the [out, in] layout
    assert_each_token_alike(
        experts, dtype, 2 * INVARIANT_MAX_ROWS + 6, (7, INVARIANT_MAX_ROWS + 1), generator
    )
