"""Prefill-only scheduling: FCFS over prepared requests under a token budget per pass.

There is no decode path. A request is admitted when the pool can hold its whole prompt (its
blocks stay with it until its KV has been shipped, so admission never has to back out), the
oldest partially computed request continues first, several prompts share one pass, and a prompt
longer than what is left of the budget is cut into chunks that later passes continue.

With the pool's prefix caching on, a request's full blocks carry cluster-wide keys
(`prefix_block_keys`, rooted in the KV layout fingerprint). At admission the longest run of
leading blocks already cached is shared (a reference each) and computing starts after it; a
block is cached under its key once a pass has filled it. Freed blocks keep their keys until the
pool reuses them (least recently freed first), so admission counts them as free.

With the KV store on, a request may arrive with payloads of the leading blocks after its
locally cached ones (`store_loader`); admission gives them new blocks, caches them under their
keys and starts computing after them (`Request.pending_imports` says what the engine thread
copies into the cache before the pass).
"""

from __future__ import annotations

from collections import Counter, deque

from pdserve.common.generation import num_blocks_for
from pdserve.engine.batch import ScheduledChunk, SchedulerOutput
from pdserve.engine.block_pool import BlockPool, prefix_block_keys
from pdserve.prefill.request import Request


class PrefillScheduler:
    """Chooses the chunks of each forward pass and owns the requests' prefill blocks.

    Args:
        pool: This prefill's block pool (its ``enable_prefix_caching`` turns the cache on).
        block_size: Tokens per block.
        max_num_batched_tokens: Token budget of one pass.
        kv_fingerprint: The KV layout fingerprint the prefix cache's block keys are rooted in.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        max_num_batched_tokens: int,
        kv_fingerprint: str = "",
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_fingerprint = kv_fingerprint
        self.num_cached_prompt_tokens = 0  # prompt tokens taken from the prefix cache
        self.num_cache_hit_blocks = 0
        self.num_loaded_prompt_tokens = 0  # prompt tokens loaded from the KV store
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted (blocks held), prompt not fully computed
        self.prefilled: dict[str, Request] = {}  # computed; blocks held until released

    def add_request(self, request: Request) -> None:
        """Queues a prepared request (FCFS)."""
        self.fill_block_keys(request)
        self.waiting.append(request)

    def fill_block_keys(self, request: Request) -> None:
        """Gives `request` its blocks' cache keys, once, when the prefix cache is on."""
        if self.pool.enable_prefix_caching and not request.block_keys:
            request.block_keys = prefix_block_keys(
                self.kv_fingerprint, request.token_ids, self.block_size
            )

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput[Request]:
        """Picks the next pass: running requests first, then waiting ones in arrival order.

        Admission stops at the first waiting request whose prompt does not fit in the free
        blocks (strict FCFS: a long prompt is never starved by shorter ones behind it).
        """
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledChunk[Request]] = []
        for request in self.running:
            if budget == 0:
                break
            num_new = min(request.num_uncomputed_tokens, budget)
            scheduled.append(ScheduledChunk.cut(request, num_new))
            budget -= num_new
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if not self._admit(request):
                break
            self.waiting.popleft()
            self.running.append(request)
            num_new = min(request.num_uncomputed_tokens, budget)
            scheduled.append(ScheduledChunk.cut(request, num_new))
            budget -= num_new
        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget)

    def update_from_output(self, output: SchedulerOutput[Request]) -> list[Request]:
        """Advances the scheduled requests past their chunks.

        Returns:
            The requests whose prompt is now fully computed (they keep their blocks).
        """
        done: list[Request] = []
        for chunk in output.scheduled:
            request = chunk.request
            request.num_computed_tokens = chunk.num_computed_tokens + chunk.num_new_tokens
            self._cache_full_blocks(request, chunk.num_computed_tokens)
            if request.is_prefilled and request in self.running:
                self.running.remove(request)
                self.prefilled[request.request_id] = request
                done.append(request)
        return done

    def find_cached_blocks(self, request: Request) -> list[int]:
        """The cached blocks holding the longest run of the request's leading full blocks.

        At most ``(num_tokens - 1) // block_size`` blocks: the last token is always computed,
        since its logits give the first token. The blocks are not referenced yet.
        """
        if request.sampling.prompt_logprobs is not None:
            return []  # NOTE: scoring the prompt needs every position's logits: compute it all.
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for key in request.block_keys[:max_blocks]:
            block_id = self.pool.get_cached_block(key)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def num_reusable_blocks(self, request: Request) -> int:
        """How many leading blocks admission would not compute as the cache stands now: the
        cached ones, then the stored payloads that continue them."""
        num_hit_blocks = len(self.find_cached_blocks(request))
        return num_hit_blocks + len(self._usable_stored_payloads(request, num_hit_blocks))

    def _admit(self, request: Request) -> bool:
        """Gives `request` blocks for its whole prompt (cache hits first), or returns False."""
        hit_block_ids = self.find_cached_blocks(request)
        num_new_blocks = num_blocks_for(request.num_tokens, self.block_size) - len(hit_block_ids)
        # NOTE: a hit on a free (evictable) block takes it out of the free queue: count it.
        num_revived = sum(1 for b in hit_block_ids if self.pool.ref_counts[b] == 0)
        if not self.pool.can_allocate(num_new_blocks + num_revived):
            return False
        # NOTE: touch before allocate, so that allocating cannot evict a hit.
        self.pool.touch(hit_block_ids)
        new_block_ids = self.pool.allocate(num_new_blocks)
        request.block_ids = hit_block_ids + new_block_ids
        request.num_cached_tokens = len(hit_block_ids) * self.block_size
        loaded = self._take_stored_payloads(request, len(hit_block_ids))
        request.pending_imports = list(zip(new_block_ids, loaded, strict=False))
        for index in range(len(hit_block_ids), len(hit_block_ids) + len(loaded)):
            self.pool.cache_block(request.block_ids[index], request.block_keys[index])
        request.num_loaded_tokens = len(loaded) * self.block_size
        request.num_computed_tokens = request.num_cached_tokens + request.num_loaded_tokens
        self.num_cache_hit_blocks += len(hit_block_ids)
        self.num_cached_prompt_tokens += request.num_cached_tokens
        self.num_loaded_prompt_tokens += request.num_loaded_tokens
        return True

    def _take_stored_payloads(self, request: Request, num_hit_blocks: int) -> list[bytes]:
        """`_usable_stored_payloads`; the request drops its list."""
        payloads = self._usable_stored_payloads(request, num_hit_blocks)
        request.stored_payloads = []
        return payloads

    def _usable_stored_payloads(self, request: Request, num_hit_blocks: int) -> list[bytes]:
        """The stored payloads that continue the request's `num_hit_blocks` cached blocks
        (capped so the last token is computed)."""
        skip = num_hit_blocks - request.stored_first_block
        if skip < 0:
            return []  # NOTE: a cached block was evicted since the lookup: there is a gap.
        max_blocks = (request.num_tokens - 1) // self.block_size
        return request.stored_payloads[skip : max(skip, max_blocks - request.stored_first_block)]

    def _cache_full_blocks(self, request: Request, num_computed_before: int) -> None:
        """Caches the blocks a pass filled, from `num_computed_before` to now, under their keys."""
        first = num_computed_before // self.block_size
        end = min(request.num_computed_tokens // self.block_size, len(request.block_keys))
        for index in range(first, end):
            self.pool.cache_block(request.block_ids[index], request.block_keys[index])

    def release(self, request: Request) -> bool:
        """Forgets a request at any stage and frees its blocks, once.

        Returns:
            True if the request was known to the scheduler.
        """
        known = False
        if request in self.waiting:
            self.waiting.remove(request)
            known = True
        if request in self.running:
            self.running.remove(request)
            known = True
        if any(r is request for r in self.prefilled.values()):
            del self.prefilled[request.request_id]
            known = True
        if request.block_ids:
            self.pool.free(reversed(request.block_ids))
            request.block_ids = []
        return known

    def fail(self, requests: list[Request]) -> None:
        """Stops computing `requests` (a pass that included them raised); blocks stay held."""
        for request in requests:
            if request in self.running:
                self.running.remove(request)
                self.prefilled[request.request_id] = request

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def check_integrity(self) -> None:
        """Raises AssertionError unless the pool is consistent, the admitted requests hold
        exactly the references of its used blocks, only cached blocks are shared, and every
        cached block a request holds sits where its key says (the KV it claims)."""
        self.pool.check_integrity()
        admitted = (*self.running, *self.prefilled.values())
        owners = Counter(b for r in admitted for b in r.block_ids)
        references = {b: n for b, n in enumerate(self.pool.ref_counts) if n > 0}
        assert owners == references, "the requests' blocks disagree with the reference counts"
        shared = [b for b, n in owners.items() if n > 1]
        assert all(self.pool.block_hash(b) is not None for b in shared), (
            "an uncached block is shared by two requests"
        )
        for request in admitted:
            assert request.num_cached_tokens % self.block_size == 0, "a partial cached block"
            assert request.num_loaded_tokens % self.block_size == 0, "a partial loaded block"
            for index, block_id in enumerate(request.block_ids):
                block_hash = self.pool.block_hash(block_id)
                keys = request.block_keys
                assert block_hash is None or (index < len(keys) and block_hash == keys[index]), (
                    f"request {request.request_id}: block {index} is cached under another key"
                )
        assert not any(r.block_ids for r in self.waiting), "a waiting request holds blocks"
