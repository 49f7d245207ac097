"""Rank 0's handle on the other ranks of its instance: their processes and their pipes."""

from __future__ import annotations

import contextlib
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable

import structlog

from pdserve.engine.parallel.group import TensorParallelError

log = structlog.get_logger(__name__)

# NOTE: how long `close` waits for the other ranks to exit once one is lost.
LOST_GROUP_CLOSE_S = 1.0

RankLostCallback = Callable[[int, int], None]
"""Called with a lost rank and its exit status (on the thread that noticed)."""


class RankProcesses:
    """The processes of ranks 1..N-1, started by rank 0 and watched while they live.

    Each rank reads its messages from its stdin (`pdserve.engine.parallel.messages`). A rank
    that exits before `close()` is lost: `lost_rank` says which, `on_rank_lost` callbacks run,
    and `send` raises from then on.

    Args:
        world_size: Ranks in the instance, rank 0 included.
    """

    def __init__(self, world_size: int) -> None:
        self.processes = [
            subprocess.Popen(
                [sys.executable, "-m", "pdserve.engine.parallel.worker"], stdin=subprocess.PIPE
            )
            for _ in range(1, world_size)
        ]
        self.lost_rank: int | None = None
        self.on_rank_lost: list[RankLostCallback] = []
        self._is_closing = False
        self._lock = threading.Lock()
        for rank, process in enumerate(self.processes, start=1):
            threading.Thread(
                target=self._watch, args=(rank, process), name=f"tp-rank-{rank}", daemon=True
            ).start()

    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1, in rank order."""
        return [process.pid for process in self.processes]

    def send(self, message: object, rank: int | None = None) -> None:
        """Sends `message` to one rank, or to every rank when `rank` is None.

        Raises:
            TensorParallelError: If a rank is lost.
        """
        self.check_alive()
        targets = self.processes if rank is None else [self.processes[rank - 1]]
        data = pickle.dumps(message)
        try:
            for process in targets:
                assert process.stdin is not None
                process.stdin.write(data)
                process.stdin.flush()
        except (BrokenPipeError, OSError) as error:
            raise TensorParallelError(f"a tensor-parallel rank is gone: {error}") from None

    def check_alive(self) -> None:
        """Raises `TensorParallelError` if a rank is lost."""
        if self.lost_rank is not None:
            raise TensorParallelError(f"tensor-parallel rank {self.lost_rank} is gone")

    def abandon(self) -> None:
        """Kills every rank (one stopped answering): their watchers report the loss."""
        log.error("tensor_parallel_ranks_abandoned", pids=self.pids())
        for process in self.processes:
            with contextlib.suppress(OSError):
                process.kill()

    def close(self, timeout_s: float = 10.0) -> None:
        """Asks every rank to exit (closing its stdin) and kills those that do not in time (1 s
        at most once a rank is lost: a broken group has no step left to finish)."""
        with self._lock:
            self._is_closing = True
            if self.lost_rank is not None:
                timeout_s = min(timeout_s, LOST_GROUP_CLOSE_S)
        for process in self.processes:
            if process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.close()
        for process in self.processes:
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _watch(self, rank: int, process: subprocess.Popen[bytes]) -> None:
        self.lose(rank, process.wait())

    def lose(self, rank: int, returncode: int) -> None:
        """Takes `rank` as lost (its process exited with `returncode`; its watcher calls
        this), unless the ranks are closing or one is lost already: `send` raises from now
        on and the `on_rank_lost` callbacks run, on this thread."""
        with self._lock:
            if self._is_closing or self.lost_rank is not None:
                return
            self.lost_rank = rank
        log.error("tensor_parallel_rank_lost", rank=rank, returncode=returncode)
        for callback in list(self.on_rank_lost):
            callback(rank, returncode)
