"""What the REST and gRPC front ends share: validate, tokenize, orchestrate, detokenize.

A front end turns its request into `GenerationParams`, calls `Frontend.prepare` (which raises
a typed `PdserveError` for anything wrong, before any instance is asked to work) and then
iterates `Frontend.stream`, which yields `OutputDelta`s: text and token ids as they arrive, and
a last delta with the finish reason and exact usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncGenerator

import structlog
from opentelemetry import trace
from opentelemetry.context import Context

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import FinishReason, resolve_seed
from pdserve.gateway.instance import InstanceRole
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.model_info import ModelInfo, ModelInfoStore
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.gateway.params import (
    GenerationParams,
    ModelSummary,
    OutputDelta,
    PreparedRequest,
    PromptKind,
    tokenize_prompt,
)
from pdserve.gateway.registry import Registry
from pdserve.gateway.request import GenerationEnd, GenerationRequest, Usage
from pdserve.gateway.router import Router
from pdserve.gateway.text import CompletionText
from pdserve.gateway.validation import RequestLimits, invalid, validate_request
from pdserve.gateway.workers import WorkerPool

log = structlog.get_logger("pdserve.gateway.frontend")
_tracer = telemetry.tracer("pdserve.gateway")


class Frontend:
    """Validation, tokenization and streaming of requests for every front end.

    Args:
        registry: Known instances (for model names and limits).
        router: Pair availability.
        model_infos: Tokenizers per model.
        orchestrator: Runs requests.
        metrics: Outcome counters.
        workers: Threads for tokenization and chat templates, off the event loop.
        limits: What one request may ask for.
        default_max_tokens: max_tokens of a completion request that sets none.
        default_chat_max_tokens: max_tokens of a chat request that sets none (lowered to what
            fits in the model's length after the prompt).
        request_timeout_s: Bound of one request, retries included.
        rng: Source of seeds for requests without one.
    """

    def __init__(
        self,
        registry: Registry,
        router: Router,
        model_infos: ModelInfoStore,
        orchestrator: Orchestrator,
        metrics: GatewayMetrics,
        *,
        workers: WorkerPool,
        limits: RequestLimits,
        default_max_tokens: int = 16,
        default_chat_max_tokens: int = 1024,
        request_timeout_s: float = 600.0,
        rng: random.Random | None = None,
    ) -> None:
        self._registry = registry
        self._router = router
        self._model_infos = model_infos
        self._orchestrator = orchestrator
        self._metrics = metrics
        self._workers = workers
        self._limits = limits
        self._default_max_tokens = default_max_tokens
        self._default_chat_max_tokens = default_chat_max_tokens
        self._request_timeout_s = request_timeout_s
        self._rng = rng or random.SystemRandom()
        self._num_active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.is_draining = False

    @property
    def limits(self) -> RequestLimits:
        """What one request may ask for."""
        return self._limits

    @property
    def num_active_requests(self) -> int:
        """Requests streaming right now."""
        return self._num_active

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no request is streaming; returns False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def list_models(self) -> list[ModelSummary]:
        """Models that have at least one compatible prefill/decode pair now."""
        models = []
        for name in sorted(self._registry.model_names()):
            if not self._router.has_pair(name):
                continue
            prefills = self._router.candidates(InstanceRole.PREFILL, name)
            decodes = self._router.candidates(InstanceRole.DECODE, name)
            models.append(
                ModelSummary(name, self._max_model_len(name), len(prefills), len(decodes))
            )
        return models

    def _max_model_len(self, model: str, info: ModelInfo | None = None) -> int:
        limits = [e.info.max_model_len for e in self._registry.alive(model_name=model)]
        if info is not None:
            limits.append(info.max_model_len)
        limits = [limit for limit in limits if limit > 0]
        return min(limits) if limits else 0

    async def prepare(
        self, params: GenerationParams, request_id: str | None = None
    ) -> PreparedRequest:
        """Validates and tokenizes a request (span ``gateway.prepare``).

        Args:
            params: The request as a front end parsed it.
            request_id: The id the front end already gave the request (a new one if None).

        Raises:
            PdserveError: INVALID_REQUEST or PROMPT_TOO_LONG (400), MODEL_NOT_FOUND (404),
                NO_HEALTHY_INSTANCES when no prefill can provide the tokenizer (503),
                INSTANCE_DRAINING while the gateway shuts down (503), DEADLINE_EXCEEDED when
                tokenization does not finish within its budget (504).
        """
        with _tracer.start_as_current_span("gateway.prepare") as span:
            prepared = await self._prepare(params, request_id or uuid.uuid4().hex)
            span.set_attribute(telemetry.REQUEST_ID, prepared.request_id)
        return prepared

    async def _prepare(self, params: GenerationParams, request_id: str) -> PreparedRequest:
        if self.is_draining:
            raise PdserveError(ErrorReason.INSTANCE_DRAINING, "the gateway is shutting down")
        params = validate_request(params, self._limits)
        if params.model not in self._registry.model_names():
            raise PdserveError(
                ErrorReason.MODEL_NOT_FOUND,
                f"the model {params.model!r} does not exist",
                {"param": "model", "model": params.model},
            )
        prefill_addresses = [
            e.info.address for e in self._router.candidates(InstanceRole.PREFILL, params.model)
        ]
        info = await self._model_infos.get(params.model, prefill_addresses)
        tokenizer = info.tokenizer
        max_model_len = self._max_model_len(params.model, info)
        prompt_param = "messages" if params.messages is not None else "prompt"
        if params.token_ids is not None:
            # NOTE: checked before anything walks the ids (the vocabulary check below).
            self._check_prompt_length(len(params.token_ids), max_model_len, prompt_param)
            prompt_token_ids = list(params.token_ids)
        else:
            prompt_token_ids = await self._workers.run(tokenize_prompt, params, tokenizer)
        num_prompt_tokens = len(prompt_token_ids)
        self._check_prompt_length(num_prompt_tokens, max_model_len, prompt_param)
        if not prompt_token_ids:
            raise invalid("the prompt is empty", "prompt")
        vocab_size = tokenizer.vocab_size
        if params.token_ids is not None and any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise invalid(f"prompt token ids must be in [0, {vocab_size})", "prompt")
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise invalid(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self._default_max_tokens_for(params.kind, num_prompt_tokens, max_model_len)
        if max_model_len and num_prompt_tokens + max_tokens > max_model_len:
            raise PdserveError(
                ErrorReason.PROMPT_TOO_LONG,
                f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) "
                f"exceeds the model's maximum length of {max_model_len} tokens",
                {"param": params.max_tokens_name if params.max_tokens else prompt_param},
            )
        request = GenerationRequest(
            request_id=request_id,
            model=params.model,
            prompt_token_ids=tuple(prompt_token_ids),
            sampling=params.to_sampling_params(max_tokens, resolve_seed(params.seed, self._rng)),
            eos_token_ids=info.eos_token_ids,
        )
        return PreparedRequest(
            request, params.stop, tokenizer, params.client_request_id, params.user, params.kind
        )

    def _check_prompt_length(self, num_tokens: int, max_model_len: int, param: str) -> None:
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

    def _default_max_tokens_for(
        self, kind: PromptKind, num_prompt_tokens: int, max_model_len: int
    ) -> int:
        """max_tokens of a request that sets none.

        Completions take --default-max-tokens (OpenAI's 16). Chat follows the OpenAI
        convention of "as much as fits", but capped: --default-chat-max-tokens, lowered to what
        fits after the prompt. Both stay within --max-tokens-limit.
        """
        if kind is PromptKind.CHAT:
            max_tokens = self._default_chat_max_tokens
            if max_model_len:
                max_tokens = min(max_tokens, max_model_len - num_prompt_tokens)
        else:
            max_tokens = self._default_max_tokens
        if self._limits.max_tokens_limit:
            max_tokens = min(max_tokens, self._limits.max_tokens_limit)
        return max_tokens

    async def stream(
        self, prepared: PreparedRequest, trace_context: Context | None = None
    ) -> AsyncGenerator[OutputDelta, None]:
        """Runs a prepared request.

        Args:
            prepared: From `prepare`.
            trace_context: Parent of the request's span (default: the current context, i.e.
                the front end's server span: HTTP or gRPC).

        Yields:
            Deltas of text and tokens; the last one has finish_reason and usage.

        Raises:
            PdserveError: The error that ended the request.
        """
        request = prepared.request
        loop = asyncio.get_running_loop()
        started = loop.time()
        text = CompletionText(prepared.tokenizer, request.prompt_token_ids, prepared.stop)
        end: GenerationEnd | None = None
        outcome = "cancelled"
        self._num_active += 1
        self._idle.clear()
        span = _tracer.start_span(
            "gateway.request", context=trace_context, attributes=_request_attributes(prepared)
        )
        trace_ids = telemetry.trace_fields(span)
        last_token_at: float | None = None
        try:
            events = self._orchestrator.run(request, started + self._request_timeout_s, span)
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, GenerationEnd):
                        end = event
                        break
                    now = loop.time()
                    if last_token_at is None:
                        self._metrics.ttft.observe(now - started)
                    elif event.token_ids:
                        gap = (now - last_token_at) / len(event.token_ids)
                        for _ in event.token_ids:
                            self._metrics.inter_token_latency.observe(gap)
                    last_token_at = now
                    step = text.add(event.token_ids)
                    if step.text or step.token_ids:
                        yield OutputDelta(step.text, step.token_ids, event.first_index)
                    if step.is_stopped:
                        break
            finish_reason = (
                FinishReason.STOP if text.is_stopped or end is None else end.finish_reason
            )
            usage = Usage(
                num_prompt_tokens=len(request.prompt_token_ids),
                num_completion_tokens=text.num_tokens,
                num_cached_prompt_tokens=end.num_cached_prompt_tokens if end else 0,
            )
            final = OutputDelta(text.finish(), (), text.num_tokens, finish_reason, usage)
            outcome = "finished"
            span.set_attributes(
                {
                    "gen_ai.response.model": request.model,
                    "gen_ai.usage.output_tokens": usage.num_completion_tokens,
                    "gen_ai.response.finish_reasons": [finish_reason.value],
                }
            )
            self._metrics.e2e_latency.observe(loop.time() - started)
            log.info(
                "request_finished",
                **trace_ids,
                request_id=request.request_id,
                client_request_id=prepared.client_request_id,
                user=prepared.user,
                model=request.model,
                finish_reason=finish_reason.value,
                is_stop_string=text.is_stopped,
                num_prompt_tokens=usage.num_prompt_tokens,
                num_completion_tokens=usage.num_completion_tokens,
                num_attempts=end.num_attempts if end else None,
                num_reschedules=end.num_reschedules if end else None,
                duration_s=round(loop.time() - started, 4),
            )
            yield final
        except PdserveError as error:
            outcome = error.reason.name
            span.set_status(trace.Status(trace.StatusCode.ERROR, error.reason.name))
            span.set_attribute("pdserve.error.reason", error.reason.name)
            log.warning(
                "request_failed",
                **trace_ids,
                request_id=request.request_id,
                client_request_id=prepared.client_request_id,
                model=request.model,
                reason=error.reason.name,
                message=error.message,
                num_completion_tokens=text.num_tokens,
                duration_s=round(loop.time() - started, 4),
            )
            raise
        finally:
            if outcome == "cancelled":
                span.add_event("cancelled")
                log.info(
                    "request_cancelled",
                    **trace_ids,
                    request_id=request.request_id,
                    client_request_id=prepared.client_request_id,
                    num_completion_tokens=text.num_tokens,
                    duration_s=round(loop.time() - started, 4),
                )
            self._metrics.requests.labels(outcome=outcome).inc()
            span.end()
            self._num_active -= 1
            if self._num_active == 0:
                self._idle.set()


def _request_attributes(prepared: PreparedRequest) -> dict[str, str | int | float | list[str]]:
    """The request span's attributes known up front (OpenTelemetry GenAI conventions)."""
    request = prepared.request
    sampling = request.sampling
    attributes: dict[str, str | int | float | list[str]] = {
        telemetry.REQUEST_ID: request.request_id,
        "gen_ai.operation.name": "chat" if prepared.kind is PromptKind.CHAT else "text_completion",
        "gen_ai.request.model": request.model,
        "gen_ai.request.max_tokens": sampling.max_tokens,
        "gen_ai.request.seed": resolve_seed(sampling.seed),
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
        "gen_ai.request.top_k": sampling.top_k,
        "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
    }
    if prepared.stop:
        attributes["gen_ai.request.stop_sequences"] = list(prepared.stop)
    return attributes
