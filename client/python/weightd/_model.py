"""An attached model: a zero-copy Mapping of tensor name -> Tensor."""
from __future__ import annotations

import collections.abc
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple, TypeVar

import grpc

from . import _native, _torch
from ._errors import WeightdError
from ._types import Manifest, PinProgress, PinState, SegmentInfo, TensorInfo
from .v1 import weightd_pb2 as pb

if TYPE_CHECKING:
    import socket

    import torch

    from ._native import Pinner, Segment, _TensorFields

_CPU = 1  # DLPack kDLCPU
_T = TypeVar("_T")


class TensorTable(Protocol):
    """A rank's tensors, decoded on demand: weightd._native.PackedTable or EntryTable."""

    def __len__(self) -> int: ...
    def index(self) -> Dict[str, int]: ...
    def info(self, i: int) -> _TensorFields: ...
    def first_outside(self, segment_sizes: Sequence[int]) -> int: ...
    def select(self, patterns: Sequence[str]) -> Tuple[List[int], List[Tuple[int, int]]]: ...


class _Lease:
    """One attach's fd-socket connection (the lease) and segment mappings.

    Freed when its last reference goes: the Model holds one and every
    exported DLPack tensor holds one until the framework drops it. Freeing
    closes the connection (the daemon ends the lease) and unmaps the segments.
    """

    __slots__ = ("lease_id", "connection", "segments", "pinner", "pinned")

    def __init__(self, lease_id: str, connection: socket.socket, segments: List[Segment]) -> None:
        self.lease_id = lease_id
        self.connection = connection
        self.segments = segments  # one weightd._native.Segment per manifest segment
        # attach(pin=...): the registration thread, and {table index: its index there}.
        self.pinner: Optional[Pinner] = None
        self.pinned: Dict[int, int] = {}

    def device_ptr(self, index: int) -> int:
        """The device address of tensor `index` of the table when pinned and ready, else 0."""
        j = self.pinned.get(index)
        return self.pinner.device_ptr(j) if self.pinner is not None and j is not None else 0

    def pin_progress(self) -> Optional[PinProgress]:
        if self.pinner is None:
            return None
        (state, bytes_done, bytes_total, chunks_done, chunks_total, tensors, read_only, ordinal, register_seconds,
         seconds, code, message) = self.pinner.progress()
        error = f"{_error_name(code)}: {message}" if code else ""
        return PinProgress(PinState(state), bytes_done, bytes_total, chunks_done, chunks_total, tensors, read_only,
                           ordinal, register_seconds, seconds, error)

    def __del__(self) -> None:
        # The pinned pages are unregistered while still mapped (the pinner
        # waits for a registration in flight). Then segments, explicitly (a
        # Tensor being freed may still hold one): the daemon may free the
        # memory once the lease ends, and a cuda-legacy-ipc arena must be
        # closed before the exporter frees it (CUDA Driver API, cuIpcOpenMemHandle).
        pinner = getattr(self, "pinner", None)
        if pinner is not None:
            pinner.close()
        for segment in getattr(self, "segments", None) or ():
            segment.close()
        connection = getattr(self, "connection", None)
        if connection is not None:
            connection.close()


