"""How long a request may be and how long its completion is by default: the prompt within
``--max-prompt-tokens`` and the model's length, the ``n`` completions of a request together on
one decode, and the default ``max_tokens`` of completions and chat."""

from __future__ import annotations

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.fleet.instance import InstanceRole
from pdserve.gateway.prepare.params import GenerationParams, PromptKind
from pdserve.gateway.prepare.validation import RequestLimits, invalid
from pdserve.gateway.routing.router import Router
from pdserve.gateway.routing.share_affinity import choices_blocks, max_choice_tokens


class LengthRules:
    """The length rules of one gateway.

    Args:
        router: The decodes' pool sizes.
        limits: What one request may ask for.
        default_max_tokens: max_tokens of a completion request that sets none.
        default_chat_max_tokens: max_tokens of a chat request that sets none.
    """

    def __init__(
        self,
        router: Router,
        limits: RequestLimits,
        default_max_tokens: int,
        default_chat_max_tokens: int,
    ) -> None:
        self._router = router
        self._limits = limits
        self._default_max_tokens = default_max_tokens
        self._default_chat_max_tokens = default_chat_max_tokens

    def check_prompt_length(self, num_tokens: int, max_model_len: int, param: str) -> None:
        """PROMPT_TOO_LONG past --max-prompt-tokens, or when no token is left to generate."""
        limit = self._limits.max_prompt_tokens
        if num_tokens > limit:
            raise PdserveError(
                ErrorReason.PROMPT_TOO_LONG,
                f"the prompt has {num_tokens} tokens; at most {limit} are accepted",
                {"param": param},
            )
        if max_model_len and num_tokens >= max_model_len:
            raise PdserveError(
                ErrorReason.PROMPT_TOO_LONG,
                f"the prompt ({num_tokens} tokens) leaves no room to generate within the "
                f"model's maximum length of {max_model_len} tokens",
                {"param": param},
            )

    def check_choices_fit(
        self, model: str, num_prompt_tokens: int, max_tokens: int, n: int
    ) -> None:
        """INVALID_REQUEST naming ``n`` when no decode could hold the `n` completions together
        (`choices_blocks`: the prompt once, `max_tokens` each), even idle; decodes that report
        no pool are taken at their word."""
        sizes = self._decode_sizes(model)
        if not sizes:
            return
        needs = [choices_blocks(num_prompt_tokens, max_tokens, n, bs) for _, bs in sizes]
        if any(need <= total for need, (total, _) in zip(needs, sizes, strict=True)):
            return
        at = max(range(len(sizes)), key=lambda i: sizes[i][0])
        raise invalid(
            f"n ({n}) completions of up to {max_tokens} tokens each need {needs[at]} KV blocks "
            f"on one decode (the prompt's full blocks held once); the largest decode of model "
            f"{model!r} has {sizes[at][0]}",
            "n",
        )

    def _decode_sizes(self, model: str) -> list[tuple[int, int]]:
        """(total blocks, block size) of each decode of `model`; empty when none is known or
        one reports no pool (taken at its word: anything may fit)."""
        decodes = self._router.loads.candidates(InstanceRole.DECODE, model)
        sizes = [(e.load.num_total_blocks, e.info.kv_layout.block_size) for e in decodes]
        return [] if any(total == 0 for total, _ in sizes) else sizes

    def default_max_tokens(
        self, params: GenerationParams, num_prompt_tokens: int, max_model_len: int
    ) -> int:
        """max_tokens of a request that sets none.

        Completions take --default-max-tokens (OpenAI's 16). Chat follows the OpenAI
        convention of "as much as fits", but capped: --default-chat-max-tokens, lowered to what
        fits after the prompt, and with ``n`` > 1 to what lets the n completions fit on one
        decode together. Both stay within --max-tokens-limit.
        """
        if params.kind is PromptKind.CHAT:
            max_tokens = self._default_chat_max_tokens
            if max_model_len:
                max_tokens = min(max_tokens, max_model_len - num_prompt_tokens)
            sizes = self._decode_sizes(params.model) if params.n > 1 else []
            fits = max(
                (max_choice_tokens(num_prompt_tokens, params.n, t, bs) for t, bs in sizes),
                default=0,
            )
            if fits > 0:
                max_tokens = min(max_tokens, fits)
        else:
            max_tokens = self._default_max_tokens
        if self._limits.max_tokens_limit:
            max_tokens = min(max_tokens, self._limits.max_tokens_limit)
        return max_tokens
