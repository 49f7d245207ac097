"""The prefill's edge: pdserve.v1 messages to and from the plain types of its core."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import num_blocks_for, resolve_seed
from pdserve.common.protocol import check_compatible
from pdserve.kv.transfer import KvPiece, chunk_crc32c
from pdserve.prefill.events import LeaseGrant
from pdserve.prefill.phases import PhaseDurations
from pdserve.prefill.request import Request
from pdserve.serving.convert import sampling_from_proto, sampling_to_proto
from pdserve.serving.transports import TRANSPORT_KINDS, transport_from_proto
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2


@dataclass(frozen=True)
class PrefillRequestBounds:
    """What a request must fit: the model's vocabulary and length, and this prefill's pool."""

    vocab_size: int
    max_model_len: int
    max_prompt_blocks: int
    block_size: int


def request_from_proto(
    message: prefill_pb2.PrefillRequest, limits: PrefillRequestBounds
) -> Request:
    """Validates a PrefillRequest and returns the plain request.

    Raises:
        PdserveError: INCOMPATIBLE_PEER for another protocol major; INVALID_REQUEST for a
            malformed request; PROMPT_TOO_LONG for tokens that cannot fit.
    """
    check_compatible(message.protocol.version)
    request_id = message.request_id
    meta = {"requestId": request_id}
    if not request_id:
        raise PdserveError(ErrorReason.INVALID_REQUEST, "request_id is empty")
    if not message.decode.address:
        raise PdserveError(ErrorReason.INVALID_REQUEST, "decode.address is empty", meta)
    token_ids = list(message.token_ids)
    if not token_ids:
        raise PdserveError(ErrorReason.INVALID_REQUEST, "token_ids is empty", meta)
    if max(token_ids) >= limits.vocab_size:
        raise PdserveError(
            ErrorReason.INVALID_REQUEST,
            f"token ids must be below the vocabulary size {limits.vocab_size}",
            meta,
        )
    num_prompt_tokens = message.num_prompt_tokens or len(token_ids)
    if num_prompt_tokens > len(token_ids):
        raise PdserveError(
            ErrorReason.INVALID_REQUEST,
            f"num_prompt_tokens {num_prompt_tokens} exceeds the {len(token_ids)} token ids",
            meta,
        )
    sampling = sampling_from_proto(message.sampling)
    num_generated = len(token_ids) - num_prompt_tokens
    if num_generated >= sampling.max_tokens:
        raise PdserveError(
            ErrorReason.INVALID_REQUEST,
            f"{num_generated} completion tokens already reach max_tokens {sampling.max_tokens}",
            meta,
        )
    if len(token_ids) >= limits.max_model_len:
        raise PdserveError(
            ErrorReason.PROMPT_TOO_LONG,
            f"{len(token_ids)} tokens; max_model_len is {limits.max_model_len} and one more "
            "token must fit",
            {**meta, "maxModelLen": str(limits.max_model_len)},
        )
    num_blocks = num_blocks_for(len(token_ids), limits.block_size)
    if num_blocks > limits.max_prompt_blocks:
        raise PdserveError(
            ErrorReason.PROMPT_TOO_LONG,
            f"{len(token_ids)} tokens need {num_blocks} KV blocks; this prefill has "
            f"{limits.max_prompt_blocks}",
            meta,
        )
    return Request(
        request_id=request_id,
        token_ids=token_ids,
        num_prompt_tokens=num_prompt_tokens,
        sampling=sampling,
        # NOTE: the decode resolves a missing seed the same way; the first token must come
        # from the same stream.
        seed=resolve_seed(sampling.seed),
        decode_address=message.decode.address,
        decode_instance_id=message.decode.instance_id,
        share_key=message.share_key,
    )


def lease_from_proto(lease: decode_pb2.Lease) -> LeaseGrant:
    """The granted lease with the decode's transport offers (gRPC is always there; kinds this
    prefill does not know are ignored). The token travels on whichever transport is used."""
    token = next(
        (t.token for t in lease.transports if t.kind == decode_pb2.TRANSPORT_KIND_GRPC_SYNC_CACHE),
        b"",
    )
    offers = tuple(
        offer for offer in map(transport_from_proto, lease.transports) if offer is not None
    )
    return LeaseGrant(
        lease.lease_id,
        tuple(lease.block_ids),
        lease.decode_instance_id,
        token,
        offers,
        lease.num_shared_blocks,
        lease.num_window_skipped_blocks,
        lease.num_window_slots,
        tuple(lease.window_slot_ids),
    )


def allocate_request(
    request: Request, kv_layout: common_pb2.KvLayout, protocol: common_pb2.Protocol, sender: str
) -> decode_pb2.AllocateBlocksRequest:
    """The AllocateBlocks call for `request`."""
    return decode_pb2.AllocateBlocksRequest(
        request_id=request.request_id,
        num_prompt_tokens=request.num_tokens,
        max_new_tokens=request.max_new_tokens,
        kv_layout=kv_layout,
        protocol=protocol,
        prefill_instance_id=sender,
        share_key=request.share_key,
    )


def sync_header(request: Request, transport: str = "grpc") -> decode_pb2.SyncCacheRequest:
    """The header of `request`'s transfer on `transport` (the request must hold a lease)."""
    assert request.lease is not None
    return decode_pb2.SyncCacheRequest(
        header=decode_pb2.SyncCacheHeader(
            lease_id=request.lease.lease_id,
            request_id=request.request_id,
            token_ids=request.token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            sampling=sampling_to_proto(request.sampling),
            transport_token=request.lease.transport_token,
            transport=TRANSPORT_KINDS[transport],
        )
    )


