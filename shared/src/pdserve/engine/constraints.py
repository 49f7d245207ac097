"""Constraints compiled against the model's tokenizer, and each request's matcher.

A prefill or decode owns one `ConstraintCompiler`. `prepare` compiles a request's constraint
on the compiler's worker thread (never on the engine thread or the event loop: a large schema
must not stall other requests) and answers with a fresh `ConstraintState`. Compiled grammars
are cached by content hash (SHA-256 of the kind and text), least recently used first out;
each request gets a copy of the cached matcher, which is cheap.

A `ConstraintState` is advanced over the request's completion as it grows: before each
sampling, `mask(completion)` consumes the tokens it has not seen and answers the bitmask of
the tokens that may come next (llguidance's layout: bit ``i % 32`` of 32-bit word ``i // 32``
set when token ``i`` is allowed). A continuation on another instance replays the completion
it carries into a fresh matcher, so it masks exactly as the first instance did: the tokens
are a pure function of the constraint and the completion, whichever instance samples.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import structlog

from pdserve.common.constraints import check, invalid
from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import Constraint

log = structlog.get_logger("pdserve.engine.constraints")

DEFAULT_MAX_CACHED = 256


class ConstraintState:
    """One request's matcher and how much of its completion it has consumed."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        self._num_consumed = 0

    def advance(self, completion: Sequence[int]) -> None:
        """Consumes the tokens of `completion` (the whole completion so far) not seen yet.

        Raises:
            PdserveError: INVALID_REQUEST when the completion breaks the constraint (a
                continuation that carries tokens the constraint never allowed).
        """
        matcher = self._matcher
        for token_id in completion[self._num_consumed :]:
            if not matcher.consume_token(token_id):
                raise PdserveError(
                    ErrorReason.INVALID_REQUEST,
                    f"completion token {self._num_consumed} ({token_id}) breaks its constraint",
                )
            self._num_consumed += 1

    def mask(self, completion: Sequence[int]) -> bytes:
        """`advance`s over `completion`; the bitmask of the tokens allowed next.

        Raises:
            PdserveError: INVALID_REQUEST (see `advance`).
        """
        self.advance(completion)
        matcher = self._matcher
        bitmask = matcher.compute_bitmask()
        if matcher.is_error():
            raise PdserveError(ErrorReason.INVALID_REQUEST, matcher.get_error())
        return bitmask

    @property
    def is_complete(self) -> bool:
        """The completion consumed so far is a whole string the constraint accepts."""
        return self._matcher.is_accepting()


class ConstraintCompiler:
    """Compiles constraints for one tokenizer on a worker thread, with a cache.

    Args:
        tokenizer_json: The model's tokenizer.json text.
        eos_token_ids: Ids that end a completion (the only ones allowed once it is complete).
        max_cached: Compiled grammars kept.
    """

    def __init__(
        self,
        tokenizer_json: str,
        eos_token_ids: Sequence[int],
        max_cached: int = DEFAULT_MAX_CACHED,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._max_cached = max_cached
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pdserve-constraints"
        )
        self.num_compiled = 0
        self.num_cache_hits = 0

    def prepare(
        self, constraint: Constraint, completion: Sequence[int] = ()
    ) -> concurrent.futures.Future[ConstraintState]:
        """`start`, on the compiler's worker thread: the future's result or PdserveError."""
        return self._executor.submit(self.start, constraint, completion)

    def start(self, constraint: Constraint, completion: Sequence[int] = ()) -> ConstraintState:
        """A fresh state for `constraint` (compiled on the calling thread unless cached),
        advanced over `completion` (a continuation's completion so far).

        Raises:
            PdserveError: INVALID_REQUEST for a constraint that does not compile, or a
                completion that breaks it.
        """
        state = ConstraintState(self._fresh_matcher(constraint))
        state.advance(completion)
        return state

    def _fresh_matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A copy of the cached matcher (compiled and cached first if missing)."""
        key = _key(constraint)
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return pristine.deep_copy()
        started = time.perf_counter()
        grammar = check(constraint)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise invalid(constraint, matcher.get_error())
        # NOTE: the first mask builds the lexer: here, not in the first engine step.
        matcher.compute_bitmask()
        if matcher.is_error():
            raise invalid(constraint, matcher.get_error())
        log.info(
            "constraint_compiled",
            kind=constraint.kind.value,
            compile_ms=round((time.perf_counter() - started) * 1000, 2),
        )
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = matcher
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
            return matcher.deep_copy()

    def close(self) -> None:
        """Stops the worker thread (compilations not yet started are dropped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        # NOTE: building it takes about half a second: once, on the worker thread.
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json, eos_token=self._eos_token_ids
            )
        return self._tokenizer


def _key(constraint: Constraint) -> str:
    text = json.dumps([constraint.kind.value, constraint.value, list(constraint.choices)])
    return hashlib.sha256(text.encode()).hexdigest()
