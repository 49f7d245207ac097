"""What the REST and gRPC front ends share: validate, tokenize, orchestrate, detokenize.

A front end turns its request into `GenerationParams`, calls `Frontend.prepare` (which raises
a typed `PdserveError` for anything wrong, before any instance is asked to work) and then
iterates `Streamer.stream` (`pdserve.gateway.streaming`), which yields `OutputDelta`s: text and
token ids as they arrive, and a last delta with the finish reason and exact usage. Preparing
(validation, tokenization, max_tokens defaults, the seed, and for tools the model's call format,
the constraint of a forced call and how the completion is read: `pdserve.gateway.tools`) is
here; running and recording a request is the streamer's.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace

import structlog

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import resolve_seed
from pdserve.gateway.fleet.instance import InstanceRole
from pdserve.gateway.fleet.model_info import ModelInfo, ModelInfoStore
from pdserve.gateway.fleet.registry import Registry
from pdserve.gateway.prepare.lengths import LengthRules
from pdserve.gateway.prepare.params import (
    GenerationParams,
    ModelSummary,
    PreparedRequest,
    PromptKind,
)
from pdserve.gateway.prepare.tokenize import is_short_prompt, tokenize_prompt
from pdserve.gateway.prepare.validation import (
    RequestLimits,
    check_constraint,
    invalid,
    validate_request,
)
from pdserve.gateway.prepare.workers import WorkerPool
from pdserve.gateway.reasoning import prompt_opens_thinking, uses_think_blocks
from pdserve.gateway.request import GenerationRequest
from pdserve.gateway.routing.router import Router
from pdserve.gateway.text import markup_skips
from pdserve.gateway.tools.formats import AUTO, ToolCallFormat, resolve_format
from pdserve.gateway.tools.plan import ToolPlan, plan_tools
from pdserve.tokenizer import Tokenizer

_tracer = telemetry.tracer("pdserve.gateway")


log = structlog.get_logger(__name__)


class Frontend:
    """Validation, tokenization and streaming of requests for every front end.

    Args:
        registry: Known instances (for model names and limits).
        router: Pair availability.
        model_infos: Tokenizers per model.
        workers: Threads for tokenization and chat templates, off the event loop.
        limits: What one request may ask for.
        default_max_tokens: max_tokens of a completion request that sets none.
        default_chat_max_tokens: max_tokens of a chat request that sets none (lowered to what
            fits in the model's length after the prompt).
        rng: Source of seeds for requests without one.
        tool_call_parser: ``--tool-call-parser``: the tool-call format of every model
            (``auto``: each model's, from its chat template).
        reasoning_parser: ``--reasoning-parser``: whether chat completions are read for
            reasoning (`pdserve.gateway.reasoning`).
    """

    def __init__(
        self,
        registry: Registry,
        router: Router,
        model_infos: ModelInfoStore,
        *,
        workers: WorkerPool,
        limits: RequestLimits,
        default_max_tokens: int = 16,
        default_chat_max_tokens: int = 1024,
        rng: random.Random | None = None,
        tool_call_parser: str = AUTO,
        reasoning_parser: str = AUTO,
    ) -> None:
        self._registry = registry
        self._router = router
        self._model_infos = model_infos
        self._workers = workers
        self._limits = limits
        self._lengths = LengthRules(router, limits, default_max_tokens, default_chat_max_tokens)
        self._rng = rng or random.SystemRandom()
        self._tool_call_parser = tool_call_parser
        self._reasoning_parser = reasoning_parser
        self.is_draining = False

    @property
    def limits(self) -> RequestLimits:
        """What one request may ask for."""
        return self._limits

    def list_models(self) -> list[ModelSummary]:
        """Models that have at least one compatible prefill/decode pair now."""
        models = []
        for name in sorted(self._registry.model_names()):
            if not self._router.has_pair(name):
                continue
            prefills = self._router.loads.candidates(InstanceRole.PREFILL, name)
            decodes = self._router.loads.candidates(InstanceRole.DECODE, name)
            is_invariant = all(entry.info.batch_invariant for entry in prefills + decodes)
            models.append(
                ModelSummary(
                    name, self._max_model_len(name), len(prefills), len(decodes), is_invariant
                )
            )
        return models

    async def tokenize(self, params: GenerationParams) -> tuple[list[int], int]:
        """The prompt's token ids as a generation request would send them (chat messages
        through the template), and the model's maximum length.

        Raises:
            PdserveError: As `prepare` for the model and the prompt.
        """
        info = await self._info(params)
        call_format = self._call_format(info.tokenizer)
        token_ids = await self._workers.run(tokenize_prompt, params, info.tokenizer, call_format)
        return token_ids, self._max_model_len(params.model, info)

    def _call_format(self, tokenizer: Tokenizer) -> ToolCallFormat:
        """The model's tool-call format (``--tool-call-parser``, or its template's)."""
        return resolve_format(self._tool_call_parser, tokenizer.chat_template)

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        """The text of `token_ids` (special tokens kept).

        Raises:
            PdserveError: MODEL_NOT_FOUND, or INVALID_REQUEST for an id outside the vocabulary.
        """
        info = await self._info(GenerationParams(model=model, kind=PromptKind.COMPLETION))
        vocab_size = info.tokenizer.vocab_size
        if any(not 0 <= t < vocab_size for t in token_ids):
            raise invalid(f"tokens must be token ids in [0, {vocab_size})", "tokens")
        return info.tokenizer.decode(token_ids, skip_special_tokens=False)

    async def _info(self, params: GenerationParams) -> ModelInfo:
        """The model's info (tokenizer, length), after the checks every request gets."""
        if params.model not in self._registry.model_names():
            raise PdserveError(
                ErrorReason.MODEL_NOT_FOUND,
                f"the model {params.model!r} does not exist",
                {"param": "model", "model": params.model},
            )
        prefill_addresses = [
            e.info.address
            for e in self._router.loads.candidates(InstanceRole.PREFILL, params.model)
        ]
        return await self._model_infos.get(params.model, prefill_addresses)

    def _max_model_len(self, model: str, info: ModelInfo | None = None) -> int:
        limits = [e.info.max_model_len for e in self._registry.alive(model_name=model)]
        if info is not None:
            limits.append(info.max_model_len)
        limits = [limit for limit in limits if limit > 0]
        return min(limits) if limits else 0

    async def prepare(
        self,
        params: GenerationParams,
        request_id: str | None = None,
        api_key_name: str | None = None,
    ) -> PreparedRequest:
        """Validates and tokenizes a request (span ``gateway.prepare``).

        Args:
            params: The request as a front end parsed it.
            request_id: The id the front end already gave the request (a new one if None).
            api_key_name: Name of the API key it authenticated with (for logs and spans).

        Raises:
            PdserveError: INVALID_REQUEST or PROMPT_TOO_LONG (400), MODEL_NOT_FOUND (404),
                NO_HEALTHY_INSTANCES when no prefill can provide the tokenizer (503),
                INSTANCE_DRAINING while the gateway shuts down (503), DEADLINE_EXCEEDED when
                tokenization does not finish within its budget (504).
        """
        arrival_time = time.monotonic()
        with _tracer.start_as_current_span("gateway.prepare") as span:
            prepared = await self._prepare(params, request_id or uuid.uuid4().hex, api_key_name)
            span.set_attribute(telemetry.REQUEST_ID, prepared.request_id)
        return replace(prepared, arrival_time=arrival_time)

    async def _prepare(
        self, params: GenerationParams, request_id: str, api_key_name: str | None
    ) -> PreparedRequest:
        if self.is_draining:
            raise PdserveError(ErrorReason.INSTANCE_DRAINING, "the gateway is shutting down")
        params = validate_request(params, self._limits)
        info = await self._info(params)
        if params.constraint is not None:
            params = await self._workers.run(check_constraint, params)
        tokenizer = info.tokenizer
        max_model_len = self._max_model_len(params.model, info)
        prompt_param = "messages" if params.messages is not None else "prompt"
        call_format = self._call_format(tokenizer)
        is_chat = params.messages is not None
        tool_plan = plan_tools(
            params.tools,
            params.tool_choice,
            call_format,
            is_chat=is_chat,
            shows_reasoning=params.shows_reasoning and self._reasoning_parser != "none",
        )
        kept = self._kept_prompt_tokens(params, max_model_len)
        if params.token_ids is not None:
            token_ids = params.token_ids if kept is None else params.token_ids[-kept:]
            # NOTE: checked before anything walks the ids (the vocabulary check below).
            self._lengths.check_prompt_length(len(token_ids), max_model_len, prompt_param)
            prompt_token_ids = list(token_ids)
        else:
            prompt_token_ids = await self._tokenize(params, tokenizer, call_format)
            if params.drops_old_messages and max_model_len:
                params, prompt_token_ids = await self._fit_messages(
                    params, prompt_token_ids, tokenizer, call_format, max_model_len
                )
        is_truncated = kept is not None and len(prompt_token_ids) > kept
        if kept is not None and is_truncated:
            prompt_token_ids = prompt_token_ids[-kept:]
        num_prompt_tokens = len(prompt_token_ids)
        self._lengths.check_prompt_length(num_prompt_tokens, max_model_len, prompt_param)
        if not prompt_token_ids:
            raise invalid("the prompt is empty", "prompt")
        vocab_size = tokenizer.vocab_size
        if params.token_ids is not None and any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise invalid(f"prompt token ids must be in [0, {vocab_size})", "prompt")
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise invalid(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
        if any(t >= vocab_size for t, _ in params.logit_bias):
            raise invalid(f"logit_bias keys must be token ids in [0, {vocab_size})", "logit_bias")
        if any(t >= vocab_size for t in params.allowed_token_ids):
            raise invalid(
                f"allowed_token_ids must be token ids in [0, {vocab_size})", "allowed_token_ids"
            )
        if any(t >= vocab_size for word in params.bad_word_ids for t in word):
            raise invalid(f"bad_words must be token ids in [0, {vocab_size})", "bad_words")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self._lengths.default_max_tokens(params, num_prompt_tokens, max_model_len)
        if max_model_len and num_prompt_tokens + max_tokens > max_model_len:
            raise PdserveError(
                ErrorReason.PROMPT_TOO_LONG,
                f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) "
                f"exceeds the model's maximum length of {max_model_len} tokens",
                {"param": params.max_tokens_name if params.max_tokens else prompt_param},
            )
        if params.n > 1:
            self._lengths.check_choices_fit(params.model, num_prompt_tokens, max_tokens, params.n)
        request = GenerationRequest(
            request_id=request_id,
            model=params.model,
            prompt_token_ids=tuple(prompt_token_ids),
            sampling=params.to_sampling_params(
                max_tokens,
                resolve_seed(params.seed, self._rng),
                _bad_word_tokens(tokenizer, params.bad_words),
            ),
            eos_token_ids=info.eos_token_ids,
        )
        return PreparedRequest(
            request,
            params.stop,
            tokenizer,
            params.client_request_id,
            params.user,
            params.kind,
            api_key_name,
            n=params.n,
            echo=params.echo,
            is_prompt_only=max_tokens == 0,
            prompt_text=None if is_truncated else params.text,
            tool_plan=tool_plan,
            reasoning_opens=self._reasoning_opens(params, tokenizer, prompt_token_ids),
            skipped_token_ids=None
            if tool_plan is None
            else markup_skips(tokenizer, tool_plan.format.markup_tokens),
            skip_special_tokens=params.skip_special_tokens,
            hidden_stop_ids=_hidden_stop_tokens(params, info.eos_token_ids, tokenizer, tool_plan),
            include_stop=params.include_stop_str_in_output,
        )

    async def _tokenize(
        self, params: GenerationParams, tokenizer: Tokenizer, call_format: ToolCallFormat
    ) -> list[int]:
        """The prompt's ids (a long one in a parser process)."""
        if is_short_prompt(params):
            return tokenize_prompt(params, tokenizer, call_format)
        return await self._workers.run(tokenize_prompt, params, tokenizer, call_format)

    async def _fit_messages(
        self,
        params: GenerationParams,
        prompt_token_ids: list[int],
        tokenizer: Tokenizer,
        call_format: ToolCallFormat,
        max_model_len: int,
    ) -> tuple[GenerationParams, list[int]]:
        """The conversation with its oldest turns dropped until the prompt leaves room for
        its reply in the model's length (`_reply_room`; the Responses API's
        ``truncation: "auto"``): the leading system messages stay, and the kept part starts
        at a user message, so roles still alternate as templates expect. The fewest turns
        are dropped (a binary search over where the kept part starts); when even the last
        user turn alone does not fit, the prompt is left whole (and refused as too long)."""
        messages = params.messages or ()
        room = self._reply_room(params, max_model_len)
        if len(prompt_token_ids) + room <= max_model_len:
            return params, prompt_token_ids
        head = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
        starts = [i for i in range(head + 1, len(messages)) if messages[i].role == "user"]
        best: tuple[GenerationParams, list[int]] | None = None
        low, high = 0, len(starts) - 1
        while low <= high:
            middle = (low + high) // 2
            kept = (*messages[:head], *messages[starts[middle] :])
            fitted = replace(params, messages=kept)
            ids = await self._tokenize(fitted, tokenizer, call_format)
            if len(ids) + room <= max_model_len:
                best, high = (fitted, ids), middle - 1
            else:
                low = middle + 1
        if best is None:
            return params, prompt_token_ids
        log.info(
            "old_messages_dropped",
            num_dropped=len(messages) - len(best[0].messages or ()),
            num_prompt_tokens=len(best[1]),
        )
        return best

    def _kept_prompt_tokens(self, params: GenerationParams, max_model_len: int) -> int | None:
        """How many of the prompt's last tokens ``truncate_prompt_tokens`` keeps (None: all):
        -1 keeps as many as leave room for ``max_tokens`` in the model's length (when it is
        unset, for the API's default, at most half the length)."""
        kept = params.truncate_prompt_tokens
        if kept != -1:
            return kept
        if not max_model_len:
            return None
        return max(1, max_model_len - self._reply_room(params, max_model_len))

    def _reply_room(self, params: GenerationParams, max_model_len: int) -> int:
        """What a prompt cut to fit leaves of the model's length: ``max_tokens``, or when it is
        unset the API's default, at most half the length."""
        if params.max_tokens is not None:
            return max(1, params.max_tokens)
        default = self._lengths.default_max_tokens(params, 0, max_model_len)
        return max(1, min(default, max_model_len // 2))

    def _reasoning_opens(
        self, params: GenerationParams, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]
    ) -> bool | None:
        """`PreparedRequest.reasoning_opens` of a request: chat completions only (the other
        APIs keep the whole text as their output)."""
        if params.messages is None or not params.shows_reasoning:
            return None
        if self._call_format(tokenizer).reads_channels:
            return None  # harmony: the format's parser reads the analysis channel
        if not uses_think_blocks(self._reasoning_parser, tokenizer.chat_template):
            return None
        tail = tokenizer.decode(prompt_token_ids[-8:], skip_special_tokens=False)
        return prompt_opens_thinking(tail)


def _hidden_stop_tokens(
    params: GenerationParams,
    eos_token_ids: Sequence[int],
    tokenizer: Tokenizer,
    tool_plan: ToolPlan | None,
) -> frozenset[int]:
    """The tokens that end a completion and whose text stays out of it (vLLM's rule; none
    with ``include_stop_str_in_output``): the stop token ids, and the end of sequence where it
    ends the completion; not a call format's markup, which its parser reads (harmony's
    ``<|call|>``)."""
    if params.include_stop_str_in_output:
        return frozenset()
    ends = () if params.ignore_eos else eos_token_ids
    markup = () if tool_plan is None else tool_plan.format.markup_tokens
    read = {tokenizer.token_to_id(token) for token in markup}
    return frozenset((*params.stop_token_ids, *ends)) - read


def _bad_word_tokens(tokenizer: Tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences of `words` as vLLM reads ``bad_words``: each word as written (its
    leading spaces dropped), and after a space where that makes a word of its own (another
    first token, the same number of tokens)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            continue
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return tuple(sequences)
