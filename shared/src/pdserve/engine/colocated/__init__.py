"""The colocated reference engine: prefill and decode in one continuous batch, in one process.

No service runs it. ``python -m pdserve.engine`` generates with it, tests hold the
disaggregated output equal to it, and benchmarks measure the services against it. It sits on
the engine's lower layers (``ModelRunner`` with its ``KVCache``, ``BlockPool``, ``Sampler``,
the ``ScheduledChunk`` batch) and keeps its own request, block bookkeeping and scheduler:

* ``engine``: ``LLMEngine`` (``add_request``, ``step``, ``abort``, ``generate``).
* ``scheduler``: ``Scheduler`` (continuous batching with preemption by recompute).
* ``kv_cache_manager``: ``KVCacheManager`` (a request's blocks, prefix caching).
* ``request``: ``Request`` and its ``RequestStatus``.
"""

from __future__ import annotations

from pdserve.engine.colocated.engine import LLMEngine

__all__ = ["LLMEngine"]
