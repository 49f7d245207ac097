"""Tensor parallelism on CPU (gloo): a model split over ranks computes what the whole model
computes, and a group that cannot form or loses a rank fails with a clear error."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from support.eventually import eventually
from support.tiny_models import save_tiny_model

from pdserve.common.generation import SamplingParams
from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, ModelRunner, ScheduledChunk
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.decoder import LlamaAttention
from pdserve.engine.load_runner import load_runner
from pdserve.engine.model_config import ModelConfig, ModelLoadError
from pdserve.engine.model_store import ResolvedModel
from pdserve.engine.parallel.group import RankShard, TensorParallelError, TensorParallelGroup
from pdserve.engine.parallel.layers import attention_head_range, cache_head_range, check_model_fits
from pdserve.engine.parallel.runner import TensorParallelRunner

NUM_BLOCKS = 64
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _config(model: Path, tensor_parallel_size: int, **extra: object) -> EngineConfig:
    # NOTE: float32: the ranks' partial sums add up in another order than one rank's GEMM.
    return EngineConfig(
        model=str(model),
        dtype="float32",
        tensor_parallel_size=tensor_parallel_size,
        num_threads=1,
        seed=0,
        **{"cache": CacheConfig(num_blocks=NUM_BLOCKS), **extra},  # type: ignore[arg-type]
    )


def _logits(runner: ModelRunner) -> torch.Tensor:
    """Logits of two steps: three prefills, then a batch of a prefill from scratch, a prefill
    on cached KV and two decodes (each sequence in blocks of its own)."""
    prompt = list(range(3, 43))
    first = runner.execute(
        [
            ScheduledChunk(list(range(50, 67)), 0, [6, 7]),
            ScheduledChunk(list(range(60, 93)), 0, [8, 9, 10]),
            ScheduledChunk(prompt[:20], 0, [3, 4, 5]),
        ]
    )
    second = runner.execute(
        [
            ScheduledChunk(prompt, 0, [0, 1, 2]),
            ScheduledChunk(prompt[20:], 20, [3, 4, 5]),
            ScheduledChunk([7], 17, [6, 7]),
            ScheduledChunk([9], 33, [8, 9, 10]),
        ]
    )
    return torch.cat((first, second))


def _generate(runner: ModelRunner, model: Path) -> list[list[int]]:
    engine = LLMEngine(_config(model, 1), runner=runner)
    prompts = [list(range(5, 45)), [30, 40, 50], list(range(100, 117))]
    return engine.generate(prompts, GREEDY)


@pytest.fixture
def tp_runner() -> Iterator[Callable[..., TensorParallelRunner]]:
    """Returns ``load(model, size) -> TensorParallelRunner``; each is closed after the test."""
    loaded: list[ModelRunner] = []

    def load(model: Path, size: int, **extra: object) -> TensorParallelRunner:
        runner = load_runner(_config(model, size, **extra))
        assert isinstance(runner, TensorParallelRunner)
        loaded.append(runner)
        return runner

    yield load
    for runner in loaded:
        runner.close()


@pytest.mark.parametrize(
    ("family", "size"),
    [
        ("llama3", 2),  # GQA: one KV head per rank
        ("mistral", 2),  # one KV head, replicated on both ranks; a sliding window
        ("qwen3", 2),  # q/k norm, a head_dim of its own, tied embeddings
        ("qwen2_moe", 2),  # q/k/v bias, experts and a gated shared expert
        ("phi3", 2),  # q/k/v and gate/up fused in the checkpoint
        ("gemma3", 2),  # GeGLU, scaled embeddings, soft-capped logits
        ("mixtral", 2),  # experts stored one tensor each, a window
        ("qwen3_moe", 2),  # experts with q/k norm, a dense layer
        ("smollm3", 2),  # layers without RoPE
        ("ernie4_5", 2),  # a bias on every projection (down's added once), interleaved RoPE
        ("ernie4_5_moe", 2),  # score correction, a shared expert
        ("glm4_moe", 2),  # partial RoPE, grouped routing, a shared expert
        ("gpt_oss", 2),  # sinks split with their heads, expert biases, sliding layers
        ("deepseek_v3", 2),  # latent attention: heads split, the latent whole on every rank
        ("deepseek_v3", 3),  # its 4 query heads over three ranks: 1, 1 and 2 (uneven)
        ("llama_tied", 4),  # four KV heads, one per rank
        ("llama_tied", 3),  # four KV heads over three ranks: 1, 1 and 2 (uneven)
    ],
)
def test_tensor_parallel_matches_one_rank(
    family: str,
    size: int,
    checkpoint: Callable[[str], Path],
    tp_runner: Callable[..., TensorParallelRunner],
) -> None:
    model = checkpoint(family)
    single = ModelRunner.load(_config(model, 1))
    split = tp_runner(model, size)
    assert split.tensor_parallel_size == size
    assert split.kv_cache.layout == single.kv_cache.layout  # rank 0 sees every head
    torch.testing.assert_close(_logits(split), _logits(single), rtol=1e-4, atol=1e-4)
    assert _generate(split, model) == _generate(single, model)


def test_latent_attention_ranks_share_the_whole_latent(
    checkpoint: Callable[[str], Path], tp_runner: Callable[..., TensorParallelRunner]
) -> None:
    """Each rank attends over the whole latent (one cache head, not a slice) and the blocks
    rank 0 holds (those it exports) carry the latent the unsplit model writes."""
    model = checkpoint("deepseek_v3")
    config = ModelConfig.from_pretrained(model)
    assert [cache_head_range(config, RankShard(r, 2)) for r in range(2)] == [range(1)] * 2
    assert [attention_head_range(config, RankShard(r, 2)) for r in range(2)] == [
        range(0, 2),
        range(2, 4),
    ]
    single = ModelRunner.load(_config(model, 1))
    split = tp_runner(model, 2)
    assert split.rank_cache.layout == split.kv_cache.layout
    _logits(split)
    _logits(single)
    used = slice(0, 11)  # the blocks `_logits` writes
    # kv: [layers, 2, blocks, block_size, 1, latent_size / 2]
    torch.testing.assert_close(
        split.kv_cache.kv[:, :, used], single.kv_cache.kv[:, :, used], rtol=1e-5, atol=1e-5
    )


def test_latent_attention_needs_a_query_head_per_rank(checkpoint: Callable[[str], Path]) -> None:
    config = ModelConfig.from_pretrained(checkpoint("deepseek_v3"))  # 4 query heads
    with pytest.raises(ValueError, match="5 is more than the 4 query heads of latent attention"):
        check_model_fits(config, TensorParallelGroup(RankShard(0, 5), None))
    check_model_fits(config, TensorParallelGroup(RankShard(0, 4), None))


def test_uneven_vocabulary_and_replicated_heads(
    tmp_path: Path, tp_runner: Callable[..., TensorParallelRunner]
) -> None:
    # 301 rows over 4 ranks (the last one's padded) and 2 KV heads on 4 ranks (replicated)
    model = save_tiny_model("qwen2", tmp_path / "qwen2", vocab_size=301)
    single = ModelRunner.load(_config(model, 1))
    split = tp_runner(model, 4)
    logits = _logits(split)
    assert logits.shape[1] == 301
    torch.testing.assert_close(logits, _logits(single), rtol=1e-4, atol=1e-4)


def test_default_model_at_tensor_parallel_two(
    smollm2: ResolvedModel, tp_runner: Callable[..., TensorParallelRunner]
) -> None:
    # NOTE: SmolLM2-135M has 9 query and 3 KV heads: over two ranks one holds a KV head and
    # its 3 query heads, the other two and 6 (GQA groups stay whole).
    single = ModelRunner.load(_config(smollm2.path, 1))
    split = tp_runner(smollm2.path, 2)
    assert _generate(split, smollm2.path) == _generate(single, smollm2.path)


def test_size_that_cannot_split_the_heads_is_refused(checkpoint: Callable[[str], Path]) -> None:
    # 2 KV heads: 3 ranks would need a KV head shared by a rank and a half
    with pytest.raises(ValueError, match="3 is more than the 2 KV heads and not a multiple"):
        load_runner(_config(checkpoint("llama3"), 3))


def test_olmo2_is_refused_with_ranks(checkpoint: Callable[[str], Path]) -> None:
    """OLMo 2 normalizes q and k across all heads, which a rank holds only a share of."""
    config = ModelConfig.from_pretrained(checkpoint("olmo2"))
    group = TensorParallelGroup(RankShard(0, 2), None)

    with pytest.raises(ModelLoadError, match="tensor parallelism"):
        LlamaAttention(config, 0, "sdpa", group)
    LlamaAttention(config, 0, "sdpa", TensorParallelGroup.single())


def test_group_that_cannot_form_times_out() -> None:
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match="group of 2 ranks did not form within 1s"):
        TensorParallelGroup.form(store, RankShard(0, 2), torch.device("cpu"), timeout_s=1.0)
    assert time.monotonic() - started < 10


def test_lost_rank_makes_rank_zero_raise(
    checkpoint: Callable[[str], Path], tp_runner: Callable[..., TensorParallelRunner]
) -> None:
    runner = tp_runner(checkpoint("llama3"), 2)
    lost: list[tuple[int, int]] = []
    runner.ranks.on_rank_lost.append(lambda rank, code: lost.append((rank, code)))
    runner.execute([ScheduledChunk([5, 6, 7], 0, [0])])
    os.kill(runner.ranks.pids()[0], signal.SIGKILL)
    # NOTE: whether the step meets the closed connection or the watchdog saw the exit first,
    # rank 0 raises rather than waits.
    with pytest.raises(TensorParallelError):
        runner.execute([ScheduledChunk([5, 6, 7], 0, [0])])
    asyncio.run(eventually(lambda: bool(lost), what="the lost rank reported"))
    assert lost == [(1, -signal.SIGKILL)]
    with pytest.raises(TensorParallelError, match="rank 1 is gone"):
        runner.execute([ScheduledChunk([5, 6, 7], 0, [0])])


def test_a_frozen_rank_is_taken_as_lost_after_the_step_timeout(
    checkpoint: Callable[[str], Path], tp_runner: Callable[..., TensorParallelRunner]
) -> None:
    runner = tp_runner(checkpoint("llama3"), 2, tensor_parallel_step_timeout_s=1.0)
    lost: list[tuple[int, int]] = []
    runner.ranks.on_rank_lost.append(lambda rank, code: lost.append((rank, code)))
    runner.execute([ScheduledChunk([5, 6, 7], 0, [0])])
    os.kill(runner.ranks.pids()[0], signal.SIGSTOP)  # alive, and silent
    with pytest.raises(TensorParallelError, match="did not answer within the step timeout"):
        runner.execute([ScheduledChunk([5, 6, 7], 0, [0])])
    # NOTE: the frozen rank is killed, so the instance's watchers take it down as for a dead one.
    asyncio.run(eventually(lambda: bool(lost), what="the frozen rank reported lost"))
    assert lost == [(1, -signal.SIGKILL)]


def test_closing_stops_the_ranks_and_removes_the_cache_file(
    checkpoint: Callable[[str], Path],
) -> None:
    runner = load_runner(_config(checkpoint("llama3"), 2))
    assert isinstance(runner, TensorParallelRunner)
    path = runner.kv_cache.shared_path
    assert path is not None and path.exists()
    runner.close()
    assert not path.exists()
    assert runner.ranks.exit_codes() == [0]


# NOTE: a rank-0 process of its own: what happens at its exit is the case.
LOAD_AND_EXIT = """
import json, sys
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.load_runner import load_runner
config = EngineConfig(model=sys.argv[1], dtype="float32", tensor_parallel_size=2, num_threads=1,
                      cache=CacheConfig(num_blocks=16))
