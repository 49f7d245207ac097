"""How a step is captured and replayed: a CUDA graph on a GPU, or a stand-in that calls the step
again (CPU tests, which thereby run exactly the buffer bookkeeping of the CUDA path)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

Step = Callable[[], None]
"""A step that reads only the static buffers and writes its result into them."""


class CaptureBackend(Protocol):
    """Records a step once and returns what replays it."""

    def capture(self, step: Step) -> Step:
        """Records `step` (which may run it) and returns its replay."""
        ...

    def memory_bytes(self) -> int:
        """Device memory the captures took so far (0 where nothing is measured)."""
        ...


class StandInCapture:
    """Runs the step once at capture and again at each replay, on the same buffers.

    Attributes:
        num_captures: Steps captured.
        num_replays: Replays so far.
    """

    def __init__(self) -> None:
        self.num_captures = 0
        self.num_replays = 0

    def capture(self, step: Step) -> Step:
        step()
        self.num_captures += 1

        def replay() -> None:
            self.num_replays += 1
            step()

        return replay

    def memory_bytes(self) -> int:
        return 0


class CudaGraphCapture:  # pragma: no cover - needs CUDA
    """Captures each step into a `torch.cuda.CUDAGraph`; every graph shares one memory pool
    (capture the largest batch first: the smaller ones then fit in what it took).

    Args:
        device: The CUDA device the model runs on.
        num_warmups: Eager runs before each capture (kernel selection and workspaces happen
            there, not in the graph).
    """

    def __init__(self, device: torch.device, num_warmups: int = 2) -> None:
        self.device = device
        self.num_warmups = num_warmups
        self.graphs: list[Any] = []
        self._pool: Any = None
        torch.cuda.synchronize(device)
        self._free_before = torch.cuda.mem_get_info(device)[0]

    def capture(self, step: Step) -> Step:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(self.num_warmups):
                step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step()
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs.append(graph)
        return graph.replay

    def memory_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        return max(0, self._free_before - torch.cuda.mem_get_info(self.device)[0])


def default_capture(device: torch.device) -> CaptureBackend:
    """CUDA graphs on a CUDA device, the stand-in elsewhere."""
    if device.type == "cuda":  # pragma: no cover - needs CUDA
        return CudaGraphCapture(device)
    return StandInCapture()
