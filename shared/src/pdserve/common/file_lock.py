"""An exclusive lock on a file, held across processes: instances starting together on one host
prepare what it guards once."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(root: Path, name: str = ".lock") -> Iterator[None]:
    """Holds an exclusive lock (``flock``) on the file `name` in `root`, creating both.

    Raises:
        OSError: Where `root` or the file cannot be created.
    """
    root.mkdir(parents=True, exist_ok=True)
    with (root / name).open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
