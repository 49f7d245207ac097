"""What a client asks for, in the gateway's own terms.

Front ends (REST, gRPC) turn their requests into `GenerationParams`;
`pdserve.gateway.prepare.validation` checks them, and `pdserve.gateway.prepare.tokenize` turns
the prompt into token ids.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pdserve.common.generation import MAX_SEED, MAX_TOP_LOGPROBS, Constraint, SamplingParams
from pdserve.gateway.request import GenerationRequest
from pdserve.gateway.text import CompletionText, MarkupDecoder
from pdserve.gateway.tools.plan import ToolPlan
from pdserve.gateway.tools.spec import FunctionTool, ToolCall, ToolChoice
from pdserve.tokenizer import SupportsDecode, Tokenizer

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
"""OpenAI's reasoning efforts (chat's ``reasoning_effort``, Responses' ``reasoning.effort``)."""
REASONING_EFFORT = "reasoning_effort"
"""The chat template variable the effort asked for goes to: gpt-oss's template writes it into its
system message (``Reasoning: low``); a template that does not read it renders as without it."""


def effort_variables(effort: str | None) -> tuple[tuple[str, Any], ...]:
    """The template variables of a reasoning effort asked for (none where it is None)."""
    return () if effort is None else ((REASONING_EFFORT, effort),)


class PromptKind(enum.Enum):
    """Which API a request came through (decides the default max_tokens and the trace's
    ``gen_ai.operation.name``)."""

    COMPLETION = "completion"
    CHAT = "chat"


@dataclass(frozen=True)
class ChatMessage:
    """One chat message.

    Attributes:
        role: ``system``, ``user``, ``assistant`` or ``tool`` (others are refused).
        content: Its text; None: not given (allowed for an assistant message with calls).
        name: The author's name, if given.
        tool_calls: The calls an assistant message made.
        tool_call_id: The call a tool message answers.
        reasoning: The reasoning an assistant message came after, sent back with it
            (``reasoning_content``, or a Responses ``reasoning`` item); the template gets it as
            ``reasoning_content`` and ``thinking``, the names the families' templates read.
    """

    role: str
    content: str | None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning: str | None = None

    @property
    def num_chars(self) -> int:
        """Characters of its text and calls (what the prompt-size limit counts)."""
        num_chars = len(self.content or "") + len(self.name or "") + len(self.reasoning or "")
        for call in self.tool_calls:
            num_chars += len(call.id) + len(call.name) + len(call.arguments)
        return num_chars


