"""What a writer of the daemon's staged memfds does, whatever it publishes:
an update of a generation (_update.Update) or a runtime layout
(_layout.LayoutWriter). Both get writable memfds over the fd socket, whose
connection is the lease; both must unmap them before the commit (the daemon
seals them with F_SEAL_WRITE, refused while any writable mapping exists),
and both end by closing the fds and the connection (docs/api.md).
"""
from __future__ import annotations

import gc
import mmap
import os
from types import TracebackType
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Set, Type

import grpc

from ._errors import WeightdError
from ._types import TensorInfo

if TYPE_CHECKING:
    import socket

# The daemon's words for a commit refused because a staged memfd is still
# mapped writable somewhere (common/memory/host_segment.cc): the writer stays
# open then, as it does for INVALID_ARGUMENT (a bad label or hash).
_STILL_MAPPED = "still mapped writable"


def leaves_writer_open(error: WeightdError) -> bool:
    """Whether the daemon left the update or publish open after refusing its commit with `error`."""
    return error.code == grpc.StatusCode.INVALID_ARGUMENT or (
        error.code == grpc.StatusCode.FAILED_PRECONDITION and _STILL_MAPPED in error.message)


class StagedWriter:
    """The staged memfds of one open writer, their mappings and its fd-socket connection.

    Subclasses say what they are in messages (`_what`, `_segment_word`,
    `_holder_word`) and how the daemon aborts them (`_abort_rpc`).
    Thread-safety: as Update's and LayoutWriter's.
    """

    _segment_word = "staged segment"  # how messages name one memfd
    _holder_word = "it"               # "taken from <holder>"
    _kind = "it"                      # "<kind> is still open"

    def __init__(self, stub: Any, connection: Optional[socket.socket], fds: Sequence[int],
                 sizes: Sequence[int]) -> None:
        self._stub = stub
        self._connection = connection  # the writer's lease: closing it aborts what is not committed
        self._fds = list(fds)  # one per staged memfd, kept to map again after a refused commit
        self._sizes: List[int] = list(sizes)
        self._maps: List[Optional[mmap.mmap]] = [None] * len(self._sizes)  # made on first use
        self._handed_out: List[Set[str]] = [set() for _ in self._sizes]  # tensor names given out, by memfd
        self._ended = False

    # ------------------------------------------------------------ what subclasses say

    def _what(self) -> str:
        """"the update of 'llama'", "layout 'k' of 'llama'"."""
        raise NotImplementedError

    def _abort_rpc(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ mappings

    def _check_inside(self, info: TensorInfo, what: str) -> None:
        if info.segment >= len(self._sizes) or info.offset + info.nbytes > self._sizes[info.segment]:
            self._release()
            raise WeightdError(grpc.StatusCode.INTERNAL, f"{what} {info.name!r} lies outside its {self._segment_word}")

    def _view(self, info: TensorInfo) -> memoryview:
        self._check_open()
        if info.nbytes == 0:
            return memoryview(bytearray())  # nothing to write, nothing to map
        mapping = self._mapping(info.segment)
        self._handed_out[info.segment].add(info.name)
        return memoryview(mapping)[info.offset:info.offset + info.nbytes]

    def _mapping(self, segment: int) -> mmap.mmap:
        """The mapping of staged memfd `segment` (non-empty), made on first use."""
        mapping = self._maps[segment]
        if mapping is None:
            try:
                # MAP_POPULATE (Linux, Python 3.10+): the staged pages exist; map them up front
                # instead of taking one page fault per 4 KiB page while writing.
                flags: int = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                mapping = self._maps[segment] = mmap.mmap(self._fds[segment], self._sizes[segment], flags,
                                                          mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:
                # EPERM: an earlier commit attempt sealed this memfd already.
                raise WeightdError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"{self._segment_word} {segment} of {self._what()} cannot be mapped writable: "
                                   f"{e.strerror or e}") from None
        return mapping

    # ------------------------------------------------------------ abort and lifetime

    def abort(self) -> None:
        """Ends it with nothing published. Idempotent.

        Tensors still referenced keep their (now private) memory until dropped.
        Raises WeightdError only for an unreachable daemon; it ends anyway,
        since closing the fd-socket connection aborts it.
        """
        if self._ended:
            return
        self._unmap(strict=False)
        try:
            self._abort_rpc()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: the daemon ended it already
                raise WeightdError.from_rpc(e) from None
        finally:
            self._end()

    @property
    def closed(self) -> bool:
        """Whether it was committed or aborted."""
        return self._ended

    def commit(self) -> Any:
        raise NotImplementedError

    def _commit_rpc(self, call: Any, request: Any) -> Any:
        """Unmaps every staged memfd (the daemon seals only memory no process
        maps writable), then sends `request` through `call` (the stub's
        CommitUpdate or CommitLayout) and returns its response. A refusal the
        daemon leaves open (leaves_writer_open) keeps this writer open;
        anything else ends it. Raises WeightdError."""
        self._check_open()
        self._unmap()
        try:
            response = call(request)
        except grpc.RpcError as e:
            error = WeightdError.from_rpc(e)
            if not leaves_writer_open(error):
                self._end()
            raise error from None
        self._end()
        return response

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        if self._ended:
            return
        if exc_type is None:
            self.commit()
            return
        try:
            self.abort()
        except WeightdError:
            pass  # the block's own exception matters more; the connection closed, so it ended

    def __del__(self) -> None:
        # Not committed: closing the connection makes the daemon abort it.
        if not getattr(self, "_ended", True):
            try:
                self._unmap(strict=False)
                self._end()
            except Exception:
                pass  # interpreter shutdown: the kernel closes the connection at exit

    # ------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._ended:
            raise WeightdError(grpc.StatusCode.FAILED_PRECONDITION, f"{self._what()} was already committed or aborted")

    def _unmap(self, strict: bool = True) -> None:
        """Closes every mapping. strict: raise when one is still in use (after
        one garbage collection, for tensors held only by reference cycles)."""
        busy = self._close_maps()
        if busy and strict:
            gc.collect()
            busy = self._close_maps()
            if busy:
                names = sorted(set().union(*(self._handed_out[i] for i in busy)))
                raise WeightdError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"cannot commit {self._what()}: {len(busy)} {self._segment_word}(s) are still mapped by tensors "
                    f"or buffers taken from {self._holder_word} (among {', '.join(map(repr, names))}); drop every "
                    f"reference to them (del the tensors, release the memoryviews) and call commit() again. "
                    f"Nothing was sent to the daemon; {self._kind} is still open")
        if not strict:
            self._maps = [None] * len(self._maps)  # the last tensor still holding one unmaps it when dropped

    def _close_maps(self) -> List[int]:
        busy = []
        for i, mapping in enumerate(self._maps):
            if mapping is None:
                continue
            try:
                mapping.close()
            except BufferError:
                busy.append(i)
                continue
            self._maps[i] = None
            self._handed_out[i].clear()
        return busy

    def _end(self) -> None:
        self._ended = True
        self._release()

    def _release(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
        if self._connection is not None:
            self._connection.close()  # kept, closed (fileno() -1): the lease ended
