"""The thread an engine steps on, with its wake-up condition and its stop.

The prefill's and the decode's engine loops run on it, and so does the KV store's writer
(`pdserve.kv.offload`): model work and store I/O never run on the event loop.
"""

from __future__ import annotations

import abc
import threading

from pdserve.common.memory import return_freed_memory

# NOTE: how long a loop waits with nothing to do before the process hands its allocator's
# free pages back: a loaded engine is never idle that long, so a steady load never pays to
# fault them in again; a request after a pause faults in what it needs once more.
IDLE_TRIM_S = 2.0


class EngineThread(abc.ABC):
    """Base of the services' engine loops: model work never runs on the event loop.

    A subclass implements `_run`: wait on `_cond` (`_wait_for_work`) until there is work or
    `_is_stopped`, take the work under the condition, step outside it. Other threads queue work
    under `_cond` and notify it.

    Args:
        name: The thread's name (shows in stack dumps and profiles).
        lock: The lock under `_cond`, when the subclass guards more state with it.
        idle_trim_s: After work, how long the loop waits idle before the process hands its
            allocator's free pages back (`return_freed_memory`: what a burst of passes freed,
            kept by glibc for the next one); None: never.
    """

    def __init__(
        self,
        name: str,
        lock: threading.Lock | threading.RLock | None = None,
        idle_trim_s: float | None = IDLE_TRIM_S,
    ) -> None:
        self._cond = threading.Condition(lock)
        self._idle_trim_s = idle_trim_s
        self._is_trimmed = False  # trimmed, and not woken since
        self.num_idle_trims = 0
        self._is_stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Starts stepping."""
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Asks the loop to stop at its next wake-up and waits up to `timeout_s` for it.

        Returns:
            Whether it stopped: a thread still in a step after `timeout_s` runs on (a
            daemon: it does not hold up the process's exit).
        """
        with self._cond:
            self._is_stopped = True
            self._cond.notify()
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    @property
    def is_running(self) -> bool:
        """Whether the thread is still in its loop (a stop that timed out leaves it in its
        step)."""
        return self._thread.is_alive()

    def _wait_for_work(self) -> None:
        """`_cond.wait()` (the caller holds `_cond` once); an idle wait that lasts
        `idle_trim_s` hands the process's free heap pages back to the system, once until the
        loop is woken again."""
        if self._idle_trim_s is None or self._is_trimmed:
            self._cond.wait()
            self._is_trimmed = False
        elif not self._cond.wait(self._idle_trim_s):
            self._is_trimmed = True
            self.num_idle_trims += 1
            # NOTE: outside the lock: trimming a heap that a burst left with hundreds of MB
            # free takes tens of ms, and other threads queue work (and read state) under it.
            # What they queue meanwhile, the caller's condition sees when this returns.
            self._cond.release()
            try:
                self._hand_back_memory()
            finally:
                self._cond.acquire()

    def _hand_back_memory(self) -> None:
        """What an idle loop does once `idle_trim_s` passed (called without `_cond` held):
        hands the process's free heap pages back; a loop with memory of its own to hand back
        (a prefill's free KV blocks) adds it."""
        return_freed_memory()

    @abc.abstractmethod
    def _run(self) -> None:
        """The loop itself: returns once `_is_stopped` is seen."""
