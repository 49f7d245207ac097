"""Per-request sampling settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    Attributes:
        temperature: 0 means greedy; otherwise logits are divided by it before sampling.
        top_k: Keep the k most likely tokens; 0 disables.
        top_p: Keep the smallest set of tokens whose probability reaches top_p; 1.0 disables.
        seed: Makes sampling reproducible: the token at completion index i is a pure function of
            (seed, i, logits). Requests without a seed get one drawn when they are added.
        max_tokens: Most tokens to generate (counting tokens generated before a resume).
        stop_token_ids: Token ids that end the request (the id is included in the output).
        ignore_eos: Keep generating past the model's end-of-sequence ids.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        # NOTE: accept lists from callers but keep the frozen value hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature == 0.0 or self.top_k == 1
