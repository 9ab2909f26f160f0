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

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

from . import _torch
from ._staged import StagedWriter
from ._types import CommitResult, ModelInfo, TensorInfo
from .v1 import weightd_pb2 as pb

if TYPE_CHECKING:
    import socket

    import torch


class Update(StagedWriter):
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
        super().__init__(stub, connection, fds, [seg.size for seg in response.segments])
        self._tensors: Dict[Tuple[str, int], TensorInfo] = {}
        for t in response.tensors:
            info = TensorInfo.from_proto(t.entry)
            self._check_inside(info, "update tensor")
            self._tensors[(info.name, t.rank)] = info

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
        request = pb.CommitUpdateRequest(update_id=self.update_id, expected_hashes=dict(expected_hashes or {}),
                                         version_label=(self.version_label if version_label is None
                                                        else version_label) or "")
        response = self._commit_rpc(self._stub.CommitUpdate, request)
        return CommitResult(ModelInfo.from_proto(response.model), response.tensors_changed, response.bytes_written,
                            response.bytes_shared, response.seconds)

    def __enter__(self) -> Update:
        return self

    def __repr__(self) -> str:
        state = "closed" if self._ended else f"{len(self._tensors)} tensors, open"
        return f"<weightd.Update of {self.model!r} from generation {self.base_generation}: {state}>"

    # ------------------------------------------------------------ what StagedWriter says

    _kind = "the update"

    def _what(self) -> str:
        return f"the update of {self.model!r}"

    def _abort_rpc(self) -> None:
        self._stub.AbortUpdate(pb.AbortUpdateRequest(update_id=self.update_id))