class _Exporter:
    """Exports one byte range of a segment through DLPack: host memory (kDLCPU,
    mapped read-only, or copy-on-write after attach(private=True)) or a device
    arena (kDLCUDA on this process's ordinal)."""

    __slots__ = ("_lease", "_segment", "_offset", "_nbytes", "_export_dtype", "_export_shape")

    def __init__(self, lease: _Lease, segment: Segment, offset: int, nbytes: int, export_dtype: str,
                 export_shape: Tuple[int, ...]) -> None:
        self._lease = lease
        self._segment = segment
        self._offset = offset
        self._nbytes = nbytes
        self._export_dtype = export_dtype
        self._export_shape = export_shape

    def __dlpack__(self, *, stream: Optional[int] = None, max_version: Optional[Tuple[int, int]] = None,
                   dl_device: Optional[Tuple[int, int]] = None, copy: Optional[bool] = None) -> object:
        # Always a legacy "dltensor" capsule (allowed whatever max_version
        # asks); DLPack 0.6 has no read-only flag, see docs/integration.md.
        # The bytes were complete before the lease was granted, so no stream
        # needs to wait: any `stream` is accepted.
        device = self._segment.device
        if device[0] == _CPU and stream not in (None, -1):
            raise BufferError("this tensor lives in host memory: stream must be None")
        if dl_device is not None and tuple(dl_device) != tuple(device):
            raise BufferError(f"this tensor lives on DLPack device {tuple(device)}, not {tuple(dl_device)}")
        if copy:
            raise BufferError("weightd exports zero-copy views only; copy after importing")
        return self._segment.export(self._offset, self._nbytes, self._export_dtype,
                                    list(self._export_shape), self._lease)

    def __dlpack_device__(self) -> Tuple[int, int]:
        return self._segment.device

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def data_ptr(self) -> int:
        """The address of the first byte in this process (inside one of Model.mappings)."""
        return self._segment.address + self._offset if self._segment.address else 0


def _error_name(code: int) -> str:
    return str(WeightdError.from_number(code, "").code.name)


class PinnedView:
    """A pinned host tensor as GPU memory: exportable with DLPack as kDLCUDA on
    the registering device, at its device pointer (zero-copy; kernels read the
    host pages over the bus). From Tensor.cuda_view(); keeps the lease, the
    mapping and the registration alive until the importer drops it."""

    __slots__ = ("_lease", "_pointer", "_ordinal", "_nbytes", "_export_dtype", "_export_shape", "name")

    def __init__(self, lease: _Lease, pointer: int, ordinal: int, nbytes: int, dtype: str, shape: Tuple[int, ...],
                 name: str) -> None:
        self._lease = lease
        self._pointer = pointer
        self._ordinal = ordinal
        self._nbytes = nbytes
        self._export_dtype = dtype
        self._export_shape = shape
        self.name = name

    @property
    def dtype(self) -> str:
        return self._export_dtype

    @property
    def shape(self) -> Tuple[int, ...]:
        return self._export_shape

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def data_ptr(self) -> int:
        """The device address (Tensor.device_ptr)."""
        return self._pointer

    def __dlpack__(self, *, stream: Optional[int] = None, max_version: Optional[Tuple[int, int]] = None,
                   dl_device: Optional[Tuple[int, int]] = None, copy: Optional[bool] = None) -> object:
        # The pages were registered before the pointer was handed out, so no
        # stream needs to wait: any `stream` is accepted.
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"this view lives on DLPack device {self.__dlpack_device__()}, not {tuple(dl_device)}")
        if copy:
            raise BufferError("weightd exports zero-copy views only; copy after importing")
        return _native.export_pointer(self._pointer, self._nbytes, self._export_dtype, list(self._export_shape),
                                      self._ordinal, self._lease)

    def __dlpack_device__(self) -> Tuple[int, int]:
        return (2, self._ordinal)  # kDLCUDA

    def _carrier(self, dtype: str, shape: Optional[Tuple[int, ...]] = None) -> PinnedView:
        return PinnedView(self._lease, self._pointer, self._ordinal, self._nbytes, dtype,
                          self.shape if shape is None else shape, self.name)

    def to_torch(self) -> torch.Tensor:
        """A torch CUDA tensor over the pinned pages (see Tensor.to_torch_cuda())."""
        return _torch.to_torch_cuda(self)

    def __repr__(self) -> str:
        return f"<weightd.PinnedView {self.name!r} {self.dtype}{list(self.shape)} cuda:{self._ordinal}>"


