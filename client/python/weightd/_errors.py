"""The one exception type of the weightd Python client."""
from __future__ import annotations

from typing import Dict

import grpc

_CODES: Dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


class WeightdError(Exception):
    """An error from the daemon (or from reaching it).

    `code` is a grpc.StatusCode (NOT_FOUND, INVALID_ARGUMENT, UNAVAILABLE, ...)
    chosen by what the caller should do; `message` is the daemon's message,
    which names what was wrong and where.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> WeightdError:
        """Wraps a grpc.RpcError raised by a stub call."""
        return cls(error.code(), error.details() or "")

    @classmethod
    def from_number(cls, number: int, message: str) -> WeightdError:
        """Wraps a numeric gRPC code (as sent on the fd socket)."""
        return cls(_CODES.get(number, grpc.StatusCode.UNKNOWN), message)
