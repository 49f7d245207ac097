"""Block keys without numpy: byte-identical to the digests the numpy version produced."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.common.prefix_keys import hash_block_tokens, layout_root, prefix_block_keys

# NOTE: written down from the numpy implementation (np.asarray(tokens, dtype="<i8").tobytes())
# before the functions moved here; keys are shared by every instance and the storage tier, so
# they must never change.
LAYOUT_A_ROOT = "cab55c74be315b66aad413d751d4e90dfeb6af33713dd8238e6c7afb5e8ac20f"
ROOTLESS_1234 = "73e200e2b048c86d4e8c86b86bf62bbda84c7384e34e250b01aa30ab29d234a4"
EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
WIDE_VALUES = "37b0664249e496fd9b20a552a2a9c1f78efada9328efe1127ee70de8b90814e9"
LAYOUT_A_0_TO_40 = [
    "de84a58aecf052b5ad29f83281cafa3f99ad97fb7aaa3aa8bacef0b18f06a994",
    "ea327ae162ee159f220be5a9263c6a9d4aac5fb5088bd3e64d5bb9542eb49830",
]


def test_digests_equal_the_numpy_implementation() -> None:
    assert layout_root("layout-a").hex() == LAYOUT_A_ROOT
    assert hash_block_tokens(None, [1, 2, 3, 4]).hex() == ROOTLESS_1234
    assert hash_block_tokens(None, (1, 2, 3, 4)).hex() == ROOTLESS_1234
    assert hash_block_tokens(None, []).hex() == EMPTY
    wide = [0, 1, 2**31, 2**40, 151643, -1]
    assert hash_block_tokens(layout_root("fp"), wide).hex() == WIDE_VALUES
    keys = prefix_block_keys("layout-a", list(range(40)), 16)
    assert [key.hex() for key in keys] == LAYOUT_A_0_TO_40
    assert prefix_block_keys("layout-a", list(range(15)), 16) == []


def test_a_token_outside_int64_is_refused() -> None:
    with pytest.raises(ValueError, match="int64"):
        hash_block_tokens(None, [2**63])


def test_the_engine_uses_the_same_functions() -> None:
    from pdserve.engine import block_pool

    assert block_pool.prefix_block_keys is prefix_block_keys
    assert block_pool.hash_block_tokens is hash_block_tokens


def test_importing_the_keys_pulls_neither_numpy_nor_torch() -> None:
    code = (
        "import sys, pdserve.common.prefix_keys; "
        "assert not {'numpy', 'torch'} & set(sys.modules), 'numpy or torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
