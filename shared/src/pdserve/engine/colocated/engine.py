"""Single-process engine: scheduler, model runner and sampler in one loop."""

from __future__ import annotations

import random
from collections.abc import Sequence

import structlog

from pdserve.common.generation import SamplingParams, num_blocks_for, resolve_seed
from pdserve.engine.batch import SchedulerOutput
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.colocated.kv_cache_manager import KVCacheManager
from pdserve.engine.colocated.request import Request, RequestStatus
from pdserve.engine.colocated.scheduler import RequestOutput, Scheduler
from pdserve.engine.config import EngineConfig
from pdserve.engine.load_runner import load_runner
from pdserve.engine.model import LayerCallback
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import Sampler, SamplingRow

log = structlog.get_logger(__name__)


class LLMEngine:
    """Continuous batching over the paged KV cache, in the calling thread.

    The colocated engine: ``python -m pdserve.engine`` runs it, tests hold the disaggregated
    output equal to it, and benchmarks measure the services against it. The prefill and decode
    services share its lower layers (``ModelRunner`` with its ``KVCache``, ``BlockPool``,
    ``Sampler``) but schedule with their own code; ``Scheduler``, ``KVCacheManager`` and
    ``Request`` serve this engine only.

    Args:
        config: Engine settings.
        runner: A runner to reuse (e.g. one loaded once for several engines); loaded otherwise.
    """

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        self.runner = runner or load_runner(config)
        self.model_config = self.runner.model_config
        self.kv_cache = self.runner.kv_cache
        self.block_size = self.kv_cache.block_size
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.block_pool = BlockPool(self.kv_cache.num_blocks, config.cache.enable_prefix_caching)
        self.kv_cache_manager = KVCacheManager(
            self.block_pool,
            self.block_size,
            self.kv_cache.window_slots,
            self.model_config.widest_window,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.max_model_len)
        self.sampler = Sampler(self.model_config.eos_token_ids)
        self._seed_rng = random.Random(config.seed)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        output_token_ids: Sequence[int] = (),
        block_ids: Sequence[int] = (),
        num_computed_tokens: int = 0,
    ) -> Request:
        """Queues a request.

        Args:
            request_id: Unique among live requests.
            prompt_token_ids: The prompt.
            sampling_params: Defaults to ``SamplingParams()``.
            output_token_ids: Tokens generated earlier (resuming a request elsewhere).
            block_ids: Blocks of ``block_pool`` this request takes ownership of, already holding
                the KV of its first ``num_computed_tokens`` tokens (e.g. imported from a
                prefill instance with ``KVCache.import_blocks``). They are freed with it.
            num_computed_tokens: Tokens whose KV is in ``block_ids``.

        Returns:
            The queued request.

        Raises:
            ValueError: If the request can never fit (too long for the model or the cache) or
                is otherwise malformed.
        """
        params = sampling_params or SamplingParams()
        vocab_size = self.model_config.vocab_size
        if any(not 0 <= t < vocab_size for t in (*prompt_token_ids, *output_token_ids)):
            raise ValueError(f"request {request_id!r} has token ids outside [0, {vocab_size})")
        num_tokens = len(prompt_token_ids) + len(output_token_ids)
        if num_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r} has {num_tokens} tokens; max_model_len is "
                f"{self.max_model_len} (one more token must fit)"
            )
        if len(output_token_ids) >= params.max_tokens:
            raise ValueError(f"request {request_id!r} already has max_tokens output tokens")
        final_len = min(num_tokens + params.max_tokens - len(output_token_ids), self.max_model_len)
        num_blocks = num_blocks_for(final_len, self.block_size)
        if num_blocks > self.block_pool.num_blocks:
            raise ValueError(
                f"request {request_id!r} needs up to {num_blocks} blocks; "
                f"the cache has {self.block_pool.num_blocks}"
            )
        if block_ids and self.kv_cache.window_slots is not None:
            raise ValueError(
                f"request {request_id!r}: a cache whose sliding layers keep only their window "
                "takes no blocks computed elsewhere"
            )
        if num_blocks_for(num_computed_tokens, self.block_size) > len(block_ids):
            raise ValueError(f"request {request_id!r}: block_ids cannot hold num_computed_tokens")
        if any(
            not 0 <= b < self.block_pool.num_blocks or self.block_pool.ref_counts[b] <= 0
            for b in block_ids
        ):
            raise ValueError(f"request {request_id!r}: block_ids must be allocated from block_pool")
        request = Request(
            request_id,
            prompt_token_ids,
            params,
            resolve_seed(params.seed, self._seed_rng),
            output_token_ids=output_token_ids,
            block_ids=block_ids,
            num_computed_tokens=num_computed_tokens,
            eos_token_ids=self.model_config.eos_token_ids,
        )
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        """Ends a live request and frees its blocks; returns False if it was not live."""
        return bool(self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED))

    def abort(self, request_id: str) -> bool:
        """Alias of ``abort_request``."""
        return self.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_unfinished_requests()

    def step(self, on_layer_done: LayerCallback | None = None) -> list[RequestOutput]:
        """Schedules and runs one step.

        Returns:
            One output per request that ran (empty ``new_token_ids`` for a partial prefill).
        """
        return self.execute(self.scheduler.schedule(), on_layer_done)

    def execute(
        self,
        scheduler_output: SchedulerOutput[Request],
        on_layer_done: LayerCallback | None = None,
    ) -> list[RequestOutput]:
        """Runs a step that was already scheduled (lets a caller inspect it first).

        Args:
            scheduler_output: From ``scheduler.schedule()``.
            on_layer_done: Passed to ``ModelRunner.execute``.
        """
        if scheduler_output.is_empty:
            return []
        scheduled = scheduler_output.scheduled
        logits = self.runner.execute(scheduled, on_layer_done)
        sample_rows = [i for i, item in enumerate(scheduled) if item.completes_prompt]
        sampled: dict[str, int] = {}
        if sample_rows:
            rows = [
                SamplingRow(
                    scheduled[i].request.sampling_params,
                    scheduled[i].request.seed,
                    scheduled[i].request.num_output_tokens,
                    scheduled[i].request.prompt_token_ids,
                    scheduled[i].request.output_token_ids,
                )
                for i in sample_rows
            ]
            tokens = self.sampler(logits[sample_rows], rows)
            sampled = {
                scheduled[i].request.request_id: t for i, t in zip(sample_rows, tokens, strict=True)
            }
        return self.scheduler.update_from_output(scheduler_output, sampled)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[list[int]]:
        """Runs prompts to completion and returns each one's generated tokens, in order.

        Raises:
            RuntimeError: If other requests are already live in this engine, or the requests
                cannot make progress.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("generate() needs an idle engine")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
        if len(params_list) != len(prompts):
            raise ValueError("one SamplingParams per prompt is required")
        ids = [f"generate-{i}" for i in range(len(prompts))]
        results: dict[str, list[int]] = {request_id: [] for request_id in ids}
        for request_id, prompt, params in zip(ids, prompts, params_list, strict=True):
            self.add_request(request_id, prompt, params)
        while self.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.is_empty and not scheduler_output.preempted_request_ids:
                raise RuntimeError("no request can be scheduled: the KV cache has no room left")
            for output in self.execute(scheduler_output):
                results[output.request_id].extend(output.new_token_ids)
        return [results[request_id] for request_id in ids]
