"""A lease being written keeps its blocks until its writer stops, however the lease ends."""

from __future__ import annotations

import pytest

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.decode.lease_state import RequestStatus
from pdserve.decode.leases import LeaseManager
from pdserve.engine.block_pool import BlockPool

BLOCK_SIZE = 4


def _manager() -> LeaseManager:
    return LeaseManager(BlockPool(16), BLOCK_SIZE, reserve_tokens=0, ttl_s=10.0, is_insecure=True)


@pytest.mark.parametrize("ending", [RequestStatus.EXPIRED, RequestStatus.ABORTED])
def test_ending_a_lease_mid_transfer_frees_its_blocks_only_when_the_writer_stops(
    ending: RequestStatus,
) -> None:
    leases = _manager()
    lease = leases.allocate("r", 8, 1)
    held = list(lease.block_ids)
    leases.begin_sync(lease.lease_id, lease.lease_token, None)
    assert leases.table.end(lease, ending)
    assert lease.status is ending
    # Out of the table, yet its blocks are neither free nor grantable to another lease.
    assert leases.table.open_leases() == []
    assert leases.table.pool.num_used_blocks == len(held)
    other = leases.allocate("r2", 48, 1)
    assert not set(other.block_ids) & set(held)
    leases.table.check_integrity()
    leases.table.end_sync(lease)
    assert lease.block_ids == []
    assert leases.table.pool.num_used_blocks == len(other.block_ids)
    leases.table.check_integrity()


def test_a_transfer_that_ends_first_leaves_the_end_to_free_the_blocks() -> None:
    leases = _manager()
    lease = leases.allocate("r", 8, 1)
    leases.begin_sync(lease.lease_id, lease.lease_token, None)
    leases.table.end_sync(lease)
    assert leases.table.pool.num_used_blocks == 2
    assert leases.table.end(lease, RequestStatus.FAILED)
    assert leases.table.pool.num_used_blocks == 0
    leases.table.check_integrity()


def test_the_token_only_rule_opens_a_transfer_without_an_identity_on_a_secure_plane() -> None:
    leases = LeaseManager(BlockPool(16), BLOCK_SIZE, reserve_tokens=0, ttl_s=10.0)
    lease = leases.allocate("r", 8, 1)
    with pytest.raises(PdserveError) as refused:
        leases.begin_sync(lease.lease_id, lease.lease_token, None)
    assert refused.value.reason is ErrorReason.PERMISSION_DENIED
    with pytest.raises(PdserveError):
        leases.begin_sync(lease.lease_id, b"w" * 32, None, is_token_only=True)
    assert leases.begin_sync(lease.lease_id, lease.lease_token, None, is_token_only=True) is lease
    assert lease.status is RequestStatus.SYNCING
