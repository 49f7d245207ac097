"""The batch sizes decode graphs are captured for, and the bucket a batch is padded to."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

SMALL_BUCKETS = (1, 2, 4, 8, 16)
"""The buckets every plan starts with (those up to its largest)."""
BUCKET_STEP = 16
"""Above the small buckets, one bucket every this many sequences."""


def bucket_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture for a decode of at most `max_num_seqs` sequences a step.

    1, 2, 4, 8, 16, then steps of 16 up to `max_num_seqs`; the largest bucket is
    `max_num_seqs` itself (rounded up to a power of two below 16) so that every batch the
    scheduler can form has one.

    Raises:
        ValueError: If `max_num_seqs` is below 1.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    sizes = [size for size in SMALL_BUCKETS if size < max_num_seqs]
    sizes.extend(range(BUCKET_STEP * 2, max_num_seqs, BUCKET_STEP))
    last = max_num_seqs
    if last < SMALL_BUCKETS[-1]:
        # NOTE: 3 becomes 4, 12 becomes 16: the power of two a smaller decode pads to anyway.
        last = next(size for size in SMALL_BUCKETS if size >= max_num_seqs)
    sizes.append(last)
    return tuple(sorted(set(sizes)))


def bucket_for(batch_size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `batch_size` rows, or None above the largest."""
    index = bisect_left(buckets, batch_size)
    return buckets[index] if index < len(buckets) else None
