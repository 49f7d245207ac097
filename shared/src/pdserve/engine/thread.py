"""The thread an engine steps on, with its wake-up condition and its stop.

The prefill's and the decode's engine loops run on it, and so does the KV store's writer
(`pdserve.kv.offload`): model work and store I/O never run on the event loop.
"""

from __future__ import annotations

import abc
import threading


class EngineThread(abc.ABC):
    """Base of the services' engine loops: model work never runs on the event loop.

    A subclass implements `_run`: wait on `_cond` until there is work or `_is_stopped`, take
    the work under the condition, step outside it. Other threads queue work under `_cond` and
    notify it.

    Args:
        name: The thread's name (shows in stack dumps and profiles).
        lock: The lock under `_cond`, when the subclass guards more state with it.
    """

    def __init__(self, name: str, lock: threading.Lock | threading.RLock | None = None) -> None:
        self._cond = threading.Condition(lock)
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

    @abc.abstractmethod
    def _run(self) -> None:
        """The loop itself: returns once `_is_stopped` is seen."""
