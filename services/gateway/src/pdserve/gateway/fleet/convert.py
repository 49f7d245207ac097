"""The gateway's translation between the instances' pdserve.v1 messages (registration, status,
model info, Prefill and Generate streams) and its plain dataclasses.

The registry's servicer and watcher and the gRPC clients call these functions at the edge; the
registry, router, orchestrator and text handling never see a protobuf message (the public
GenerationService's messages convert in `pdserve.gateway.grpc_api.convert`). Sampling
settings, finish reasons and the Protocol message convert with the services' shared functions
(`pdserve.serving.convert`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.fleet.backend import (
    DecodeEvent,
    FinishedEvent,
    FirstTokenEvent,
    HandedOffEvent,
    PreemptionEvent,
    PrefillCall,
    PrefillEvent,
    PrefillPhases,
    TokenBatchEvent,
)
from pdserve.gateway.fleet.instance import InstanceInfo, InstanceRole, KvLayout, LoadReport
from pdserve.gateway.fleet.model_info import ModelFiles
from pdserve.serving.convert import (
    finish_reason_from_proto,
    local_protocol,
    logprobs_from_proto,
    sampling_to_proto,
)
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    instance_pb2,
    prefill_pb2,
    registry_pb2,
)

_ROLES = {
    common_pb2.INSTANCE_ROLE_PREFILL: InstanceRole.PREFILL,
    common_pb2.INSTANCE_ROLE_DECODE: InstanceRole.DECODE,
}

_T = TypeVar("_T")

# Instances -------------------------------------------------------------------------------------


def _same_named(cls: type[_T], message: Message, **converted: Any) -> _T:
    """The dataclass `cls` made of `message`'s fields of the same names, except those
    `converted` gives (a field the message lacks fails here, in every test that converts)."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    names = [field.name for field in fields if field.name not in converted]
    return cls(**{name: getattr(message, name) for name in names}, **converted)


def kv_layout_from_pb(message: common_pb2.KvLayout) -> KvLayout:
    """KvLayout message -> `KvLayout`."""
    return _same_named(KvLayout, message, dtype=common_pb2.KvDtype.Name(message.dtype))


def instance_info_from_pb(message: common_pb2.InstanceInfo) -> InstanceInfo:
    """InstanceInfo message -> `InstanceInfo`.

    Raises:
        PdserveError: INVALID_REQUEST when the role is unset.
    """
    role = _ROLES.get(message.role)
    if role is None:
        raise PdserveError(
            ErrorReason.INVALID_REQUEST,
            "instance.role must be INSTANCE_ROLE_PREFILL or INSTANCE_ROLE_DECODE",
            {"instanceId": message.instance_id},
        )
    return InstanceInfo(
        instance_id=message.instance_id,
        role=role,
        address=message.address,
        protocol_version=message.protocol.version,
        features=tuple(message.protocol.features),
        kv_layout=kv_layout_from_pb(message.kv_layout),
        model_name=message.model_name,
        max_model_len=message.max_model_len,
        metrics_address=message.metrics_address,
        batch_invariant=message.batch_invariant,
    )


def load_from_pb(message: common_pb2.LoadReport) -> LoadReport:
    """LoadReport message -> `LoadReport`."""
    cached = message.max_cached_blocks if message.HasField("max_cached_blocks") else None
    return _same_named(LoadReport, message, max_cached_blocks=cached)


def instance_status_from_pb(
    message: instance_pb2.GetInstanceStatusResponse,
) -> tuple[InstanceInfo, LoadReport]:
    """GetInstanceStatusResponse -> (`InstanceInfo`, `LoadReport`)."""
    return instance_info_from_pb(message.instance), load_from_pb(message.load)


def registration_from_bytes(data: bytes) -> tuple[InstanceInfo, LoadReport]:
    """A serialized RegisterRequest (the value of an instance's etcd key) -> (`InstanceInfo`,
    `LoadReport`).

    Raises:
        PdserveError: INVALID_REQUEST when the bytes do not parse or the role is unset.
    """
    message = registry_pb2.RegisterRequest()
    try:
        message.ParseFromString(data)
    except DecodeError:
        raise PdserveError(
            ErrorReason.INVALID_REQUEST, "not a serialized pdserve.v1.RegisterRequest"
        ) from None
    return instance_info_from_pb(message.instance), load_from_pb(message.load)


