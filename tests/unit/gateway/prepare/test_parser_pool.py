"""Large request messages are parsed off the gateway's process (`ParserPool`), so the event
loop never spends a large parse's time: checked by where the parse ran, not by a clock."""

from __future__ import annotations

import os

from pdserve.gateway.prepare.workers import INLINE_PARSE_BYTES, ParserPool


async def test_a_message_above_the_inline_size_is_parsed_in_another_process() -> None:
    pool = ParserPool(num_processes=1, budget_s=60)
    try:
        assert await pool.run(os.getpid, INLINE_PARSE_BYTES) == os.getpid()
        assert await pool.run(os.getpid, INLINE_PARSE_BYTES + 1) != os.getpid()
    finally:
        pool.shutdown()
