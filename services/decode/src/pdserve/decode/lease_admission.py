"""Whether a new lease fits: the admission arithmetic as pure functions of counts.

A lease for ``num_kv_tokens`` of KV takes their blocks now and is owed growth headroom: the
blocks its next ``reserve_tokens`` new tokens (at most the ones it may still generate) will
need (`headroom_blocks`; `lease_size` for a new lease, `num_owed_blocks` for the open ones).
A new lease is granted only from the free blocks minus the headroom owed to the open ones,
and must leave room for its own (`capacity_refusal`). While other peers ask for blocks too
(`RecentAsks`), one peer's uncommitted leases may hold at most ``max_lease_share`` of the
pool (`share_refusal`). Each check returns None when the lease is allowed, else the error to
raise; `LeaseManager` applies them under its lock and counts the refusals.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import num_blocks_for
from pdserve.decode.request import DecodeRequest

PEER_SHARE_LIMIT = "peer_share"
"""ErrorInfo ``limit`` of a refusal for the peer's share: it clears as the peer's leases
commit, so the prefill waits and asks again instead of failing the request."""


class LeaseSize(NamedTuple):
    """What a new lease takes now (`num_blocks`) and is owed (`num_headroom_blocks`)."""

    num_blocks: int
    num_headroom_blocks: int


def headroom_blocks(
    num_computed_tokens: int,
    num_remaining_tokens: int,
    num_held_blocks: int,
    *,
    reserve_tokens: int,
    block_size: int,
) -> int:
    """Blocks a request is owed beyond those it holds: room for its next `reserve_tokens`
    tokens, or for all it may still generate when that is fewer."""
    wanted = num_blocks_for(
        num_computed_tokens + min(reserve_tokens, num_remaining_tokens), block_size
    )
    return max(0, wanted - num_held_blocks)


def lease_size(
    num_kv_tokens: int, max_new_tokens: int, reserve_tokens: int, block_size: int
) -> LeaseSize:
    """The blocks a lease for `num_kv_tokens` of KV takes, and its headroom."""
    num_blocks = num_blocks_for(num_kv_tokens, block_size)
    headroom = headroom_blocks(
        num_kv_tokens,
        max_new_tokens,
        num_blocks,
        reserve_tokens=reserve_tokens,
        block_size=block_size,
    )
    return LeaseSize(num_blocks, headroom)


def num_owed_blocks(
    leases: Iterable[DecodeRequest], *, reserve_tokens: int, block_size: int
) -> int:
    """The headroom owed to `leases` in all (free blocks a new lease may not take)."""
    return sum(
        headroom_blocks(
            lease.num_computed_tokens,
            lease.num_remaining_tokens,
            len(lease.block_ids),
            reserve_tokens=reserve_tokens,
            block_size=block_size,
        )
        for lease in leases
    )


class RecentAsks:
    """Which peers asked for a lease lately: the share only bites while more than one did,
    so a lone prefill may use the whole pool. Not thread-safe (`LeaseManager` holds its lock)."""

    def __init__(self) -> None:
        self._asked_at: dict[str, float] = {}

    def is_contended(self, peer_key: str, now: float, window_s: float) -> bool:
        """Records that `peer_key` asks at `now`; whether another peer asked within
        `window_s` (the lease TTL)."""
        self._asked_at[peer_key] = now
        for key, asked_at in list(self._asked_at.items()):
            if now - asked_at > window_s:
                del self._asked_at[key]
        return len(self._asked_at) > 1


def length_refusal(
    request_id: str, num_kv_tokens: int, max_new_tokens: int, max_model_len: int | None
) -> PdserveError | None:
    """INVALID_REQUEST for counts that are not positive; PROMPT_TOO_LONG past `max_model_len`;
    else None."""
    meta = {"requestId": request_id}
    if num_kv_tokens <= 0 or max_new_tokens <= 0:
        return PdserveError(
            ErrorReason.INVALID_REQUEST,
            "num_prompt_tokens and max_new_tokens must be positive",
            meta,
        )
    if max_model_len is not None and num_kv_tokens + max_new_tokens > max_model_len:
        # NOTE: the gateway's rule (prompt + max_tokens <= max_model_len); the prefill's
        # num_prompt_tokens includes earlier completion tokens, max_new_tokens the rest.
        return PdserveError(
            ErrorReason.PROMPT_TOO_LONG,
            f"num_prompt_tokens ({num_kv_tokens}) plus max_new_tokens ({max_new_tokens}) "
            f"exceeds max_model_len {max_model_len}",
            {**meta, "maxModelLen": str(max_model_len)},
        )
    return None


def capacity_refusal(
    request_id: str, size: LeaseSize, num_available_blocks: int, retry_delay_s: float
) -> PdserveError | None:
    """DECODE_CAPACITY_EXHAUSTED (with a retry delay) when the available blocks (free minus
    owed headroom) do not cover the lease's blocks and its own headroom; else None."""
    if size.num_blocks + size.num_headroom_blocks <= num_available_blocks:
        return None
    return PdserveError(
        ErrorReason.DECODE_CAPACITY_EXHAUSTED,
        f"needs {size.num_blocks} blocks (+{size.num_headroom_blocks} headroom), "
        f"{num_available_blocks} available",
        {"requestId": request_id, "numBlocks": str(size.num_blocks)},
        retry_delay_s=retry_delay_s,
    )


def share_refusal(
    request_id: str,
    num_blocks: int,
    num_held_blocks: int,
    num_pool_blocks: int,
    max_lease_share: float,
    *,
    is_contended: bool,
    retry_delay_s: float,
) -> PdserveError | None:
    """DECODE_CAPACITY_EXHAUSTED (``limit`` `PEER_SHARE_LIMIT`) when a peer already holding
    `num_held_blocks` in uncommitted leases would pass its share of the pool while other peers
    ask too (`is_contended`); else None."""
    share = int(max_lease_share * num_pool_blocks)
    # NOTE: a peer holding nothing uncommitted may always take one lease, however
    # large (max_model_len bounds it): the share caps accumulation, not one request,
    # and only while other peers want blocks too.
    if not (num_held_blocks and num_held_blocks + num_blocks > share and is_contended):
        return None
    return PdserveError(
        ErrorReason.DECODE_CAPACITY_EXHAUSTED,
        f"needs {num_blocks} blocks; this peer already holds {num_held_blocks} in uncommitted "
        f"leases and may hold {share} (max_lease_share {max_lease_share:g})",
        {"requestId": request_id, "numBlocks": str(num_blocks), "limit": PEER_SHARE_LIMIT},
        retry_delay_s=retry_delay_s,
    )
