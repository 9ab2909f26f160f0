"""The fd-socket side of a lease (see server/fd_channel.h), in pure Python.

client -> daemon "CLAIM <lease_id>"; daemon -> client "OK <n>" with the first
fds as SCM_RIGHTS, then "MORE" messages with the rest, or "ERR <code> <msg>".
The connection is the lease: it ends when the socket is closed.
"""
import array
import os
import socket

from ._errors import WeightdError

_MAX_MESSAGE = 4096
_MAX_FDS_PER_MESSAGE = 250
_ANCILLARY_SPACE = socket.CMSG_SPACE(_MAX_FDS_PER_MESSAGE * array.array("i").itemsize)


def _receive(sock, fds):
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


def claim(path, lease_id, timeout_seconds):
    """Claims `lease_id` on the fd socket at `path`.

    Returns (connection, fds): the caller owns both; keep the connection open
    for as long as the lease must live, and close the fds once mapped.
    Raises WeightdError (the daemon's code for ERR replies, UNAVAILABLE when
    the socket cannot be reached, INTERNAL for protocol errors).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    fds = []
    try:
        sock.settimeout(timeout_seconds if timeout_seconds > 0 else None)
        try:
            sock.connect(path)
        except OSError as e:
            raise WeightdError.from_number(14, f"fd socket {path}: {e.strerror or e}") from e
        try:
            reply = _send_claim(sock, lease_id, fds)
            more = []
            while len(fds) < _announced(reply):
                before = len(fds)
                more.append(_receive(sock, fds))
                if len(fds) == before:
                    break  # reported below as a count mismatch
        except OSError as e:  # includes the timeout
            raise WeightdError.from_number(14, f"fd socket {path}: claiming lease: {e.strerror or e}") from e
        if reply.startswith("ERR "):
            code, _, message = reply[4:].partition(" ")
            raise WeightdError.from_number(int(code) if code.isdigit() else 2, f"fd socket: {message}")
        expected = _announced(reply)
        if expected < 0:
            raise WeightdError.from_number(13, f"fd socket: unexpected reply {reply!r}")
        if any(m != "MORE" for m in more):
            raise WeightdError.from_number(13, "fd socket: expected MORE")
        if len(fds) != expected:
            raise WeightdError.from_number(13, f"fd socket: received {len(fds)} fds, {expected} announced")
        sock.settimeout(None)
        return sock, fds
    except BaseException:
        for fd in fds:
            _close_quietly(fd)
        sock.close()
        raise


def _send_claim(sock, lease_id, fds):
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


def _queued_reply(sock, fds):
    """An "ERR ..." message already queued on `sock`, or None."""
    try:
        sock.setblocking(False)
        reply = _receive(sock, fds)
    except (OSError, WeightdError):
        return None
    return reply if reply.startswith("ERR ") else None


def _announced(reply):
    """The fd count of an "OK <n>" reply, -1 for anything else."""
    return int(reply[3:]) if reply.startswith("OK ") and reply[3:].isdigit() else -1


def _close_quietly(fd):
    try:
        os.close(fd)
    except OSError:
        pass
