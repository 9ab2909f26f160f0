"""WatchModel: a model name's events as an iterator over the gRPC stream."""
from __future__ import annotations

import threading
from typing import Any, Callable

import grpc

from ._errors import WeightdError
from ._types import WatchEvent

# The initial metadata the daemon sends once the subscription is in place
# (docs/api.md "WatchModel"); a refusal ends the call without it.
_SUBSCRIBED = ("weightd-watch", "subscribed")


class Watch:
    """An iterator of WatchEvent for one model name (from Client.watch).

    Iterating blocks until the next event. The iteration ends (StopIteration)
    after cancel() or close(); any other end of the stream raises WeightdError:
    UNAVAILABLE when the daemon went away or is stopping, RESOURCE_EXHAUSTED
    when it dropped this watch for falling behind. Watch again to resume: the
    first event is then CURRENT. cancel() may be called from any thread;
    leaving a `with` block cancels.
    """

    def __init__(self, call: Any) -> None:
        self._call = call  # the grpc streaming call
        self._cancelled = threading.Event()

    @classmethod
    def start(cls, method: Callable[[Any], Any], request: Any) -> Watch:
        call = method(request)
        metadata = call.initial_metadata() or ()  # blocks until subscribed or refused
        if _SUBSCRIBED not in tuple(metadata):
            code = call.code()
            if code is None or code == grpc.StatusCode.OK:
                call.cancel()
                raise WeightdError(grpc.StatusCode.UNIMPLEMENTED, "the daemon does not serve WatchModel")
            raise WeightdError(code, call.details() or "")
        return cls(call)

    def __iter__(self) -> Watch:
        return self

    def __next__(self) -> WatchEvent:
        try:
            return WatchEvent.from_proto(next(self._call))
        except StopIteration:
            if self._cancelled.is_set():
                raise
            raise WeightdError(grpc.StatusCode.UNAVAILABLE, "the daemon ended the watch") from None
        except grpc.RpcError as e:
            if self._cancelled.is_set() and e.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise WeightdError.from_rpc(e) from None

    def cancel(self) -> None:
        """Ends the stream: an iteration blocked in another thread stops."""
        self._cancelled.set()
        self._call.cancel()

    close = cancel

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()
