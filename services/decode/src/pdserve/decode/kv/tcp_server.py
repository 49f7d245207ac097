"""The decode's TCP data port: KV read from the socket straight into the leased blocks.

One thread per connection (blocking reads release the GIL; the event loop never touches the
bytes). A connection carries one transfer, framed as `TRANSPORT_KIND_TCP` in decode.proto: the
header with the lease's token first (anything else, or a wrong, expired or used token, closes
the connection at once and counts in `num_refused`), then chunks whose K and V bytes are read
with ``recv_into`` into the cache, each checksummed where it landed, then the commit. The
decode answers with one KvTcpResult. Lease transitions (begin, commit, fail, end) run on the
event loop through `Transfers`, exactly as for SyncCache.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import structlog
from google.protobuf.message import DecodeError

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.grpc_server import ListenError
from pdserve.decode.kv.receiver import CHECKSUM_WORKERS, KvChunkMeta, KvReceiver
from pdserve.decode.kv.transfers import Transfers
from pdserve.decode.request import DecodeRequest
from pdserve.kv.transports.tcp import frame, recv_exactly_into, recv_frame
from pdserve.v1 import decode_pb2

log = structlog.get_logger(__name__)

T = TypeVar("T")

HEADER_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64
# A header holds the token ids: allow ~6 bytes per token plus the rest.
BYTES_PER_HEADER_TOKEN = 6
MAX_CHUNK_MESSAGE_BYTES = 4096


class KvTcpServer:
    """Accepts TCP KV transfers on `host`:`port` (0: a free port) for `transfers`.

    Args:
        transfers: Opens, commits and fails transfers (event-loop side).
        host: Address to bind.
        port: Port to bind; 0 picks a free one.
        max_model_len: Longest sequence (bounds the header's size).
        data_timeout_s: Most seconds a transfer may wait for its next bytes before it fails.
    """

    def __init__(
        self,
        transfers: Transfers,
        host: str,
        port: int,
        max_model_len: int,
        data_timeout_s: float,
    ) -> None:
        self.transfers = transfers
        self.aio_loop: asyncio.AbstractEventLoop | None = None
        self.max_header_bytes = 4096 + BYTES_PER_HEADER_TOKEN * max_model_len
        self.data_timeout_s = data_timeout_s
        self.num_refused = 0
        self.num_transfers = 0
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        try:
            self._listener = socket.create_server((host, port), backlog=MAX_CONNECTIONS)
        except OSError as error:
            raise ListenError.of_socket(host, port, error) from error
        self.port: int = self._listener.getsockname()[1]
        self._is_stopped = False
        self._thread = threading.Thread(target=self._accept_loop, name="kv-tcp", daemon=True)

    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        """Starts accepting; lease transitions will run on `aio_loop`."""
        self.aio_loop = aio_loop
        self._thread.start()
        log.info("kv_tcp_listening", port=self.port)

    def stop(self) -> None:
        """Stops accepting (transfers under way finish or fail on their own)."""
        self._is_stopped = True
        with contextlib.suppress(OSError):
            # NOTE: shutdown wakes the accept() call so the thread ends.
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._is_stopped:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self._refuse(connection, "too many KV connections")
                continue
            threading.Thread(
                target=self._serve, args=(connection,), name="kv-tcp-transfer", daemon=True
            ).start()

    def _serve(self, connection: socket.socket) -> None:
        try:
            with connection:
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._transfer(connection)
        except Exception:
            log.exception("kv_tcp_transfer_crashed")
        finally:
            self._slots.release()

    def _transfer(self, connection: socket.socket) -> None:
        started = time.perf_counter()
        connection.settimeout(HEADER_TIMEOUT_S)
        try:
            first = decode_pb2.SyncCacheRequest.FromString(
                recv_frame(connection, self.max_header_bytes)
            )
        except (OSError, DecodeError) as error:
            self._refuse(connection, f"no header: {error}")
            return
        if first.WhichOneof("part") != "header":
            self._refuse(connection, "the first message is not a header")
            return
        header = first.header
        try:
            lease, receiver = self._on_loop(
                lambda: self.transfers.begin(header, None, is_token_only=True)
            )
        except PdserveError as error:
            # NOTE: a wrong or used token learns nothing; an expired lease is said so.
            if error.reason is not ErrorReason.PERMISSION_DENIED:
                self._answer(connection, error)
            self._refuse(connection, error.message)
            return
        connection.settimeout(self.data_timeout_s)
        try:
            commit = self._receive(connection, receiver)
            self.transfers.wait_constraint_compiled(lease, self.data_timeout_s)
            response = self._on_loop(
                lambda: self.transfers.commit(lease, receiver, header, commit, started)
            )
        except PdserveError as error:
            self._fail(lease, error)
            self._answer(connection, error)
            return
        except (OSError, DecodeError) as error:
            log.info("kv_tcp_connection_broken", lease_id=lease.lease_id, detail=repr(error))
            broken = PdserveError(
                ErrorReason.CACHE_SYNC_FAILED, "the prefill's TCP connection broke mid-transfer"
            )
            self._fail(lease, broken)
            return
        finally:
            self._on_loop(lambda: self.transfers.end(lease))
        self.num_transfers += 1
        connection.sendall(frame(decode_pb2.KvTcpResult(response=response).SerializeToString()))

    def _receive(
        self, connection: socket.socket, receiver: KvReceiver
    ) -> decode_pb2.SyncCacheCommit:
        """Reads chunks into the cache until the commit; returns the commit once every chunk's
        checksum (computed on a worker while the next chunk arrives) matched."""
        checks: list[tuple[KvChunkMeta, Future[int]]] = []
        while True:
            message = decode_pb2.SyncCacheRequest.FromString(
                recv_frame(connection, MAX_CHUNK_MESSAGE_BYTES)
            )
            part = message.WhichOneof("part")
            if part == "commit":
                for meta, crc in checks:
                    receiver.receive_written(meta, crc.result())
                return message.commit
            if part != "chunk" or message.chunk.key or message.chunk.value:
                raise receiver.failure(f"unexpected {part or 'empty'} message on the data port")
            c = message.chunk
            meta = KvChunkMeta(c.layer_index, c.first_block, c.num_blocks, c.crc32c)
            receiver.fill(meta, lambda view: recv_exactly_into(connection, view))
            checks.append((meta, CHECKSUM_WORKERS.submit(receiver.crc_in_cache, meta)))

    def _fail(self, lease: DecodeRequest, error: PdserveError) -> None:
        self._on_loop(lambda: self.transfers.fail(lease, error))

    def _on_loop(self, call: Callable[[], T]) -> T:
        """Runs `call` on the event loop and returns its result (or raises its error)."""

        async def run() -> T:
            return call()

        assert self.aio_loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(run(), self.aio_loop).result()

    def _refuse(self, connection: socket.socket, detail: str) -> None:
        self.num_refused += 1
        log.warning("kv_tcp_refused", detail=detail, num_refused=self.num_refused)
        connection.close()

    @staticmethod
    def _answer(connection: socket.socket, error: PdserveError) -> None:
        result = decode_pb2.KvTcpResult(
            error_reason=f"ERROR_REASON_{error.reason.name}",
            error_message=error.message,
        )
        with contextlib.suppress(OSError):  # the sender is gone: nothing to tell
            connection.sendall(frame(result.SerializeToString()))
