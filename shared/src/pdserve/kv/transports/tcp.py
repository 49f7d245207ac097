"""Framing of the TCP KV transport, for both ends: length-prefixed messages on a blocking
socket, and reads straight into a caller's buffer.

Every message is a 4-byte big-endian length and that many bytes (a serialized protobuf
message; which one is the contract's business, `TRANSPORT_KIND_TCP` in decode.proto). A
chunk's K and V bytes follow its message raw and are read with `recv_exactly_into`, so they land
where the caller points (the decode's cache) without an intermediate buffer.
"""

from __future__ import annotations

import socket
import struct

LENGTH = struct.Struct(">I")


class FrameError(ConnectionError):
    """The peer closed the connection mid-message, or sent a message over the limit."""


def frame(payload: bytes) -> bytes:
    """`payload` with its length prefix."""
    return LENGTH.pack(len(payload)) + payload


def recv_exactly_into(sock: socket.socket, view: memoryview) -> None:
    """Fills `view` from `sock`.

    Raises:
        FrameError: The peer closed the connection first.
        OSError: The socket failed or timed out.
    """
    view = view.cast("B")
    received = 0
    while received < len(view):
        count = sock.recv_into(view[received:])
        if count == 0:
            raise FrameError(f"connection closed after {received} of {len(view)} bytes")
        received += count


def recv_frame(sock: socket.socket, max_bytes: int) -> bytes:
    """The next message's bytes.

    Raises:
        FrameError: The peer closed the connection, or the message is longer than `max_bytes`.
        OSError: The socket failed or timed out.
    """
    prefix = bytearray(LENGTH.size)
    recv_exactly_into(sock, memoryview(prefix))
    (length,) = LENGTH.unpack(prefix)
    if length > max_bytes:
        raise FrameError(f"a {length}-byte message, the limit is {max_bytes}")
    payload = bytearray(length)
    recv_exactly_into(sock, memoryview(payload))
    return bytes(payload)
