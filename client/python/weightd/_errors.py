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


class LayoutNotFound(WeightdError):
    """attach(..., layout=KEY): the model's current generation has no layout KEY
    for that rank (NOT_FOUND). The message names the keys that exist for it, so
    an engine can tell a first start (load, post-process, publish) from a typo."""


class LayoutMismatch(WeightdError):
    """attach(..., layout=KEY, identity=...): KEY was published with another
    identity (FAILED_PRECONDITION). The message names every field that differs;
    there is no fall-back: publish under another key, or drop the old layout."""


# How the daemon words the two (server/registry/registry_layouts.cc).
_LAYOUT_MISSING = " has no layout "
_IDENTITY_DIFFERS = " was published with another identity: "


def layout_error(error: WeightdError) -> WeightdError:
    """`error` of an Attach that named a layout, as LayoutNotFound or
    LayoutMismatch when it is one of those; unchanged otherwise (a missing
    model stays a plain NOT_FOUND)."""
    if error.code == grpc.StatusCode.NOT_FOUND and _LAYOUT_MISSING in error.message:
        return LayoutNotFound(error.code, error.message)
    if error.code == grpc.StatusCode.FAILED_PRECONDITION and _IDENTITY_DIFFERS in error.message:
        return LayoutMismatch(error.code, error.message)
    return error
