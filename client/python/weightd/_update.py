"""The writer path: an Update maps a model's staged segments read-write and
commits them as the next generation (docs/api.md, "Publishing a generation
from a writer").

Mappings are Python's own `mmap.mmap` (MAP_SHARED, PROT_READ | PROT_WRITE),
made lazily per staged segment on first use. Every tensor or buffer handed
out holds a memoryview of its mapping, so `mmap.close()` refuses
(BufferError) while one is alive: commit() can tell whether it really
unmapped everything (the daemon seals only memory no process maps writable),
and no tensor ever points at memory that was unmapped under it.
"""
from __future__ import annotations

import gc
import mmap
import os
from types import TracebackType
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Type

import grpc

from . import _torch
from ._errors import WeightdError
from ._types import CommitResult, ModelInfo, TensorInfo
from .v1 import weightd_pb2 as pb

if TYPE_CHECKING:
    import socket

    import torch

# The daemon's words for a commit refused because a staged segment is still
# mapped writable somewhere (common/memory/host_segment.cc): it keeps the
# update open then, as it does for INVALID_ARGUMENT (a bad label or hash).
_STILL_MAPPED = "still mapped writable"


class Update:
    """One writer's open update of a model (from Client.update).

        with client.update("llama", tensors=["w"]) as up:
            up["w"].copy_(new_w)          # a writable torch.Tensor over the staged memory
        # committed here; an exception in the block aborts instead

    `up[name]` is rank 0's tensor as a writable torch.Tensor (imports
    torch); `up.buffer(name)` the same bytes as a writable memoryview, no
    torch needed. Writes go straight into the daemon's staged memory: one
    copy. Tensors not written keep the values of `base_generation`.

    Lifetime: the update is open until commit(), abort(), the end of a
    `with` block, or this object being freed (its fd-socket connection then
    closes and the daemon aborts the update). commit() needs every tensor
    and buffer taken from the update dropped first: a `with` block keeping
    one in a variable must `del` it before the block ends, else the commit
    raises WeightdError and the update stays open (commit() again once
    they are dropped, or abort()).
    Thread-safety: tensors may be written from several threads; commit()
    and abort() must be called from one thread, after those writes.
    """

    def __init__(self, stub: Any, response: Any, connection: socket.socket, fds: Sequence[int],
                 version_label: Optional[str] = None) -> None:
        # stub: the WeightdStub; response: the pb.BeginUpdateResponse
        self.model: str = response.model
        self.update_id: str = response.update_id
        self.base_generation: int = response.base_generation
        self.bytes_staged: int = response.bytes_staged  # bytes the daemon copied into the staged segments
        self.bytes_shared: int = response.bytes_shared  # bytes of segments shared unchanged with the base
        self.version_label = version_label  # commit()'s label when it is given none
        self._stub = stub
        self._connection = connection  # the update's lease: closing it aborts an update not committed
        self._fds = list(fds)  # one per staged segment, kept to map again after a refused commit
        self._sizes: List[int] = [s.size for s in response.segments]
        # mmap.mmap per staged segment, made on first use
        self._maps: List[Optional[mmap.mmap]] = [None] * len(self._sizes)
        self._handed_out: List[Set[str]] = [set() for _ in self._sizes]  # tensor names given out, by segment
        self._tensors: Dict[Tuple[str, int], TensorInfo] = {}
        for t in response.tensors:
            info = TensorInfo.from_proto(t.entry)
            if info.segment >= len(self._sizes) or info.offset + info.nbytes > self._sizes[info.segment]:
                self._release()
                raise WeightdError(grpc.StatusCode.INTERNAL,
                                   f"update tensor {info.name!r} lies outside its staged segment")
            self._tensors[(info.name, t.rank)] = info
        self._ended = False

    # ------------------------------------------------------------ tensors

    @property
    def tensors(self) -> List[str]:
        """The names of the tensors this update may write, in the daemon's order."""
        return list(dict.fromkeys(name for name, _ in self._tensors))

    def __contains__(self, name: object) -> bool:
        return (name, 0) in self._tensors

    def tensor_info(self, name: str, rank: int = 0) -> TensorInfo:
        """The TensorInfo of `name` (its `segment` indexes the staged segments); KeyError if not in the update."""
        try:
            return self._tensors[(name, rank)]
        except KeyError:
            raise KeyError(f"tensor {name!r} (rank {rank}) is not in this update of {self.model!r}") from None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensor(name)

    def tensor(self, name: str, rank: int = 0) -> torch.Tensor:
        """A writable torch.Tensor of `name`'s dtype and shape over the staged memory (no copy).

        Raises UnsupportedDtypeError when torch has no such dtype (use buffer()).
        """
        self._check_open()
        try:
            import torch
        except ImportError as e:
            raise ImportError(f"Update[name] returns a torch.Tensor and needs torch ({e}); "
                              "Update.buffer(name) gives a writable memoryview without it") from None
        info = self.tensor_info(name, rank)
        try:
            dtype = _torch.torch_dtype(info.dtype)
        except _torch.UnsupportedDtypeError as e:
            raise _torch.UnsupportedDtypeError(f"tensor {name!r}: {e}; Update.buffer() gives its bytes") from None
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype)  # nothing to write, nothing to map
        raw = torch.frombuffer(self._view(info), dtype=torch.uint8)
        return raw.view(dtype).view(info.shape)

    def buffer(self, name: str, rank: int = 0) -> memoryview:
        """`name`'s bytes as a writable 1-D memoryview of unsigned bytes over the staged memory (no copy).

        Release it (`del`, or memoryview.release()) before commit().
        """
        return self._view(self.tensor_info(name, rank))

    def _view(self, info: TensorInfo) -> memoryview:
        self._check_open()
        if info.nbytes == 0:
            return memoryview(bytearray())  # nothing to write, nothing to map
        mapping = self._mapping(info.segment)
        self._handed_out[info.segment].add(info.name)
        return memoryview(mapping)[info.offset:info.offset + info.nbytes]

    def _mapping(self, segment: int) -> mmap.mmap:
        """The mapping of staged segment `segment` (non-empty), made on first use."""
        mapping = self._maps[segment]
        if mapping is None:
            try:
                # MAP_POPULATE (Linux, Python 3.10+): the staged pages exist; map them up front
                # instead of taking one page fault per 4 KiB page while writing.
                flags: int = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                mapping = self._maps[segment] = mmap.mmap(self._fds[segment], self._sizes[segment], flags,
                                                          mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:
                # EPERM: an earlier commit attempt sealed this segment already.
                raise WeightdError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"staged segment {segment} of the update of {self.model!r} cannot be mapped "
                                   f"writable: {e.strerror or e}") from None
        return mapping

    # ------------------------------------------------------------ commit / abort

    def commit(self, expected_hashes: Optional[Mapping[str, str]] = None,
               version_label: Optional[str] = None) -> CommitResult:
        """Unmaps every staged segment, then asks the daemon to seal, verify and
        publish them as the next generation; returns a CommitResult.

        expected_hashes: {tensor name: 16 hex digits} (TensorInfo.content_hash
        spelling) the written tensors must have. version_label: at most 128
        printable ASCII characters, e.g. f"step-{step}"; None: the one given
        to Client.update (none: an empty label).

        Raises WeightdError:
         - FAILED_PRECONDITION before any RPC when a tensor or buffer taken
           from this update is still referenced (its mapping cannot be
           closed): drop them and call commit() again; the update stays open;
         - the daemon's error otherwise. INVALID_ARGUMENT (bad label or hash
           spelling) and FAILED_PRECONDITION "still mapped writable" (another
           process maps a staged segment) leave the update open; anything
           else ends it (FAILED_PRECONDITION naming a tensor whose hash
           differs or that changed outside the update, or when the model
           was reloaded meanwhile; NOT_FOUND when the daemon already
           aborted it), and the served generation stays as it was.
        """
        self._check_open()
        self._unmap()
        request = pb.CommitUpdateRequest(update_id=self.update_id, expected_hashes=dict(expected_hashes or {}),
                                         version_label=(self.version_label if version_label is None
                                                        else version_label) or "")
        try:
            response = self._stub.CommitUpdate(request)
        except grpc.RpcError as e:
            error = WeightdError.from_rpc(e)
            if not _leaves_update_open(error):
                self._end()
            raise error from None
        self._end()
        return CommitResult(ModelInfo.from_proto(response.model), response.tensors_changed, response.bytes_written,
                            response.bytes_shared, response.seconds)

    def abort(self) -> None:
        """Ends the update; the served generation is untouched. Idempotent.

        Tensors still referenced keep their (now private) memory until dropped.
        Raises WeightdError only for an unreachable daemon; the update ends
        anyway, since closing the fd-socket connection aborts it.
        """
        if self._ended:
            return
        self._unmap(strict=False)
        try:
            self._stub.AbortUpdate(pb.AbortUpdateRequest(update_id=self.update_id))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: the daemon ended it already
                raise WeightdError.from_rpc(e) from None
        finally:
            self._end()

    @property
    def closed(self) -> bool:
        """Whether the update was committed or aborted."""
        return self._ended

    def __enter__(self) -> Update:
        return self

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
            pass  # the block's own exception matters more; the connection closed, so the update ended

    def __del__(self) -> None:
        # Not committed: closing the connection makes the daemon abort it.
        if not getattr(self, "_ended", True):
            try:
                self._unmap(strict=False)
                self._end()
            except Exception:
                pass  # interpreter shutdown: the kernel closes the connection at exit

    def __repr__(self) -> str:
        state = "closed" if self._ended else f"{len(self._tensors)} tensors, open"
        return f"<weightd.Update of {self.model!r} from generation {self.base_generation}: {state}>"

    # ------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._ended:
            raise WeightdError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the update of {self.model!r} was already committed or aborted")

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
                    f"cannot commit the update of {self.model!r}: {len(busy)} staged segment(s) are still mapped "
                    f"by tensors or buffers taken from it (among {', '.join(map(repr, names))}); drop every "
                    f"reference to them (del the tensors, release the memoryviews) and call commit() again. "
                    f"Nothing was sent to the daemon; the update is still open")
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
        self._connection.close()


def _leaves_update_open(error: WeightdError) -> bool:
    return error.code == grpc.StatusCode.INVALID_ARGUMENT or (
        error.code == grpc.StatusCode.FAILED_PRECONDITION and _STILL_MAPPED in error.message)
