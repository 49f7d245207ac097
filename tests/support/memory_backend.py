"""An in-memory `Backend`: prefill and decode instances scripted in plain Python, no gRPC.

Tokens are those of the gRPC fakes (`support.gateway_fakes.fake_token`: a pure function of the
original prompt, the seed and the completion index), so a continuation on any instance yields
exactly the tokens an undisturbed run would (`expected_tokens`). The instances keep the
contract's promises: a prefill leases blocks on the decode it is given and releases them if it
fails or is aborted before the hand-off; closing a decode's stream releases its lease.

An instance runs undisturbed unless its script says otherwise: each Prefill (or Generate) call
takes the next `Fault` from the instance's `script`; a decode's `refusals` answer its next
allocations. `support.memory_cluster` wires the backend to a registry, router and orchestrator.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import FinishReason, SamplingParams, check_stop, resolve_seed
from pdserve.gateway.fleet.backend import (
    BackendError,
    DecodeCall,
    DecodeEvent,
    DecodeSnapshot,
    FinishedEvent,
    FirstTokenEvent,
    HandedOffEvent,
    PreemptionEvent,
    PrefillCall,
    PrefillEvent,
    PrefillPhases,
    TokenBatchEvent,
)
from pdserve.gateway.fleet.instance import InstanceInfo, LoadReport
from support.gateway_fakes import EOS_TOKEN_ID, fake_token


@dataclass(frozen=True)
class Fault:
    """What one call does instead of running undisturbed, once it has sent `after` tokens.

    A prefill sends at most one token (the first), so its ``after`` is 0 (before allocating)
    or 1 (after the first token, before the hand-off). Build one with the functions below.
    """

    kind: str
    after: int = 0
    error: PdserveError | None = None
    until: asyncio.Event | None = None


def fail(reason: ErrorReason, after: int = 0, **metadata: str) -> Fault:
    """The server answers with an error status."""
    return Fault("fail", after, PdserveError(reason, "scripted", dict(metadata)))


def lose(after: int = 0) -> Fault:
    """The connection breaks (no status from the server)."""
    return Fault("lose", after)


def stall(after: int = 0, until: asyncio.Event | None = None) -> Fault:
    """The stream stops yielding but stays open (until `until` is set, or it is cancelled)."""
    return Fault("stall", after, until=until)


def end(after: int = 0) -> Fault:
    """The stream ends without its terminal event."""
    return Fault("end", after)


def preempt(after: int) -> Fault:
    """The decode preempts the request (and frees its lease)."""
    return Fault("preempt", after)


def skip(after: int) -> Fault:
    """The decode skips a completion index."""
    return Fault("skip", after)


def repeat(num_tokens: int) -> Fault:
    """The decode starts `num_tokens` indices early: it resends tokens already delivered."""
    return Fault("repeat", num_tokens)


@dataclass
class Lease:
    """Blocks a decode holds for one request (and what the prefill sent into them)."""

    lease_id: str
    call: PrefillCall
    first_token_id: int = 0
    first_index: int = 0
    is_open: bool = True


@dataclass
class MemoryInstance:
    """One scripted prefill or decode."""

    info: InstanceInfo
    load: LoadReport
    script: list[Fault] = field(default_factory=list)
    stalled: asyncio.Event = field(default_factory=asyncio.Event)  # set when a stall begins
    # prefill
    calls: list[PrefillCall] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    abort_delay_s: float = 0.0  # how long an AbortRequest takes to arrive
    history: list[str] = field(default_factory=list)  # "prefill <id>" / "abort <id>", in order
    phases: PrefillPhases | None = None  # reported on FirstToken and (as is) on HandedOff
    # decode
    refusals: list[PdserveError | None] = field(default_factory=list)  # None: granted
    leases: dict[str, Lease] = field(default_factory=dict)
    generate_calls: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    batch_size: int = 2

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def num_open_leases(self) -> int:
        return sum(lease.is_open for lease in self.leases.values())

    def next_fault(self) -> Fault | None:
        return self.script.pop(0) if self.script else None

    def refuse(
        self,
        times: int = 1,
        reason: ErrorReason = ErrorReason.DECODE_CAPACITY_EXHAUSTED,
        retry_delay_s: float | None = None,
        *,
        after: int = 0,
    ) -> None:
        """The `times` allocations after the next `after` ones are refused with `reason`."""
        metadata = {"instanceId": self.instance_id}
        error = PdserveError(reason, "scripted refusal", metadata, retry_delay_s=retry_delay_s)
        self.refusals += [None] * after + [error] * times


def _lost(instance_id: str) -> BackendError:
    error = PdserveError(ErrorReason.PEER_UNAVAILABLE, f"connection to {instance_id} lost")
    return BackendError(error, is_from_server=False)


def _token(call: PrefillCall, index: int) -> int:
    prompt = call.token_ids[: call.num_prompt_tokens]
    return fake_token(prompt, resolve_seed(call.sampling.seed), index)


def _finish(token_id: int, index: int, sampling: SamplingParams) -> FinishReason | None:
    return check_stop(token_id, index + 1, sampling, (EOS_TOKEN_ID,))


class MemoryBackend:
    """`Backend` over `MemoryInstance`s, found by address (an unknown address is unreachable)."""

    def __init__(self) -> None:
        self.instances: dict[str, MemoryInstance] = {}

    def _instance(self, address: str) -> MemoryInstance:
        instance = self.instances.get(address)
        if instance is None:
            raise _lost(address)
        return instance

    async def _fault(self, instance: MemoryInstance, fault: Fault, deadline: float) -> None:
        """Acts out `fault` (returns when a stall is over, or for "end")."""
        if fault.kind == "fail":
            assert fault.error is not None
            raise BackendError(fault.error, is_from_server=True)
        if fault.kind == "lose":
            raise _lost(instance.instance_id)
        if fault.kind == "stall":
            instance.stalled.set()
            wait = (fault.until or asyncio.Event()).wait()
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(wait, remaining)
            except TimeoutError:
                error = PdserveError(ErrorReason.DEADLINE_EXCEEDED, "call deadline")
                raise BackendError(error, is_from_server=True) from None

    async def prefill(
        self, address: str, call: PrefillCall, timeout_s: float
    ) -> AsyncGenerator[PrefillEvent, None]:
        prefill = self._instance(address)
        prefill.calls.append(call)
        prefill.history.append(f"prefill {call.request_id}")
        deadline = asyncio.get_running_loop().time() + timeout_s
        fault = prefill.next_fault()
        if fault is not None and fault.after == 0:
            await self._fault(prefill, fault, deadline)
            if fault.kind == "end":
                return
            fault = None
        decode = self.instances[call.decode_address]
        refusal = decode.refusals.pop(0) if decode.refusals else None
        if refusal is not None:
            raise BackendError(refusal, is_from_server=True)  # the prefill relays the refusal
        index = len(call.token_ids) - call.num_prompt_tokens
        first = _token(call, index)
        lease = Lease(f"{decode.instance_id}-lease-{len(decode.leases)}", call, first, index)
        decode.leases[lease.lease_id] = lease
        is_handed_off = False
        try:
            phases = prefill.phases
            first_phases = (
                None if phases is None else replace(phases, transfer_tail_s=None, transport="")
            )
            yield FirstTokenEvent(first, index, first_phases)
            reason = _finish(first, index, call.sampling)
            if reason is not None:
                yield FinishedEvent(reason, index + 1)
                return
            if fault is not None:
                await self._fault(prefill, fault, deadline)
                if fault.kind == "end":
                    return
            is_handed_off = True
            yield HandedOffEvent(lease.lease_id, decode.instance_id, phases)
        finally:
            if not is_handed_off:
                lease.is_open = False  # contract: a failed or aborted prefill releases its lease

    async def abort_request(
        self, address: str, request_id: str, timeout_s: float, trace_context: Any = None
    ) -> None:
        instance = self._instance(address)
        await asyncio.sleep(instance.abort_delay_s)
        instance.aborted.append(request_id)
        instance.history.append(f"abort {request_id}")

    async def generate(
        self, address: str, decode_call: DecodeCall, timeout_s: float
    ) -> AsyncGenerator[DecodeEvent, None]:
        # NOTE: `resumable` is accepted and changes nothing here (a closed stream still
        # releases the lease); no test of this fake resumes yet.
        lease_id = decode_call.lease_id
        if decode_call.resume:
            raise NotImplementedError("the in-memory decode does not resume streams")
        decode = self._instance(address)
        decode.generate_calls.append(lease_id)
        lease = decode.leases.get(lease_id)
        if lease is None or not lease.is_open:
            raise BackendError(PdserveError(ErrorReason.LEASE_NOT_FOUND), is_from_server=True)
        deadline = asyncio.get_running_loop().time() + timeout_s
        call, fault = lease.call, decode.next_fault()
        generated = [*call.token_ids[call.num_prompt_tokens :], lease.first_token_id]
        if fault is not None and fault.kind == "repeat":
            generated = generated[: max(1, len(generated) - fault.after)]
            fault = None
        batch: list[int] = []
        try:
            for num_sent in itertools.count():
                index = len(generated)
                if _finish(generated[-1], index - 1, call.sampling) is not None:
                    break
                if fault is not None and num_sent == fault.after:
                    if batch:
                        yield TokenBatchEvent(tuple(batch), index - len(batch))
                        batch = []
                    if fault.kind == "preempt":
                        lease.is_open = False
                        yield PreemptionEvent("out_of_blocks", len(generated), tuple(generated))
                        return
                    if fault.kind == "skip":
                        generated.append(_token(call, index))
                        index += 1
                    else:
                        await self._fault(decode, fault, deadline)
                        if fault.kind == "end":
                            return
                    fault = None
                token = _token(call, index)
                generated.append(token)
                batch.append(token)
                if len(batch) >= decode.batch_size:
                    yield TokenBatchEvent(tuple(batch), index + 1 - len(batch))
                    batch = []
            if batch:
                yield TokenBatchEvent(tuple(batch), len(generated) - len(batch))
            reason = _finish(generated[-1], len(generated) - 1, call.sampling)
            yield FinishedEvent(reason, len(generated))
        finally:
            lease.is_open = False  # contract: closing the stream releases the lease

    async def snapshot(
        self, address: str, request_id: str, lease_id: str, timeout_s: float
    ) -> DecodeSnapshot:
        raise NotImplementedError("the in-memory decode does not answer snapshots")

    async def release_lease(
        self,
        address: str,
        lease_id: str,
        request_id: str,
        timeout_s: float,
        trace_context: Any = None,
    ) -> None:
        decode = self._instance(address)
        decode.released.append(lease_id)
        if lease_id in decode.leases:
            decode.leases[lease_id].is_open = False
