"""A model runner whose forward passes wait for a gate: an engine held busy at a known point."""

from __future__ import annotations

import threading


class HeldRunner:
    """Delegates to `runner`; every `execute` waits until `gate` is set.

    Set it in place of an engine loop's runner (``loop.runner``) to keep the requests it holds
    from progressing while a test looks at what waits behind them. The wait is bounded, so a
    failed test cannot leave the engine thread stuck.
    """

    def __init__(self, runner: object, gate: threading.Event, timeout_s: float = 120.0) -> None:
        self._runner = runner
        self.gate = gate
        self.timeout_s = timeout_s

    def __getattr__(self, name: str) -> object:
        return getattr(self._runner, name)

    def execute(self, *args: object, **kwargs: object) -> object:
        self.gate.wait(timeout=self.timeout_s)
        return self._runner.execute(*args, **kwargs)  # type: ignore[attr-defined]
