"""The fd-socket side of a lease (see server/listen/fd_channel.h), in pure Python.

The messages follow the grammar of docs/api.md ("The fd channel"), which
common/transport/fd_channel_codec.h implements for the daemon and the C++ client:
client -> daemon "CLAIM <lease_id>"; daemon -> client "OK <n>" with the first
fds as SCM_RIGHTS, then "MORE" messages with the rest, or "ERR <code> <msg>".
The connection is the lease: it ends when the socket is closed.
"""
from __future__ import annotations

import array
import os
import re
import socket
from typing import List, Optional, Tuple, Union

from ._errors import WeightdError

_MAX_MESSAGE = 4096
_MAX_FDS_PER_MESSAGE = 250
_MAX_FDS_PER_CLAIM = 1 << 20
_ANCILLARY_SPACE = socket.CMSG_SPACE(_MAX_FDS_PER_MESSAGE * array.array("i").itemsize)
_OK = re.compile(r"OK ([0-9]{1,20})", re.ASCII)
_ERR = re.compile(r"ERR ([0-9]{1,20})(?: (.*))?", re.ASCII | re.DOTALL)

# (kind, value): ("CLAIM", lease_id), ("OK", n), ("MORE", None) or ("ERR", (code, message)).
Message = Tuple[str, Union[str, int, None, Tuple[int, str]]]


def parse_message(payload: str) -> Message:
    """One fd-channel message: ("CLAIM", lease_id), ("OK", n), ("MORE", None)
    or ("ERR", (code, message)). Raises ValueError for anything the grammar
    does not produce (as ParseFdChannelMessage refuses it)."""
    if len(payload.encode("utf-8", "surrogateescape")) > _MAX_MESSAGE:
        raise ValueError(f"fd-channel message over {_MAX_MESSAGE} bytes")
    if payload == "MORE":
        return "MORE", None
    ok, err = _OK.fullmatch(payload), _ERR.fullmatch(payload)
    if ok and int(ok.group(1)) <= _MAX_FDS_PER_CLAIM:
        return "OK", int(ok.group(1))
    if err and 1 <= int(err.group(1)) <= 16:
        return "ERR", (int(err.group(1)), err.group(2) or "")
    if payload.startswith("CLAIM ") and len(payload) > len("CLAIM "):
        return "CLAIM", payload[len("CLAIM "):]
    raise ValueError(f"malformed fd-channel message {payload[:64]!r}")


def _receive(sock: socket.socket, fds: List[int]) -> str:
    data, ancdata, flags, _ = sock.recvmsg(_MAX_MESSAGE, _ANCILLARY_SPACE, socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
            fds.extend(received)
    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        raise WeightdError.from_number(13, "fd socket: message or fds truncated")
    if not data and not ancdata:
        raise WeightdError.from_number(14, "fd socket: the daemon closed the connection")
    return data.decode("utf-8", "replace")


def claim(path: str, lease_id: str, timeout_seconds: float) -> Tuple[socket.socket, List[int]]:
    """Claims `lease_id` on the fd socket at `path`.

    Returns (connection, fds): the caller owns both; keep the connection open
    for as long as the lease must live, and close the fds once mapped.
    Raises WeightdError (the daemon's code for ERR replies, UNAVAILABLE when
    the socket cannot be reached, INTERNAL for protocol errors).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    fds: List[int] = []
    try:
        sock.settimeout(timeout_seconds if timeout_seconds > 0 else None)
        try:
            sock.connect(path)
        except OSError as e:
            raise WeightdError.from_number(14, f"fd socket {path}: {e.strerror or e}") from e
        try:
            expected = _announced(_send_claim(sock, lease_id, fds))
            _receive_more(sock, fds, expected)
        except OSError as e:  # includes the timeout
            raise WeightdError.from_number(14, f"fd socket {path}: claiming lease: {e.strerror or e}") from e
        if len(fds) != expected:
            raise WeightdError.from_number(13, f"fd socket: received {len(fds)} fds, {expected} announced")
        sock.settimeout(None)
        return sock, fds
    except BaseException:
        for fd in fds:
            _close_quietly(fd)
        sock.close()
        raise


def _send_claim(sock: socket.socket, lease_id: str, fds: List[int]) -> str:
    """Sends CLAIM and returns the daemon's first reply.

    A daemon that refused the connection may have closed it before reading
    CLAIM: the kernel then fails the send (EPIPE) or the first receive
    (ECONNRESET) although the "ERR" line is still queued, so one more look
    finds the daemon's reason.
    """
    try:
        sock.sendall(f"CLAIM {lease_id}".encode())
        return _receive(sock, fds)
    except (BrokenPipeError, ConnectionResetError):
        queued = _queued_reply(sock, fds)
        if queued is None:
            raise
        return queued


def _queued_reply(sock: socket.socket, fds: List[int]) -> Optional[str]:
    """An "ERR ..." message already queued on `sock`, or None."""
    try:
        sock.setblocking(False)
        reply = _receive(sock, fds)
    except (OSError, WeightdError):
        return None
    return reply if _kind(reply) == "ERR" else None


def _kind(message: str) -> Optional[str]:
    try:
        return parse_message(message)[0]
    except ValueError:
        return None


def _announced(reply: str) -> int:
    """The fd count of an "OK <n>" reply; raises the daemon's error for "ERR"."""
    try:
        kind, value = parse_message(reply)
    except ValueError:
        kind, value = "", None
    if kind == "ERR" and isinstance(value, tuple):
        raise WeightdError.from_number(value[0], f"fd socket: {value[1]}")
    if kind != "OK" or not isinstance(value, int):
        raise WeightdError.from_number(13, f"fd socket: unexpected reply {reply!r}")
    return value


def _receive_more(sock: socket.socket, fds: List[int], expected: int) -> None:
    """Receives "MORE" messages until `expected` fds have arrived (or one brings none)."""
    while len(fds) < expected:
        before = len(fds)
        if _kind(_receive(sock, fds)) != "MORE":
            raise WeightdError.from_number(13, "fd socket: expected MORE")
        if len(fds) == before:
            break  # reported by the caller as a count mismatch


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
