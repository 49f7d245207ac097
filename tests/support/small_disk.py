"""A small disk for tests: a tmpfs mounted on a directory, which a test fills to the last byte
(every later write gets ENOSPC) and frees again.

Mounting takes root (CAP_SYS_ADMIN); where `mount` is missing or not permitted the test fails
with what to do, as the suite's other needed tools do.
"""

from __future__ import annotations

import errno
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

_FILLER = ".filler"
_CHUNK = 1 << 20


class SmallDisk:
    """A tmpfs of `size_bytes` mounted on `root` (see `small_disk`).

    Attributes:
        root: The mount point.
        size_bytes: The file system's size.
    """

    def __init__(self, root: Path, size_bytes: int) -> None:
        self.root = root
        self.size_bytes = size_bytes
        self._filler = root / _FILLER

    @property
    def is_full(self) -> bool:
        """Whether the filler is in place."""
        return self._filler.exists()

    def free_bytes(self) -> int:
        """Bytes still free."""
        return shutil.disk_usage(self.root).free

    def fill(self) -> int:
        """Writes a filler file until the disk refuses a write (ENOSPC): every later write to
        the disk fails until `free`. Returns the filler's size."""
        written = 0
        chunk = b"\0" * _CHUNK
        with self._filler.open("ab", buffering=0) as f:
            while True:
                try:
                    written += f.write(chunk)
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    break
        return written

    def free(self) -> None:
        """Removes the filler (the disk has its room again)."""
        self._filler.unlink(missing_ok=True)


@contextmanager
def small_disk(root: Path, size_bytes: int = 64 << 20) -> Iterator[SmallDisk]:
    """Mounts a tmpfs of `size_bytes` on `root` (created if missing) for the block; unmounts it
    (and whatever is on it) after."""
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.fail("`mount` is not installed (util-linux): a small disk needs it", pytrace=False)
    root.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(
            f"cannot mount a tmpfs on {root} ({done.stderr.strip() or done.returncode}): a small "
            "disk takes root (CAP_SYS_ADMIN); run the test as root",
            pytrace=False,
        )
    try:
        yield SmallDisk(root, size_bytes)
    finally:
        subprocess.run(["umount", "--lazy", str(root)], check=False, capture_output=True)