def model_files_from_pb(message: prefill_pb2.GetModelInfoResponse) -> ModelFiles:
    """GetModelInfoResponse -> `ModelFiles`.

    Raises:
        ValueError: If tokenizer_config_json is not a JSON object.
    """
    config = json.loads(message.tokenizer_config_json) if message.tokenizer_config_json else None
    if config is not None and not isinstance(config, dict):
        raise ValueError("tokenizer_config_json must be a JSON object")
    return ModelFiles(
        model_name=message.model_name,
        tokenizer_json=message.tokenizer_json,
        tokenizer_config=config,
        chat_template=message.chat_template or None,
        eos_token_ids=tuple(message.eos_token_ids),
        max_model_len=message.max_model_len,
    )


# Prefill and decode ----------------------------------------------------------------------------


def prefill_request_to_pb(call: PrefillCall) -> prefill_pb2.PrefillRequest:
    """`PrefillCall` -> PrefillRequest message."""
    return prefill_pb2.PrefillRequest(
        request_id=call.request_id,
        token_ids=list(call.token_ids),
        num_prompt_tokens=call.num_prompt_tokens,
        sampling=sampling_to_proto(call.sampling),
        decode=prefill_pb2.DecodeTarget(
            address=call.decode_address, instance_id=call.decode_instance_id
        ),
        protocol=local_protocol(),
        share_key=call.share_key,
    )


def _finished_from_pb(message: common_pb2.Finished) -> FinishedEvent:
    return FinishedEvent(
        finish_reason=finish_reason_from_proto(message.finish_reason),
        num_completion_tokens=message.usage.num_completion_tokens,
        num_cached_prompt_tokens=message.usage.num_cached_prompt_tokens,
    )


def _phases_from_pb(
    message: prefill_pb2.PrefillPhases, *, has_transfer_tail: bool = False
) -> PrefillPhases:
    return PrefillPhases(
        lease_s=message.lease_us / 1e6,
        queue_s=message.queue_us / 1e6,
        compute_s=message.compute_us / 1e6,
        transfer_tail_s=message.transfer_tail_us / 1e6 if has_transfer_tail else None,
        transport=message.transport,
    )


def prefill_event_from_pb(message: prefill_pb2.PrefillResponse) -> PrefillEvent | None:
    """PrefillResponse -> event; None for an empty message (no event set)."""
    kind = message.WhichOneof("event")
    if kind == "first_token":
        first = message.first_token
        phases = _phases_from_pb(first.phases) if first.HasField("phases") else None
        return FirstTokenEvent(
            first.token_id,
            first.index,
            phases,
            logprobs_from_proto(first.logprobs) if first.HasField("logprobs") else None,
            tuple(logprobs_from_proto(lp) for lp in first.prompt_logprobs),
        )
    if kind == "handed_off":
        handed_off = message.handed_off
        phases = None
        if handed_off.HasField("phases"):
            phases = _phases_from_pb(handed_off.phases, has_transfer_tail=True)
        return HandedOffEvent(handed_off.lease_id, handed_off.decode_instance_id, phases)
    if kind == "finished":
        return _finished_from_pb(message.finished)
    return None


def decode_event_from_pb(message: decode_pb2.DecodeServiceGenerateResponse) -> DecodeEvent | None:
    """DecodeServiceGenerateResponse -> event; None for an empty message."""
    kind = message.WhichOneof("event")
    if kind == "tokens":
        tokens = message.tokens
        return TokenBatchEvent(
            tuple(tokens.token_ids),
            tokens.first_index,
            tuple(logprobs_from_proto(lp) for lp in tokens.logprobs),
        )
    if kind == "preemption":
        notice = message.preemption
        return PreemptionEvent(
            reason=decode_pb2.PreemptionReason.Name(notice.reason),
            num_generated_tokens=notice.num_generated_tokens,
            generated_token_ids=tuple(notice.generated_token_ids),
        )
    if kind == "finished":
        return _finished_from_pb(message.finished)
    return None