class Tensor(_Exporter):
    """One tensor of an attached model, exportable with DLPack (zero-copy).

    `torch.from_dlpack(t)` / `numpy.from_dlpack(t)` share weightd's memory.
    F8_E4M3/F8_E5M2 are exported as uint8 of the same shape (DLPack has no
    float8 code here); `to_torch()` gives them their torch float8 dtype.
    The memory is read-only: writing through an imported tensor raises
    SIGSEGV in this process, unless the model was attached with
    private=True: then writes copy the touched pages into this process and
    stay invisible to everyone else (see docs/integration.md).
    """

    __slots__ = ("info", "_index")

    def __init__(self, lease: _Lease, segment: Segment, info: TensorInfo, index: int = -1) -> None:
        super().__init__(lease, segment, info.offset, info.nbytes, info.dtype, info.shape)
        self.info = info
        self._index = index  # in the rank's tensor table

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def dtype(self) -> str:
        """The safetensors dtype: "BF16", "F8_E4M3", ..."""
        return self.info.dtype

    @property
    def shape(self) -> Tuple[int, ...]:
        return self.info.shape

    @property
    def strides(self) -> Tuple[int, ...]:
        """A layout tensor's strides in elements, as published; (): contiguous."""
        return self.info.strides

    def to_torch(self) -> torch.Tensor:
        """A torch.Tensor with the matching torch dtype, sharing this memory (with
        the published strides for a layout tensor that has them)."""
        if not self.info.strides:
            return _torch.to_torch(self)
        # Exported as the 1-D run of elements the strides reach, then strided in place.
        flat = dataclasses.replace(self.info, shape=(self.nbytes // _torch.element_size(self.dtype),), strides=())
        base = _torch.to_torch(Tensor(self._lease, self._segment, flat, self._index))
        return base.as_strided(self.info.shape, self.info.strides)

    @property
    def device_ptr(self) -> int:
        """The device address of a pinned host tensor (attach(..., pin=...)): valid on
        every GPU of this process while the model or a tensor exported from it lives.
        0 until Model.wait_pinned() has returned (pin_progress().state READY), and for
        tensors not pinned (device tensors included: data_ptr() is theirs)."""
        return self._lease.device_ptr(self._index)

    def cuda_view(self) -> PinnedView:
        """This pinned host tensor as a kDLCUDA DLPack exporter at device_ptr, for
        torch.from_dlpack, cupy.from_dlpack, ... (zero-copy: kernels read the host
        pages). WeightdError FAILED_PRECONDITION when it is not pinned or pinning is
        not READY."""
        pointer = self.device_ptr
        if not pointer:
            progress = self._lease.pin_progress()
            if progress is None or progress.state == PinState.READY:
                why = "it is not pinned (attach(..., pin=...))" if self.nbytes else "it has no bytes"
            else:
                why = f"pinning is {progress.state} (Model.wait_pinned() waits for READY)"
            raise WeightdError(grpc.StatusCode.FAILED_PRECONDITION, f"tensor {self.name!r} has no device pointer: {why}")
        progress = self._lease.pin_progress()
        ordinal = progress.device_ordinal if progress is not None else 0
        return PinnedView(self._lease, pointer, ordinal, self.nbytes, self.dtype, self.shape, self.name)

    def to_torch_cuda(self) -> torch.Tensor:
        """A torch CUDA tensor over this pinned host tensor's pages, with the matching
        torch dtype, zero-copy (cuda_view() imported into torch). Needs a CUDA build of
        torch and a GPU: WeightdError FAILED_PRECONDITION saying which is missing."""
        return self.cuda_view().to_torch()

    def raw(self) -> _Exporter:
        """The tensor's bytes as a 1-D uint8 DLPack exporter (any dtype, including F4/F6/F8_E8M0)."""
        return _Exporter(self._lease, self._segment, self._offset, self._nbytes, "U8", (self._nbytes,))

    def _carrier(self, dtype: str, shape: Optional[Tuple[int, ...]] = None) -> _Exporter:
        """The same bytes exported as `dtype` (of `shape`, default the tensor's,
        covering exactly its bytes), to reinterpret after import."""
        return _Exporter(self._lease, self._segment, self._offset, self._nbytes, dtype,
                         self.shape if shape is None else shape)

    def __repr__(self) -> str:
        return f"<weightd.Tensor {self.name!r} {self.dtype}{list(self.shape)}>"


def _decoded(method: Callable[..., _T], *args: int) -> _T:
    """Calls a table method; the native decoder's RuntimeError (a name that is not
    UTF-8: DATA_LOSS) becomes a WeightdError."""
    try:
        return method(*args)
    except RuntimeError as e:
        raise WeightdError.from_number(getattr(e, "code", 15), str(e)) from None


class EntryTable:
    """TensorEntry messages (a daemon that predates the packed table) as a
    TensorTable, like weightd._native.PackedTable."""

    __slots__ = ("_entries",)

    def __init__(self, entries: Sequence[Any]) -> None:
        self._entries = entries  # pb.TensorEntry messages

    def __len__(self) -> int:
        return len(self._entries)

    def index(self) -> Dict[str, int]:
        return {t.name: i for i, t in enumerate(self._entries)}

    def info(self, i: int) -> _TensorFields:
        t = self._entries[i]
        return (t.name, t.dtype, tuple(t.shape), "device" if t.placement == pb.DEVICE else "host", t.segment,
                t.offset, t.nbytes, tuple(t.full_shape), t.split_dim, t.split_start, t.content_hash)

    def strides(self, i: int) -> Tuple[int, ...]:
        """A layout tensor's strides in elements; (): contiguous."""
        return tuple(self._entries[i].strides)

    def select(self, patterns: Sequence[str]) -> Tuple[List[int], List[Tuple[int, int]]]:
        selected: List[int] = []
        counts = [[0, 0] for _ in patterns]
        for i, t in enumerate(self._entries):
            host = t.placement != pb.DEVICE
            hits = [k for k, p in enumerate(patterns) if p in t.name]
            for k in hits:
                counts[k][0 if host else 1] += 1
            if hits and host:
                selected.append(i)
        return selected, [(h, d) for h, d in counts]

    def first_outside(self, segment_sizes: Sequence[int]) -> int:
        for i, t in enumerate(self._entries):
            if t.segment >= len(segment_sizes) or t.offset + t.nbytes > segment_sizes[t.segment]:
                return i
        return -1


class Model(collections.abc.Mapping[str, Tensor]):
    """A leased, mapped model rank: a Mapping from tensor name to Tensor.

    Use it as a context manager or call close(). Tensors taken from it (Tensor
    objects and the framework tensors imported from them) keep the lease and
    the mappings alive after close(): the lease ends when the last of them is
    dropped. Thread-safety: reading from many
    threads is safe; close() must not race other calls.
    """

    def __init__(self, response: Any, lease: _Lease, attach_seconds: float, private: bool = False,
                 table: Optional[TensorTable] = None) -> None:
        # response: the pb.AttachResponse
        self.name: str = response.model
        self.private = private  # attached copy-on-write: tensors are writable
        self.generation: int = response.generation
        self.rank: int = response.rank
        self.fingerprint: str = response.fingerprint
        self.version_label: str = response.version_label  # a writer's tag of the generation; "" for loads from disk
        # The NUMA node whose copy of the host segments is mapped; -1 when the
        # model was not loaded with numa_copies.
        self.numa_node: int = response.numa_node
        self.attach_seconds = attach_seconds  # Attach RPC to all segments mapped
        self._segments = tuple(SegmentInfo.from_proto(s) for s in response.segments)
        # The tensors, decoded on demand: the native packed table, or the protobuf entries.
        self._table: TensorTable = table if table is not None else EntryTable(response.tensors)
        self._index: Optional[Dict[str, int]] = None  # {name: index}, built on first use (_names)
        self._lease: Optional[_Lease] = lease
        self._lease_id = lease.lease_id
        # attach(layout=...): the runtime layout's key and the identity it was published with; else "" and {}.
        self.layout: str = response.layout
        self.identity: Dict[str, str] = dict(response.identity)

    def _info(self, index: int) -> TensorInfo:
        """Tensor `index` of the table as a TensorInfo (with its strides when a layout's)."""
        fields = _decoded(self._table.info, index)
        strides = self._table.strides(index) if isinstance(self._table, EntryTable) else ()
        return TensorInfo(*fields, strides=strides)

    def _names(self) -> Dict[str, int]:
        """{name: index}, built by the first lookup in one native loop (about 0.5 us per
        tensor), so that attach itself does no per-tensor work. Two threads racing here
        build equal dicts; either wins."""
        index = self._index
        if index is None:
            index = self._index = _decoded(self._table.index)
        return index

    # Mapping
    def __getitem__(self, name: str) -> Tensor:
        lease = self._open_lease()
        index = self._names()[name]
        info = self._info(index)
        return Tensor(lease, lease.segments[info.segment], info, index)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._table)  # names are unique within a rank (the daemon refuses duplicates)

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def tensor_info(self, name: str) -> TensorInfo:
        """The manifest entry of `name` (KeyError when this rank has no such tensor)."""
        return self._info(self._names()[name])

    @property
    def manifest(self) -> Manifest:
        return Manifest(self.name, self.generation, self.rank, self.fingerprint, self._segments,
                        tuple(self._info(i) for i in range(len(self._table))),
                        self.version_label)

    @property
    def lease_id(self) -> str:
        return self._lease_id

    @property
    def mappings(self) -> List[Tuple[int, int]]:
        """(address, size) of each mapped segment in this process, in segment order
        (address 0 for an empty segment). A tensor lies in the mapping of its
        TensorInfo.segment; a model has as many host segments as the daemon chose."""
        return [(s.address, s.size) for s in self._open_lease().segments]

    def owns(self, address: int) -> bool:
        """Whether byte `address` of this process lies inside one of this model's mappings."""
        return any(base <= address < base + size for base, size in self.mappings if base)

    # pinned host tables
    def pin_progress(self) -> Optional[PinProgress]:
        """Where the pinning asked by attach(..., pin=...) stands; None without pin."""
        return self._open_lease().pin_progress()

    def wait_pinned(self, timeout: Optional[float] = None) -> PinProgress:
        """Blocks until every pinned tensor is registered with CUDA and returns the
        progress (READY). Raises WeightdError: the failure's code (UNAVAILABLE without a
        CUDA driver or GPU, RESOURCE_EXHAUSTED when the pages cannot be locked, ...),
        DEADLINE_EXCEEDED after `timeout` seconds, FAILED_PRECONDITION when attached
        without pin. The GIL is released while waiting."""
        lease = self._open_lease()
        if lease.pinner is None:
            raise WeightdError(grpc.StatusCode.FAILED_PRECONDITION, f"model {self.name!r} was attached without pin")
        try:
            lease.pinner.wait(timeout if timeout is not None else 1e9)
        except RuntimeError as e:
            raise WeightdError.from_number(getattr(e, "code", 2), str(e)) from None
        progress = lease.pin_progress()
        assert progress is not None
        return progress

    # torch
    def weights_iterator(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """Yields (name, torch.Tensor) pairs in manifest order, zero-copy, for a load_weights() loop."""
        for name in self:
            yield name, self[name].to_torch()

    def torch_state_dict(self) -> Dict[str, torch.Tensor]:
        """{name: torch.Tensor}, zero-copy."""
        return dict(self.weights_iterator())

    # lifetime
    @property
    def closed(self) -> bool:
        return self._lease is None

    def close(self) -> None:
        """Drops this model's hold on the lease; exported tensors keep theirs. Idempotent.

        When the last hold goes, pinned pages are unregistered (after the
        registration in flight, if any), then the segments are unmapped and the
        lease ends."""
        self._lease = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open_lease(self) -> _Lease:
        if self._lease is None:
            raise ValueError(f"model {self.name!r} (rank {self.rank}) is closed")
        return self._lease

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self)} tensors"
        layout = f" layout {self.layout!r}" if self.layout else ""
        return f"<weightd.Model {self.name!r} generation {self.generation} rank {self.rank}{layout}: {state}>"
