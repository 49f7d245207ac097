"""The TCP KV transport's sending end: the SyncCache messages, length-prefixed, on a raw socket
to the decode's data port, each chunk's K and V bytes sent straight from the cache after it.

Socket calls are blocking and run on worker threads (they release the GIL), one at a time and
in order. The decode answers once with a KvTcpResult; a connection it closed without one (a
refused token) is classified by the lease's state, as a broken SyncCache stream is.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Sequence
from typing import TypeVar

import structlog

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.kv.transfer import KvPiece, chunk_crc32c
from pdserve.kv.transports.tcp import frame, recv_frame
from pdserve.prefill import convert
from pdserve.prefill.kv.channels import TransportUnavailable, ask_lease_state
from pdserve.prefill.request import Request
from pdserve.v1 import decode_pb2, decode_pb2_grpc, errors_pb2

log = structlog.get_logger(__name__)

T = TypeVar("T")

CONNECT_TIMEOUT_S = 2.0
RESULT_TIMEOUT_S = 30.0
MAX_RESULT_BYTES = 64 * 1024


class TcpChannel:
    """One transfer over the decode's TCP data port.

    Args:
        stub: The decode's stub (only to classify a connection closed without an answer).
        request: The request (holding its lease).
        address: The lease's TCP transport address, host:port.
    """

    name = "tcp"

    def __init__(
        self, stub: decode_pb2_grpc.DecodeServiceStub, request: Request, address: str
    ) -> None:
        self.stub = stub
        self.request = request
        self.address = address
        self.sock: socket.socket | None = None

    async def open(self) -> None:
        host, _, port = self.address.rpartition(":")
        try:
            self.sock = await asyncio.to_thread(
                socket.create_connection, (host.strip("[]"), int(port)), CONNECT_TIMEOUT_S
            )
        except (OSError, ValueError) as error:
            raise TransportUnavailable(f"{self.address}: {error}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)
        header = convert.sync_header(self.request, self.name)
        await self._run(self._send_all, [frame(header.SerializeToString())])

    async def send(self, pieces: Sequence[KvPiece], *, corrupt_first: bool = False) -> int:
        await self._run(self._send_pieces, pieces, corrupt_first)
        return len(pieces)

    async def finish(
        self, first_token_id: int, first_token_index: int, num_chunks: int, num_bytes: int
    ) -> None:
        commit = convert.sync_commit(num_chunks, num_bytes, first_token_id, first_token_index)
        await self._run(self._send_all, [frame(commit.SerializeToString())])
        answer = await self._run(self._read_result)
        if answer.error_reason != errors_pb2.ERROR_REASON_UNSPECIFIED:
            name = errors_pb2.ErrorReason.Name(answer.error_reason).removeprefix("ERROR_REASON_")
            raise PdserveError(
                ErrorReason.__members__.get(name, ErrorReason.CACHE_SYNC_FAILED),
                answer.error_message,
                self._metadata(),
            )
        self.close()
        if answer.response.state != decode_pb2.LEASE_STATE_COMMITTED:
            raise PdserveError(
                ErrorReason.CACHE_SYNC_FAILED,
                "the data port answered without a commit",
                self._metadata(),
            )

    def close(self) -> None:
        if self.sock is not None:
            # NOTE: shut down first, so that a send under way on a worker fails at once
            # instead of writing on.
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()

    async def _run(self, call: Callable[..., T], *args: object) -> T:
        try:
            return await asyncio.to_thread(call, *args)
        except (OSError, ValueError) as error:
            # NOTE: the socket's own words go to the log; the error says what broke.
            log.info("kv_tcp_transfer_broken", address=self.address, detail=repr(error))
            local = PdserveError(
                ErrorReason.CACHE_SYNC_FAILED,
                f"the TCP transfer of the KV to decode {self.address} broke off",
                self._metadata(),
            )
            raise await ask_lease_state(self.stub, self.request, local) from None

    def _metadata(self) -> dict[str, str]:
        return {"requestId": self.request.request_id, "decodeAddress": self.request.decode_address}

    def _send_pieces(self, pieces: Sequence[KvPiece], corrupt_first: bool) -> None:
        for i, piece in enumerate(pieces):
            crc = chunk_crc32c(piece.key, piece.value)
            key: bytes | memoryview = piece.key
            if corrupt_first and i == 0:
                key = bytes([piece.key[0] ^ 0xFF]) + bytes(piece.key[1:])
            message = convert.kv_chunk_meta([piece], crc)
            self._send_all([frame(message.SerializeToString()), key, piece.value])

    def _send_all(self, buffers: list[bytes | memoryview]) -> None:
        assert self.sock is not None
        for buffer in buffers:
            self.sock.sendall(buffer)

    def _read_result(self) -> decode_pb2.KvTcpResult:
        assert self.sock is not None
        self.sock.settimeout(RESULT_TIMEOUT_S)
        return decode_pb2.KvTcpResult.FromString(recv_frame(self.sock, MAX_RESULT_BYTES))