print(json.dumps(load_runner(config).ranks.pids()), flush=True)
"""


def test_a_process_that_exits_without_closing_its_runner_ends_and_its_ranks_with_it(
    checkpoint: Callable[[str], Path],
) -> None:
    """The ranks are multiprocessing children, which a process joins at its exit: without
    the runner closed at exit they would wait on pipes it still held, and it on them."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", LOAD_AND_EXIT, str(checkpoint("llama3"))],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tensor_parallel_rank_lost" not in done.stdout + done.stderr  # closed, not killed
    (rank_one,) = json.loads(done.stdout.strip().splitlines()[-1])

    def is_gone() -> bool:
        try:
            os.kill(rank_one, 0)
        except ProcessLookupError:
            return True
        return False

    asyncio.run(eventually(is_gone, what="the rank ended"))


def test_ranks_keep_the_sliding_layers_window_in_the_shared_slots(
    checkpoint: Callable[[str], Path],
    tp_runner: Callable[..., TensorParallelRunner],
) -> None:
    """With window slots (`CacheConfig.release_window_blocks`), the shared cache file holds the
    slots after the blocks, every step brings the ranks the slots of its blocks, and the tokens
    are those of one rank keeping every block (gpt-oss: sliding and full layers in turn, sinks;
    windows of 24 tokens, 40-token prompts; Gemma 3's ranks are checked through the split, in
    tests/integration/prefill/test_window_release_split.py)."""
    model = checkpoint("gpt_oss")
    cache = CacheConfig(num_blocks=NUM_BLOCKS, max_seqs=3, release_window_blocks=True)
    split = tp_runner(model, 2, cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=8))
    slots = split.kv_cache.window_slots
    assert slots is not None and split.kv_cache.window_layers
    assert split.kv_cache.shared_path is not None
    prompts = [list(range(5, 45)), [30, 40, 50], list(range(100, 140))]
    windowed = LLMEngine(_config(model, 1, cache=cache), runner=split)
    whole = LLMEngine(_config(model, 1))
    assert whole.kv_cache.window_slots is None
    assert windowed.generate(prompts, GREEDY) == whole.generate(prompts, GREEDY)
    assert slots.num_held == 0
