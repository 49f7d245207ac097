"""Imported by a fork server in the tests: maps the file ``PDSERVE_TEST_MAPPED_FILE`` names
(read-only) and reads every page of it, so that its pages are resident in that process alone
(as torch's library pages that only the server's imports touched)."""

from __future__ import annotations

import mmap
import os

with open(os.environ["PDSERVE_TEST_MAPPED_FILE"], "rb") as _file:
    MAPPED = mmap.mmap(_file.fileno(), 0, prot=mmap.PROT_READ)
TOUCHED = sum(MAPPED[offset] for offset in range(0, len(MAPPED), mmap.PAGESIZE))
