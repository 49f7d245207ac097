"""Rank 0's handle on the other ranks of its instance: their processes and their pipes.

The ranks are forked from a multiprocessing *fork server* (the standard library's
``forkserver`` start method) that imported torch and the rank's modules once
(`RANK_PRELOAD`): the first instance that splits a model starts it, and every rank after
that (the other ranks of a group of three or more, a runner loaded again in the same process)
starts without importing torch again, in well under a second instead of the 3-4 s of CPU an
interpreter takes to import it. The server is a fresh interpreter of its own, never one that
ran a step: forking it is safe where rank 0 has threads or has touched CUDA. A rank shares the
server's pages of torch: on the default model at three ranks, float32, the two ranks and the
server took 652 MB of proportional memory against 796 MB for two ranks of their own.

As with any multiprocessing start method but ``fork``, a rank imports the main module of rank
0's process again, unless it ran as ``python -m`` (the services): a script that splits a model
keeps its work under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import structlog

from pdserve.engine.parallel.group import TensorParallelError
from pdserve.engine.parallel.worker import serve_rank

log = structlog.get_logger(__name__)

# NOTE: how long `close` waits for the other ranks to exit once one is lost.
LOST_GROUP_CLOSE_S = 1.0

RankLostCallback = Callable[[int, int], None]
"""Called with a lost rank and its exit status (on the thread that noticed)."""

RANK_PRELOAD = ["pdserve.engine.parallel.worker"]
"""What the fork server imports before it forks a rank (torch with it)."""


def _rank_context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    # NOTE: only read when this process's fork server starts; not `__main__` (the default):
    # rank 0's main module may be a service's, a test runner's or a script's.
    context.set_forkserver_preload(RANK_PRELOAD)
    return context


class RankProcesses:
    """The processes of ranks 1..N-1, started by rank 0 and watched while they live.

    Each rank reads its messages from its own pipe (`pdserve.engine.parallel.messages`) and
    starts with rank 0's environment and working directory. A rank that exits before
    `close()` is lost: `lost_rank` says which, `on_rank_lost` callbacks run, and `send` raises
    from then on.

    Args:
        world_size: Ranks in the instance, rank 0 included.
    """

    def __init__(self, world_size: int) -> None:
        context = _rank_context()
        self.processes: list[BaseProcess] = []
        self._pipes: list[Connection] = []
        for rank in range(1, world_size):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(  # type: ignore[attr-defined]
                target=serve_rank,
                args=(receiver, dict(os.environ)),
                name=f"pdserve-rank-{rank}",
                # NOTE: daemonic: a rank-0 process that ends without `close()` ends its ranks
                # at exit (`close` at exit first), where multiprocessing would otherwise wait
                # for them, and they for the pipes it still holds.
                daemon=True,
            )
            process.start()
            receiver.close()
            self.processes.append(process)
            self._pipes.append(sender)
        self.lost_rank: int | None = None
        self.on_rank_lost: list[RankLostCallback] = []
        self._is_closing = False
        self._lock = threading.Lock()
        # NOTE: only the watcher joins a rank: two threads reading one exit status race.
        self._exited = [threading.Event() for _ in self.processes]
        for rank, process in enumerate(self.processes, start=1):
            threading.Thread(
                target=self._watch, args=(rank, process), name=f"tp-rank-{rank}", daemon=True
            ).start()
        atexit.register(self.close)

    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1, in rank order."""
        return [int(process.pid or 0) for process in self.processes]

    def exit_codes(self) -> list[int | None]:
        """Exit statuses of ranks 1..N-1 (None while one runs; minus the signal that ended
        one)."""
        return [
            process.exitcode if exited.is_set() else None
            for process, exited in zip(self.processes, self._exited, strict=True)
        ]

    def send(self, message: object, rank: int | None = None) -> None:
        """Sends `message` to one rank, or to every rank when `rank` is None.

        Raises:
            TensorParallelError: If a rank is lost.
        """
        self.check_alive()
        targets = self._pipes if rank is None else [self._pipes[rank - 1]]
        try:
            for pipe in targets:
                pipe.send(message)
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
        """Asks every rank to exit (closing its pipe) and kills those that do not in time (1 s at
        most once a rank is lost: a broken group has no step left to finish); called at the
        process's exit where the owner did not."""
        atexit.unregister(self.close)
        with self._lock:
            self._is_closing = True
            if self.lost_rank is not None:
                timeout_s = min(timeout_s, LOST_GROUP_CLOSE_S)
        for pipe in self._pipes:
            with contextlib.suppress(OSError):
                pipe.close()
        for process, exited in zip(self.processes, self._exited, strict=True):
            if not exited.wait(timeout_s):
                with contextlib.suppress(OSError):
                    process.kill()
                exited.wait()

    def _watch(self, rank: int, process: BaseProcess) -> None:
        process.join()
        returncode = process.exitcode
        assert returncode is not None
        self._exited[rank - 1].set()
        self.lose(rank, returncode)

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