@dataclass(frozen=True)
class GenerationParams:
    """A generation request as a front end parsed it, not yet validated.

    Exactly one of `text`, `token_ids` and `messages` is set. Unset sampling fields (None)
    take the model's defaults; `max_tokens` None takes the API's default. `max_tokens_name` is
    what the client called max_tokens (``max_completion_tokens`` in a chat request), so errors
    name the parameter it sent; `logprobs_name` and `max_logprobs` likewise name the API's
    logprobs count (``top_logprobs`` in chat) and its bound. `n` completions share the prompt;
    `echo` puts the prompt (and its logprobs) before the completion. `tools` are the
    functions a chat may call, `tool_choice` how (None: the default, ``auto`` with tools),
    `parallel_tool_calls` whether a completion may make several calls. `constraint` is what
    the completion's text must match (structured outputs, or a forced tool call),
    `constraint_name` the parameter the client set it with. `shows_reasoning`: the API has a
    place for reasoning read out of the completion (chat completions' ``reasoning_content``).
    `template_variables` go to the chat template too (``chat_template_kwargs``, e.g.
    ``enable_thinking``, and ``reasoning_effort``). `add_generation_prompt`: a chat prompt ends
    with the header of an assistant turn (the default); `continue_final_message`: it ends inside
    the last message instead (an assistant reply begun for the model to continue).
    """

    model: str
    kind: PromptKind
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    client_request_id: str | None = None
    user: str | None = None
    max_tokens_name: str = "max_tokens"
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_p: float | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    echo: bool = False
    logprobs_name: str = "logprobs"
    max_logprobs: int = MAX_TOP_LOGPROBS
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    constraint: Constraint | None = None
    constraint_name: str = "response_format"
    shows_reasoning: bool = False
    template_variables: tuple[tuple[str, Any], ...] = ()
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    drops_old_messages: bool = False

    @property
    def num_tool_chars(self) -> int:
        """Characters of the tools' names, descriptions and schemas."""
        return sum(
            len(t.name) + len(t.description or "") + len(t.parameters or "") for t in self.tools
        )

    def to_sampling_params(
        self, max_tokens: int, seed: int, bad_words: tuple[tuple[int, ...], ...] = ()
    ) -> SamplingParams:
        """The validated request's `SamplingParams`; unset fields take their defaults.

        Args:
            max_tokens: The request's own, or the API's default (0: score the prompt only,
                which still samples one token, never shown).
            seed: The request's own, or one drawn for it.
            bad_words: `bad_words` tokenized (`bad_word_ids` are added to them).
        """
        unset = SamplingParams(max_tokens=max(1, max_tokens))

        def chosen(value: float | None, default: float) -> float:
            return default if value is None else value

        return SamplingParams(
            temperature=chosen(self.temperature, unset.temperature),
            top_k=unset.top_k if self.top_k is None else self.top_k,
            top_p=chosen(self.top_p, unset.top_p),
            seed=seed,
            max_tokens=max(1, max_tokens),
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            presence_penalty=chosen(self.presence_penalty, unset.presence_penalty),
            frequency_penalty=chosen(self.frequency_penalty, unset.frequency_penalty),
            repetition_penalty=chosen(self.repetition_penalty, unset.repetition_penalty),
            logit_bias=self.logit_bias,
            min_tokens=self.min_tokens,
            min_p=chosen(self.min_p, unset.min_p),
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            constraint=self.constraint,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=tuple(dict.fromkeys((*bad_words, *self.bad_word_ids))),
        )


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request, ready to stream.

    Attributes:
        arrival_time: When the gateway started preparing it, ``time.monotonic()``.
        n: Completions asked for; `choices` makes one request of each.
        echo: The response starts with the prompt.
        is_prompt_only: max_tokens was 0: the prompt is scored (one token is sampled to
            finish the prefill, and never shown).
        prompt_text: The prompt as the client wrote it (a text prompt; echo shows it).
        tool_plan: How tool calls are read from each completion; None: they are not.
        reasoning_opens: How reasoning is read from each completion
            (`pdserve.gateway.reasoning`): True when the prompt ends inside a think block,
            False when only a completion that starts one has any; None: it is not read.
        skipped_token_ids: The special tokens left out of the completion's text when its
            parser reads others (a format's markup, `tool_plan.format.markup_tokens`);
            None: every special token is.
        skip_special_tokens: Special tokens are left out of the text (as `skipped_token_ids`
            says); False: every one is in it but `hidden_stop_ids`.
        hidden_stop_ids: The tokens that end the completion (an end of sequence, a stop token
            id) whose text is left out of it, as vLLM leaves them out; empty with
            ``include_stop_str_in_output``.
        include_stop: A completed stop string, and a stop token's text, end the text.
    """

    request: GenerationRequest
    stop: tuple[str, ...]
    tokenizer: Tokenizer
    client_request_id: str | None = None
    user: str | None = None
    kind: PromptKind = PromptKind.COMPLETION
    api_key_name: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    n: int = 1
    echo: bool = False
    is_prompt_only: bool = False
    prompt_text: str | None = None
    tool_plan: ToolPlan | None = None
    reasoning_opens: bool | None = None
    skipped_token_ids: frozenset[int] | None = None
    skip_special_tokens: bool = True
    hidden_stop_ids: frozenset[int] = frozenset()
    include_stop: bool = False

    @functools.cached_property
    def _left_out(self) -> frozenset[int]:
        """The tokens whose text is never in a completion's text: the special ones that are
        skipped (all of them, or all but a format's markup; none without
        `skip_special_tokens`) and `hidden_stop_ids`."""
        if not self.skip_special_tokens:
            skipped: frozenset[int] = frozenset()
        elif self.skipped_token_ids is not None:
            skipped = self.skipped_token_ids
        else:
            skipped = self.tokenizer.special_token_ids
        return skipped | self.hidden_stop_ids

    def completion_text(self) -> CompletionText:
        """A detokenizer for one of its completions, with its stop strings: the tokenizer's
        own decode where that leaves out exactly the special tokens, else one that leaves out
        `_left_out` and keeps the other special tokens."""
        left_out = self._left_out
        decoder: SupportsDecode = self.tokenizer
        if left_out != self.tokenizer.special_token_ids:
            decoder = MarkupDecoder(self.tokenizer, left_out)
        return CompletionText(
            decoder, self.request.prompt_token_ids, self.stop, include_stop=self.include_stop
        )

    def leaves_out(self, token_id: int) -> bool:
        """Whether a token's text is never in the completion's text: its logprob entry is
        left out too."""
        return token_id in self._left_out

    def choices(self) -> list[PreparedRequest]:
        """One request per completion: choice i has request id ``<id>-<i>`` (unless n is 1)
        and seed ``seed + i``, so each choice has its own reproducible random stream; all of
        them one share key (`share_key`), so a decode holds their prompt's KV once."""
        if self.n == 1:
            return [self]
        request = self.request
        seed = request.sampling.seed or 0
        key = share_key(request.request_id, request.prompt_token_ids)
        return [
            replace(
                self,
                request=replace(
                    request,
                    request_id=f"{request.request_id}-{index}",
                    sampling=replace(request.sampling, seed=(seed + index) % MAX_SEED),
                    share_key=key,
                ),
            )
            for index in range(self.n)
        ]

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids


def share_key(request_id: str, prompt_token_ids: Sequence[int]) -> str:
    """The share key of the completions of one prompt: the request's id and a digest of the
    prompt (a client may reuse a request id; the decode checks the tokens in any case)."""
    digest = hashlib.sha256(array("I", prompt_token_ids).tobytes()).hexdigest()
    return f"{request_id}:{digest[:16]}"


@dataclass(frozen=True)
class ModelSummary:
    """A served model with at least one compatible prefill/decode pair."""

    name: str
    max_model_len: int
    num_prefill_instances: int
    num_decode_instances: int
    batch_invariant: bool = False
    """Whether every instance serving it runs batch-invariant numerics (``--deterministic``)."""
