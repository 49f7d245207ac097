"""Which decode the completions of one prompt went to, so that the others follow it there.

A decode holds the full KV blocks of a prompt once for every completion of it that runs there
at the same time (the decode's block sharing, keyed by the request's share key). The router
remembers the decode each share key was last routed to and prefers it for the key's other
completions and their reschedules while it has room for what they do not share
(`affine_decode`); otherwise the usual least-loaded decode takes them, and they simply share
nothing. The memory is a bounded LRU: a key is only useful while its request runs.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from pdserve.common.generation import num_blocks_for
from pdserve.gateway.routing.pools import FULL, Pool, lease_blocks

DEFAULT_MAX_KEYS = 4096


class ShareAffinity:
    """Share key -> the decode instance its completions were last routed to (bounded LRU).

    Args:
        max_keys: Most keys remembered; the least recently routed one is forgotten first.
    """

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._decode_of: OrderedDict[str, str] = OrderedDict()

    def decode_of(self, share_key: str) -> str | None:
        """The decode the key's completions went to, or None."""
        return self._decode_of.get(share_key) if share_key else None

    def record(self, share_key: str, decode_id: str) -> None:
        """A completion of `share_key` was routed to `decode_id`."""
        if not share_key:
            return
        self._decode_of[share_key] = decode_id
        self._decode_of.move_to_end(share_key)
        while len(self._decode_of) > self.max_keys:
            self._decode_of.popitem(last=False)

    def __len__(self) -> int:
        return len(self._decode_of)


class Affine(NamedTuple):
    """The decode a request's other completions went to (None: none yet), and the prompt's
    length, whose full blocks they share there."""

    decode_id: str | None
    num_shared_tokens: int


def num_shared_blocks(num_tokens: int, num_shared_tokens: int, block_size: int) -> int:
    """Blocks of a lease for `num_tokens` of KV that a decode already holding a prompt of
    `num_shared_tokens` tokens shares instead of taking: the prompt's full blocks, no more
    than the lease's KV fills (the decode's rule)."""
    return min(num_shared_tokens, num_tokens) // max(1, block_size)


def choices_blocks(num_prompt_tokens: int, max_tokens: int, n: int, block_size: int) -> int:
    """Blocks `n` completions of one prompt take on one decode when each reaches `max_tokens`:
    the prompt's full blocks once, and each completion's own blocks after them."""
    num_shared = num_prompt_tokens // max(1, block_size)
    num_own = num_blocks_for(num_prompt_tokens + max_tokens, max(1, block_size)) - num_shared
    return num_shared + n * num_own


def max_choice_tokens(
    num_prompt_tokens: int, n: int, num_total_blocks: int, block_size: int
) -> int:
    """The most tokens each of `n` completions of one prompt may generate so that all of them
    fit on a decode of `num_total_blocks` together (`choices_blocks`); 0 when none fit."""
    block_size = max(1, block_size)
    num_shared = num_prompt_tokens // block_size
    num_own = (num_total_blocks - num_shared) // max(1, n)
    return max(0, (num_shared + num_own) * block_size - num_prompt_tokens)


def affine_decode(
    pool: Pool, affine: Affine | None, num_tokens: int, room: tuple[int, int] | None
) -> tuple[int, int] | None:
    """Where the affine decode stands in `pool`, and the blocks it would share, if it takes a
    request for `num_tokens` of KV: not excluded, not marked full, and with `room` (tokens,
    max new tokens) room for the blocks the lease does not share; else None."""
    if affine is None or affine.decode_id is None:
        return None
    at = pool.positions.get(affine.decode_id)
    if at is None or pool.scores[at] >= FULL:
        return None
    block_size = pool.layout.block_size
    num_shared = num_shared_blocks(num_tokens, affine.num_shared_tokens, block_size)
    if room is None or pool.entries[at].load.num_total_blocks == 0:
        return at, num_shared
    if -pool.scores[at] >= lease_blocks(*room, block_size) - num_shared:
        return at, num_shared
    return None
