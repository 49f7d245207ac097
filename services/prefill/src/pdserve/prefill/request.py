"""One prefill request as a value: its tokens, its blocks, its lease and its life cycle.

A `Request` walks QUEUED -> PREPARING -> PREFILLING -> TRANSFERRING -> HANDED_OFF (or FINISHED
when the first token ends it, or FAILED / ABORTED from any open state); `move_to`/`end` allow
only what `TRANSITIONS` lists. It holds its state and nothing that runs: its KV sender, its
tasks and the outbox its caller reads are the handoff's (`in_flight.InFlight`), and giving back
what it holds (its decode lease, its blocks) is the handoff's too (`Handoffs`).

Ownership: the event loop moves ``status`` and sets ``lease``; the engine thread owns
``block_ids``, ``num_computed_tokens``, ``num_cached_tokens``, ``num_loaded_tokens``,
``block_keys``, the stored payloads and ``num_sent_blocks`` from the moment the request is
submitted to it until it is released (the store lookup sets the keys and payloads just before).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from opentelemetry.context import Context

from pdserve.common.generation import (
    FinishReason,
    SamplingParams,
    TokenLogprobs,
    check_stop,
    is_length_reached,
)
from pdserve.common.transitions import IllegalTransition, check_transition, transition_table
from pdserve.engine.constraints import ConstraintState
from pdserve.prefill.events import EventSink, LeaseGrant
from pdserve.prefill.phases import PhaseClock


class RequestStatus(enum.IntEnum):
    """Life cycle of a prefill request; values at or above HANDED_OFF are terminal."""

    QUEUED = 0
    PREPARING = 1  # leasing blocks on the target decode
    PREFILLING = 2  # waiting for or in forward passes; KV ships layer by layer
    TRANSFERRING = 3  # first token sampled; waiting for the decode to acknowledge the commit
    HANDED_OFF = 4
    FINISHED = 5  # the first token ended the request; no decode runs
    FAILED = 6
    ABORTED = 7

    @property
    def is_terminal(self) -> bool:
        return self >= RequestStatus.HANDED_OFF


_S = RequestStatus
_ENDINGS = frozenset({_S.FAILED, _S.ABORTED})  # possible in every open state
TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = transition_table(
    {
        # NOTE: a request whose first token is known to end it takes no lease: QUEUED ->
        # PREFILLING.
        _S.QUEUED: {_S.PREPARING, _S.PREFILLING},
        _S.PREPARING: {_S.PREFILLING},
        _S.PREFILLING: {_S.TRANSFERRING, _S.FINISHED},
        _S.TRANSFERRING: {_S.HANDED_OFF},
    },
    endings=_ENDINGS,
    terminal=(status for status in RequestStatus if status.is_terminal),
)


@dataclass(eq=False)
class Request:
    """One prompt to prefill for one decode target.

    Attributes:
        request_id: The gateway's id.
        token_ids: The prompt followed by earlier completion tokens (a reschedule).
        num_prompt_tokens: Length of the original prompt within ``token_ids``.
        sampling: Sampling settings; ``max_tokens`` counts the whole completion.
        seed: Seed of every sampled position (``resolve_seed`` of the request's).
        decode_address: "host:port" of the target decode.
        decode_instance_id: The instance id the caller expects there ('' if not given).
        share_key: The completions of one prompt share it ('' for none); the decode may
            then hold the prompt's full blocks already (``LeaseGrant.num_shared_blocks``).
        is_sending_kv: Whether the engine exports KV for the decode (False when the first
            token is known to end the request, so no lease is taken).
        sink: Receives the engine thread's events (must be thread-safe).
        status: Where the request is in its life cycle.
        lease: The decode lease once granted.
        block_ids: This prefill's blocks holding the request's KV.
        num_computed_tokens: Tokens whose KV is computed (or was found in the prefix cache).
        num_cached_tokens: Leading tokens whose KV came from the prefix cache (not computed).
        num_loaded_tokens: Tokens after those whose KV was loaded from the KV store.
        block_keys: Cluster-wide keys of the full blocks of ``token_ids`` (prefix cache or
            KV store on).
        stored_first_block: Logical block of ``stored_payloads[0]``.
        stored_payloads: Block payloads found in the KV store before admission (admission
            copies those it uses into the request's blocks and drops the list).
        pending_imports: Blocks admission gave stored payloads to, ``(block_id, payload)``;
            written into the cache before the request's first pass.
        num_sent_blocks: Leading logical blocks already exported to the sender (or held by the
            decode already: the blocks its lease shares with another completion).
        phases: When it arrived and reached each phase boundary (the engine thread sets the
            first scheduled pass).
        trace_context: Parent of the engine thread's spans for this request (None: untraced).
        submitted_ns: Wall-clock time it was handed to the engine thread (for queue spans).
        is_lease_open: Whether it holds a decode lease not yet handed off or released.
        is_submitted: Whether the engine thread knows it (so its blocks must be released).
        prompt_logprobs: The prompt tokens' logprobs computed so far (``prompt_logprobs`` set).
        constraint_state: Its constraint's matcher (``sampling.constraint`` set), advanced
            over the completion it carries before the engine thread sees it.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    seed: int
    decode_address: str
    decode_instance_id: str = ""
    share_key: str = ""
    is_sending_kv: bool = True
    sink: EventSink = field(default=lambda event: None)
    status: RequestStatus = RequestStatus.QUEUED
    lease: LeaseGrant | None = None
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_loaded_tokens: int = 0
    block_keys: list[bytes] = field(default_factory=list)
    stored_first_block: int = 0
    stored_payloads: list[bytes] = field(default_factory=list, repr=False)
    pending_imports: list[tuple[int, bytes]] = field(default_factory=list, repr=False)
    num_sent_blocks: int = 0
    phases: PhaseClock = field(default_factory=PhaseClock)
    trace_context: Context | None = None
    submitted_ns: int = 0
    is_lease_open: bool = False
    is_submitted: bool = False
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list, repr=False)
    constraint_state: ConstraintState | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def first_token_index(self) -> int:
        """Completion index of the token this prefill samples."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_new_tokens(self) -> int:
        """Tokens the completion may still grow by, the first token included."""
        return self.sampling.max_tokens - self.first_token_index

    @property
    def is_prefilled(self) -> bool:
        return self.num_computed_tokens >= self.num_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    # ---- transitions (on the event loop) ---------------------------------------------------

    def can_move_to(self, status: RequestStatus) -> bool:
        """Whether `status` may follow the current one."""
        return status in TRANSITIONS[self.status]

    def move_to(self, status: RequestStatus) -> None:
        """Moves to `status`.

        Raises:
            IllegalTransition: If the state machine does not allow it.
        """
        check_transition(TRANSITIONS, self.status, status)
        self.status = status
        if status is RequestStatus.HANDED_OFF:
            self.phases.handed_off = time.monotonic()

    def end(self, status: RequestStatus) -> bool:
        """Ends it as FAILED or ABORTED; False if it had ended already (its caller then knows
        how it ended). Its owner then gives back what it holds, lease included.

        Raises:
            IllegalTransition: For any other `status`.
        """
        if status not in _ENDINGS:
            raise IllegalTransition(self.status, status)
        if self.status.is_terminal:
            return False
        self.move_to(status)
        return True

    # ---- the one stop rule at its first token ---------------------------------------------

    def is_length_capped(self, max_model_len: int) -> bool:
        """Whether the first token ends it whatever that token is (max_tokens or model length)."""
        return is_length_reached(
            self.first_token_index + 1, self.sampling, self.num_tokens + 1, max_model_len
        )

    def first_token_finish(
        self, token_id: int, eos_token_ids: frozenset[int], max_model_len: int
    ) -> FinishReason | None:
        """Why the first token ends it, or None when the decode continues it (the one stop
        rule, `check_stop`, at the first token's completion index)."""
        return check_stop(
            token_id,
            self.first_token_index + 1,
            self.sampling,
            eos_token_ids,
            num_tokens=self.num_tokens + 1,
            max_model_len=max_model_len,
        )
