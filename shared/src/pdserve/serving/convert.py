"""The one mapping between pdserve.v1's common messages and the plain types every service
shares: `SamplingParams` and `FinishReason` (`pdserve.common.generation`), `KvLayout`,
`Protocol`.

No torch is imported here (the engine's cache layout only as a type), so the gateway converts
with these functions too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import (
    MAX_SEED,
    Constraint,
    ConstraintKind,
    FinishReason,
    SamplingParams,
    TokenLogprobs,
)
from pdserve.common.protocol import FEATURES, PROTOCOL_VERSION, kv_layout_fingerprint
from pdserve.v1 import common_pb2

if TYPE_CHECKING:
    from pdserve.engine.kv_cache import KVCacheLayout

_KV_DTYPES = {
    "float32": common_pb2.KV_DTYPE_FLOAT32,
    "float16": common_pb2.KV_DTYPE_FLOAT16,
    "bfloat16": common_pb2.KV_DTYPE_BFLOAT16,
}
_FINISH_REASONS = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.TOOL_CALLS: common_pb2.FINISH_REASON_TOOL_CALLS,
}
_FINISH_REASONS_FROM_PROTO: dict[int, FinishReason] = {v: k for k, v in _FINISH_REASONS.items()}


def local_protocol() -> common_pb2.Protocol:
    """This implementation's Protocol message."""
    return common_pb2.Protocol(version=PROTOCOL_VERSION, features=list(FEATURES))


def kv_layout_to_proto(layout: KVCacheLayout, model_id: str) -> common_pb2.KvLayout:
    """The KvLayout message (with its fingerprint) of an engine cache layout."""
    dtype = _KV_DTYPES[layout.dtype]
    return common_pb2.KvLayout(
        model_id=model_id,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=dtype,
        block_size=layout.block_size,
        fingerprint=kv_layout_fingerprint(
            model_id,
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
            common_pb2.KvDtype.Name(dtype),
            layout.block_size,
        ),
    )


def sampling_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """`SamplingParams` from the contract's message, validated (unset fields take the
    contract's defaults).

    Raises:
        PdserveError: INVALID_REQUEST for out-of-range values.
    """
    seed = message.seed if message.HasField("seed") else None
    try:
        return SamplingParams(
            temperature=message.temperature if message.HasField("temperature") else 1.0,
            top_k=message.top_k if message.HasField("top_k") else 0,
            top_p=message.top_p if message.HasField("top_p") else 1.0,
            # NOTE: the contract allows any uint64; the engine's generator takes 63 bits.
            seed=None if seed is None else seed % MAX_SEED,
            max_tokens=message.max_tokens,
            stop_token_ids=tuple(message.stop_token_ids),
            ignore_eos=message.ignore_eos,
            presence_penalty=_optional(message, "presence_penalty", 0.0),
            frequency_penalty=_optional(message, "frequency_penalty", 0.0),
            repetition_penalty=_optional(message, "repetition_penalty", 1.0),
            logit_bias=tuple(message.logit_bias.items()),
            min_tokens=message.min_tokens,
            min_p=_optional(message, "min_p", 0.0),
            logprobs=message.logprobs if message.HasField("logprobs") else None,
            prompt_logprobs=(
                message.prompt_logprobs if message.HasField("prompt_logprobs") else None
            ),
            constraint=(
                constraint_from_proto(message.constraint)
                if message.HasField("constraint")
                else None
            ),
            allowed_token_ids=tuple(message.allowed_token_ids),
            bad_words=tuple(tuple(word.token_ids) for word in message.bad_words),
        )
    except ValueError as error:
        raise PdserveError(ErrorReason.INVALID_REQUEST, str(error)) from None


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The contract's SamplingParams message of `params` (an unset seed stays unset)."""
    message = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens,
        allowed_token_ids=list(params.allowed_token_ids),
        bad_words=[common_pb2.TokenSequence(token_ids=word) for word in params.bad_words],
    )
    if params.seed is not None:
        message.seed = params.seed
    # NOTE: neutral values stay unset, so a 1.4 peer sees the message it always saw.
    if params.presence_penalty:
        message.presence_penalty = params.presence_penalty
    if params.frequency_penalty:
        message.frequency_penalty = params.frequency_penalty
    if params.repetition_penalty != 1.0:
        message.repetition_penalty = params.repetition_penalty
    if params.min_p:
        message.min_p = params.min_p
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        message.prompt_logprobs = params.prompt_logprobs
    if params.constraint is not None:
        message.constraint.CopyFrom(constraint_to_proto(params.constraint))
    return message


def constraint_to_proto(constraint: Constraint) -> common_pb2.Constraint:
    """The contract's Constraint message of `constraint`."""
    kind = constraint.kind
    if kind is ConstraintKind.JSON_OBJECT:
        return common_pb2.Constraint(json_object=True)
    if kind is ConstraintKind.CHOICE:
        return common_pb2.Constraint(choice=common_pb2.ChoiceList(values=constraint.choices))
    message = common_pb2.Constraint()
    setattr(message, kind.value, constraint.value)  # json_schema, regex or grammar
    return message


def constraint_from_proto(message: common_pb2.Constraint) -> Constraint:
    """`Constraint` of the contract's message.

    Raises:
        ValueError: If no kind is set, or the value does not suit it.
    """
    kind = message.WhichOneof("kind")
    if kind is None:
        raise ValueError(
            "a constraint needs one of json_schema, json_object, regex, choice, grammar"
        )
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT)
    if kind == "choice":
        return Constraint(ConstraintKind.CHOICE, choices=tuple(message.choice.values))
    return Constraint(ConstraintKind(kind), getattr(message, kind))


def _optional(message: common_pb2.SamplingParams, name: str, default: float) -> float:
    """An optional float field's value, or `default` when unset."""
    return float(getattr(message, name)) if message.HasField(name) else default


def logprobs_to_proto(logprobs: TokenLogprobs) -> common_pb2.TokenLogprobs:
    """The contract's TokenLogprobs message of `logprobs`."""
    return common_pb2.TokenLogprobs(
        logprob=logprobs.logprob,
        top_token_ids=[token_id for token_id, _ in logprobs.top],
        top_logprobs=[value for _, value in logprobs.top],
    )


def logprobs_from_proto(message: common_pb2.TokenLogprobs) -> TokenLogprobs:
    """`TokenLogprobs` of the contract's message."""
    return TokenLogprobs(
        message.logprob,
        tuple(zip(message.top_token_ids, message.top_logprobs, strict=False)),
    )


def finish_reason_to_proto(reason: FinishReason) -> common_pb2.FinishReason:
    """The contract's FinishReason value of `reason`.

    Raises:
        ValueError: For ABORT, which the contract does not carry.
    """
    value = _FINISH_REASONS.get(reason)
    if value is None:
        raise ValueError(f"{reason} has no FinishReason in the contract")
    return value


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """`FinishReason` of the contract's value; None for UNSPECIFIED or an unknown value."""
    return _FINISH_REASONS_FROM_PROTO.get(value)
