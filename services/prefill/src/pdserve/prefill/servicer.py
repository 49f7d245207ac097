"""PrefillService over gRPC: the edge between pdserve.v1 messages and the handoffs."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog
from opentelemetry import trace

from pdserve.common import telemetry
from pdserve.common.errors import PdserveError, abort_with_error
from pdserve.prefill import convert, phases
from pdserve.prefill.events import FinishedOut, FirstTokenOut, HandedOffOut, Outcome
from pdserve.prefill.handoff import Handoffs
from pdserve.prefill.phases import PhaseDurations
from pdserve.prefill.request import Request
from pdserve.serving.convert import finish_reason_to_proto, logprobs_to_proto
from pdserve.serving.model_host import ModelHost
from pdserve.serving.transports import TRANSPORT_KINDS
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2, prefill_pb2_grpc

log = structlog.get_logger(__name__)


def outcome_to_proto(
    outcome: Outcome, phases: PhaseDurations | None = None
) -> prefill_pb2.PrefillResponse:
    """The stream message of a non-error outcome; `phases` go on FirstToken and HandedOff."""
    phases_pb = None if phases is None else convert.phases_to_proto(phases)
    if isinstance(outcome, FirstTokenOut):
        return prefill_pb2.PrefillResponse(
            first_token=prefill_pb2.FirstToken(
                token_id=outcome.token_id,
                index=outcome.index,
                phases=phases_pb,
                logprobs=(
                    None if outcome.logprobs is None else logprobs_to_proto(outcome.logprobs)
                ),
                prompt_logprobs=[logprobs_to_proto(lp) for lp in outcome.prompt_logprobs],
            )
        )
    if isinstance(outcome, HandedOffOut):
        return prefill_pb2.PrefillResponse(
            handed_off=prefill_pb2.HandedOff(
                lease_id=outcome.lease.lease_id,
                decode_instance_id=outcome.lease.decode_instance_id,
                num_bytes=outcome.num_bytes,
                num_chunks=outcome.num_chunks,
                transport=decode_pb2.TransportKind.Name(TRANSPORT_KINDS[outcome.transport]),
                phases=phases_pb,
            )
        )
    assert isinstance(outcome, FinishedOut)
    return prefill_pb2.PrefillResponse(
        finished=common_pb2.Finished(
            finish_reason=finish_reason_to_proto(outcome.reason),
            usage=common_pb2.Usage(
                num_prompt_tokens=outcome.num_prompt_tokens,
                num_completion_tokens=outcome.num_completion_tokens,
            ),
        )
    )


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    """Implements pdserve.v1.PrefillService.

    Args:
        host: The loaded model (tokenizer files, limits, KV layout).
        handoffs: Runs the requests.
        instance: This instance's InstanceInfo.
        limits: What a request must fit.
    """

    def __init__(
        self,
        host: ModelHost,
        handoffs: Handoffs,
        instance: common_pb2.InstanceInfo,
        limits: convert.PrefillRequestBounds,
    ) -> None:
        self.host = host
        self.handoffs = handoffs
        self.instance = instance
        self.limits = limits

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[prefill_pb2.PrefillResponse]:
        """Runs a prompt for its decode: `first_token`, then `handed_off` or `finished`."""
        span = trace.get_current_span()
        span.set_attribute(telemetry.REQUEST_ID, request.request_id)
        try:
            started = await self.handoffs.admit(convert.request_from_proto(request, self.limits))
        except PdserveError as error:
            log.info("prefill_refused", request_id=request.request_id, reason=error.reason.name)
            await abort_with_error(context, error)
        is_done = False
        try:
            while not is_done:
                outcome = await started.outbox.get()
                if isinstance(outcome, PdserveError):
                    is_done = True
                    await abort_with_error(context, outcome)
                is_done = not isinstance(outcome, FirstTokenOut)
                durations = self._record_phases(started.request, outcome, span)
                yield outcome_to_proto(outcome, durations)
        finally:
            if not is_done:
                # NOTE: the caller hung up: abort, which releases the decode lease.
                self.handoffs.cancel(started)

    def _record_phases(
        self, request: Request, outcome: Outcome, span: trace.Span
    ) -> PhaseDurations | None:
        """The phases `outcome` reports, recorded once each: those up to the first token with
        it, the transfer tail with the handoff."""
        if isinstance(outcome, FirstTokenOut):
            durations = request.phases.durations()
            phases.record(durations, span, self.handoffs.metrics)
            return durations
        if isinstance(outcome, HandedOffOut):
            durations = request.phases.durations(outcome.transport)
            phases.record(durations.after_first_token(), span, self.handoffs.metrics)
            return durations
        return None

    async def AbortRequest(
        self, request: prefill_pb2.AbortRequestRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.AbortRequestResponse:
        """Aborts a request at any stage; returns once its lease and blocks are released."""
        trace.get_current_span().set_attribute(telemetry.REQUEST_ID, request.request_id)
        was_known = await self.handoffs.abort(request.request_id)
        log.info("abort_requested", request_id=request.request_id, was_known=was_known)
        return prefill_pb2.AbortRequestResponse(was_known=was_known)

    async def GetModelInfo(
        self, request: prefill_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.GetModelInfoResponse:
        """Tokenizer files, chat template, end-of-sequence ids, limits and KV layout."""
        tokenizer_json, tokenizer_config_json, chat_template = self.host.tokenizer_files()
        return prefill_pb2.GetModelInfoResponse(
            model_name=self.host.served_model_name,
            tokenizer_json=tokenizer_json,
            tokenizer_config_json=tokenizer_config_json,
            chat_template=chat_template,
            eos_token_ids=list(self.host.eos_token_ids),
            max_model_len=self.host.max_model_len,
            kv_layout=self.host.kv_layout,
            instance=self.instance,
        )
