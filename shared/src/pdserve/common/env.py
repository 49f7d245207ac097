"""The one place where pdserve reads environment variables.

Every setting that may come from the environment has a named constant and a small function
here, so the rest of the code takes plain values (paths, numbers) and never calls
`os.environ` itself.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE_DIR = "PDSERVE_CACHE_DIR"
"""Directory for generated artifacts such as the demo model."""

DEFAULT_CACHE_DIR = Path("~/.cache/pdserve")


def cache_dir() -> Path:
    """Returns the pdserve cache directory.

    It is ``$PDSERVE_CACHE_DIR`` when that variable is set and not empty, otherwise
    ``~/.cache/pdserve``. The directory is not created here.

    Returns:
        An absolute path with ``~`` expanded.
    """
    value = os.environ.get(ENV_CACHE_DIR, "").strip()
    path = Path(value) if value else DEFAULT_CACHE_DIR
    return path.expanduser().absolute()
