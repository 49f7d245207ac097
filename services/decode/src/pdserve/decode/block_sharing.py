"""Which blocks a new lease shares with a live lease of the same prompt: pure rules.

The completions of one prompt (a request with ``n`` > 1, and their reschedules) carry one share
key. A lease asked for with a key that an open, committed lease holds (its KV arrived and was
verified) references that lease's full prompt blocks (`BlockPool.touch`) instead of taking
fresh ones, and its sender ships only the rest: the prompt's partial last block (each
completion writes its own tokens after the prompt, into blocks of its own) and anything after
it. No holder ever writes a full prompt block again (the decode writes a request's KV only at
positions past what it received), and the blocks go back to the pool with their last reference.

The new lease remembers which tokens those blocks hold; its transfer's header must carry the
same tokens there (`prefix_mismatch`), so a key that names another prompt fails the transfer
instead of decoding from the wrong KV. `LeaseManager.allocate` applies these rules under the
lease table's lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from pdserve.decode.lease_state import RequestStatus
from pdserve.decode.request import DecodeRequest

# NOTE: from COMMITTED on, a lease's KV is verified and its prompt blocks no longer change.
SHAREABLE = frozenset({RequestStatus.COMMITTED, RequestStatus.RUNNING})
PENDING = frozenset({RequestStatus.ALLOCATED, RequestStatus.SYNCING})


class ShareGrant(NamedTuple):
    """What a new lease shares: the source's leading blocks, and the tokens they hold."""

    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]


NO_SHARE = ShareGrant((), ())


def share_source(leases: Iterable[DecodeRequest], share_key: str) -> DecodeRequest | None:
    """The open, committed lease of `share_key` with the longest prompt, or None."""
    if not share_key:
        return None
    sources = [
        lease for lease in leases if lease.share_key == share_key and lease.status in SHAREABLE
    ]
    return max(sources, key=lambda lease: lease.num_prompt_tokens, default=None)


def pending_source(leases: Iterable[DecodeRequest], share_key: str) -> DecodeRequest | None:
    """An open lease of `share_key` whose KV is still on its way (not committed yet), or
    None: a sibling's allocation may wait for its commit to share its blocks."""
    if not share_key:
        return None
    return next(
        (lease for lease in leases if lease.share_key == share_key and lease.status in PENDING),
        None,
    )


def share_grant(source: DecodeRequest | None, num_kv_tokens: int, block_size: int) -> ShareGrant:
    """The blocks a lease for `num_kv_tokens` of KV shares with `source`: the full blocks of
    its prompt, no more than the new lease's KV fills."""
    if source is None:
        return NO_SHARE
    num_blocks = min(source.num_prompt_tokens, num_kv_tokens) // block_size
    num_blocks = min(num_blocks, len(source.block_ids))
    return ShareGrant(
        tuple(source.block_ids[:num_blocks]), tuple(source.token_ids[: num_blocks * block_size])
    )


def prefix_mismatch(shared_token_ids: Sequence[int], token_ids: Sequence[int]) -> str | None:
    """Why a transfer's `token_ids` do not fit the shared blocks' tokens, or None."""
    num = len(shared_token_ids)
    if len(token_ids) < num:
        return f"header carries {len(token_ids)} tokens; the shared blocks hold {num}"
    if tuple(token_ids[:num]) != tuple(shared_token_ids):
        return "header's tokens differ from those the shared blocks hold"
    return None