def kv_chunk(piece: KvPiece, *, corrupt: bool = False) -> decode_pb2.SyncCacheRequest:
    """A chunk message with its CRC-32C; `corrupt` flips a byte after the checksum (a fault
    injected on purpose)."""
    key, value = bytes(piece.key), bytes(piece.value)
    crc = chunk_crc32c(key, value)
    if corrupt:
        key = bytes([key[0] ^ 0xFF]) + key[1:]
    return decode_pb2.SyncCacheRequest(
        chunk=decode_pb2.KvChunk(
            layer_index=piece.layer_index,
            first_block=piece.first_block,
            num_blocks=piece.num_blocks,
            key=key,
            value=value,
            crc32c=crc,
        )
    )


def kv_chunk_meta(pieces: Sequence[KvPiece], crc: int) -> decode_pb2.SyncCacheRequest:
    """A chunk message without its bytes (they follow it raw on the TCP data port, or are
    already in the decode's cache): one piece, or a run of `chunk_runs` announced as one."""
    first = pieces[0]
    return decode_pb2.SyncCacheRequest(
        chunk=decode_pb2.KvChunk(
            layer_index=first.layer_index,
            first_block=first.first_block,
            num_blocks=sum(piece.num_blocks for piece in pieces),
            crc32c=crc,
        )
    )


def sync_commit(
    num_chunks: int,
    num_bytes: int,
    first_token_id: int,
    first_token_index: int,
) -> decode_pb2.SyncCacheRequest:
    """The commit message that closes a transfer."""
    return decode_pb2.SyncCacheRequest(
        commit=decode_pb2.SyncCacheCommit(
            num_chunks=num_chunks,
            num_bytes=num_bytes,
            first_token_id=first_token_id,
            first_token_index=first_token_index,
        )
    )


def phases_to_proto(phases: PhaseDurations) -> prefill_pb2.PrefillPhases:
    """The PrefillPhases message (whole microseconds; a phase not reached is left at 0)."""
    return prefill_pb2.PrefillPhases(
        lease_us=_micros(phases.lease_s),
        queue_us=_micros(phases.queue_s),
        compute_us=_micros(phases.compute_s),
        transfer_tail_us=_micros(phases.transfer_tail_s),
        transport=phases.transport,
    )


def _micros(seconds: float | None) -> int:
    return 0 if seconds is None else round(seconds * 1_000_000)
