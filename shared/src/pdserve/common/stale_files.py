"""Files a process names after its pid (``<prefix><pid>-<token>``), left behind when it dies."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def remove_orphaned_files(directory: Path, prefix: str) -> int:
    """Removes this user's ``<prefix><pid>-*`` files in `directory` whose process no longer
    runs; returns how many."""
    num_removed = 0
    for path in directory.glob(f"{prefix}*"):
        pid_text = path.name.removeprefix(prefix).split("-", 1)[0]
        with contextlib.suppress(OSError, ValueError):
            if path.stat().st_uid != os.getuid() or is_process_running(int(pid_text)):
                continue
            path.unlink()
            num_removed += 1
    return num_removed


def is_process_running(pid: int) -> bool:
    """Whether process `pid` of this host still runs (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
