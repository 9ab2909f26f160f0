"""Publishing a runtime layout: a LayoutWriter maps the memfds the daemon
staged for a layout's tensors read-write and commits them (docs/api.md
"Runtime layouts", docs/integration.md "Runtime layouts").

Every tensor is staged in host memory, DEVICE ones too: the daemon copies
those onto its own arena on the GPU at commit (server/layout/layout_publish.h
says why), so `w[name]` is always a CPU tensor and a CUDA source is copied
device-to-host into it. Mappings are Python's own `mmap.mmap`, one per
staged memfd, made on first use; every tensor or buffer handed out holds a
memoryview of its mapping, so `mmap.close()` refuses (BufferError) while one
is alive and commit() can tell whether it really unmapped everything (the
daemon seals only memory no process maps writable).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import _torch
from ._staged import StagedWriter
from ._types import LayoutInfo, TensorInfo
from .v1 import weightd_pb2 as pb

if TYPE_CHECKING:
    import socket

    import torch

# A tensor of a layout as publish_layout takes it: (dtype, shape) or (dtype,
# shape, strides in elements); dtype a safetensors string ("BF16", "I8") or a torch.dtype.
TensorSpec = Union[Tuple[Any, Sequence[int]], Tuple[Any, Sequence[int], Sequence[int]]]

# wait=True: how long BeginLayout waits for another writer of the same layout.
DEFAULT_WAIT_SECONDS = 600.0


def safetensors_dtype(dtype: Any) -> str:
    """A safetensors dtype string for `dtype`: a string is taken as one ("I8",
    "F32"), a torch.dtype is translated (torch.int8 -> "I8"). ValueError for a
    torch dtype safetensors has no name for."""
    if isinstance(dtype, str):
        return dtype
    name = str(dtype).replace("torch.", "")
    for table in (_torch._DIRECT, _torch._BYTE_VIEWED):
        for safetensors, torch_name in table.items():
            if torch_name == name:
                return safetensors
    for safetensors, (torch_name, _) in _torch._WIDE_UNSIGNED.items():
        if torch_name == name:
            return safetensors
    raise ValueError(f"torch dtype {dtype} has no safetensors dtype a layout can hold")


def tensor_specs(tensors: Mapping[str, TensorSpec], placement: int) -> List[Any]:
    """`tensors` as pb.LayoutTensorSpec messages, in their order."""
    specs = []
    for name, spec in tensors.items():
        if not isinstance(spec, (tuple, list)) or len(spec) not in (2, 3):
            raise ValueError(f"layout tensor {name!r}: expected (dtype, shape) or (dtype, shape, strides), "
                             f"got {spec!r}")
        fields: Sequence[Any] = spec
        strides = [int(s) for s in fields[2]] if len(fields) == 3 else []
        specs.append(pb.LayoutTensorSpec(name=name, dtype=safetensors_dtype(fields[0]),
                                         shape=[int(d) for d in fields[1]], strides=strides, placement=placement))
    return specs


def gpu_uuid(device: Union[str, int]) -> str:
    """BeginLayoutRequest.gpu_uuid for publish_layout's `device`: a UUID
    ("GPU-...", "GPU-emulated-1") as it is; "cuda": "" (the daemon takes the
    rank's GPU in the model's plan); "cuda:N" or N: the UUID of this process's
    CUDA device N, from torch (which must report it: torch 2.0+)."""
    if isinstance(device, str) and device == "cuda":
        return ""
    if isinstance(device, str) and not device.startswith("cuda:"):
        return device
    ordinal = int(device[len("cuda:"):]) if isinstance(device, str) else int(device)
    try:
        import torch
        uuid = getattr(torch.cuda.get_device_properties(ordinal), "uuid", None)
    except (ImportError, RuntimeError, AssertionError) as e:
        raise ValueError(f"device {device!r}: cannot resolve CUDA device {ordinal} to its UUID ({e}); "
                         f"pass the GPU's UUID") from None
    if uuid is None:
        raise ValueError(f"device {device!r}: this torch does not report GPU UUIDs; pass the GPU's UUID")
    return f"GPU-{uuid}"


class LayoutWriter(StagedWriter):
    """One writer's open publish of a runtime layout (from Client.publish_layout).

        with client.publish_layout("llama", "myengine/int8/tp1", {"qkv": ("I8", (3072, 1024))}) as w:
            w["qkv"].copy_(fused)           # a writable torch.Tensor over the staged memory
        # committed here; an exception in the block aborts instead

    `w[name]` is a writable CPU torch.Tensor of the declared dtype, shape and
    strides (imports torch); `w.buffer(name)` the same bytes as a writable
    memoryview (every byte the strides reach), no torch needed. Bytes start
    zeroed; a writer may write its tensors' bytes only.

    `published_by_other`: publish_layout(wait=True) found the layout
    published by another writer meanwhile. There is nothing to write
    (`tensors` is empty, `w[name]` raises KeyError) and the block commits
    nothing: attach the layout (Client.attach(model, rank, layout=key)).

    Lifetime: open until commit(), abort(), the end of a `with` block, or this
    object being freed (its fd-socket connection, the publish's lease, then
    closes and the daemon aborts). commit() needs every tensor and buffer
    taken from the writer dropped first (a `with` block keeping one in a
    variable must `del` it), else it raises WeightdError and stays open.
    Thread-safety: tensors may be written from several threads; commit() and
    abort() must be called from one thread, after those writes.
    """

    def __init__(self, stub: Any, key: str, response: Any, connection: Optional[socket.socket],
                 fds: Sequence[int]) -> None:
        # stub: the WeightdStub; response: the pb.BeginLayoutResponse
        self.model: str = response.model
        self.key = key
        self.rank: int = response.rank
        self.generation: int = response.generation
        self.writer_id: str = response.writer_id
        self.published_by_other: bool = response.published
        self.bytes_staged: int = response.bytes_staged
        self.result: Optional[LayoutInfo] = None  # what commit() published
        super().__init__(stub, connection, fds, [seg.size for seg in response.segments])
        self._tensors: Dict[str, TensorInfo] = {}
        for t in response.tensors:
            info = TensorInfo.from_proto(t)
            self._check_inside(info, "layout tensor")
            self._tensors[info.name] = info
        self._ended = self.published_by_other

    # ------------------------------------------------------------ tensors

    @property
    def tensors(self) -> List[str]:
        """The layout's tensor names, in the order they were declared (empty when published_by_other)."""
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def tensor_info(self, name: str) -> TensorInfo:
        """Where `name` is staged (TensorInfo.segment indexes the staged memfds); KeyError if not declared."""
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in this publish of layout {self.key!r}") from None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensor(name)

    def tensor(self, name: str) -> torch.Tensor:
        """A writable CPU torch.Tensor of `name`'s dtype, shape and strides over the staged memory (no copy).

        UnsupportedDtypeError when torch has no such dtype (use buffer()).
        """
        info = self.tensor_info(name)
        self._check_open()
        try:
            import torch
        except ImportError as e:
            raise ImportError(f"LayoutWriter[name] returns a torch.Tensor and needs torch ({e}); "
                              "LayoutWriter.buffer(name) gives a writable memoryview without it") from None
        try:
            dtype = _torch.torch_dtype(info.dtype)
        except _torch.UnsupportedDtypeError as e:
            raise _torch.UnsupportedDtypeError(f"tensor {name!r}: {e}; LayoutWriter.buffer() gives its bytes") from None
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype)
        flat = torch.frombuffer(self._view(info), dtype=torch.uint8).view(dtype)
        if not info.strides:
            return flat.view(info.shape)
        return flat.as_strided(info.shape, info.strides)

    def buffer(self, name: str) -> memoryview:
        """`name`'s bytes as a writable 1-D memoryview of unsigned bytes (no copy); release it before commit()."""
        return self._view(self.tensor_info(name))

    # ------------------------------------------------------------ commit / abort

    def commit(self, expected_hashes: Optional[Mapping[str, str]] = None) -> Optional[LayoutInfo]:
        """Unmaps every staged memfd, then asks the daemon to seal, hash and
        publish the layout; returns its LayoutInfo (None when
        published_by_other: nothing of this writer's is published). Closes the
        staged fds afterwards, so no write through this process can reach the
        served bytes (the sealed memfds refuse writes anyway).

        expected_hashes: {tensor name: 16 hex digits of xxh3-64} the written
        tensors must have (optional, per tensor).

        Raises WeightdError: FAILED_PRECONDITION before any RPC when a tensor or
        buffer taken from the writer is still referenced (drop them and commit
        again; the publish stays open); the daemon's error otherwise:
        INVALID_ARGUMENT (a malformed hash) and FAILED_PRECONDITION "still
        mapped writable" (another process maps a staged memfd) leave the
        publish open; anything else ends it with nothing published.
        """
        if self.published_by_other:
            return None
        request = pb.CommitLayoutRequest(writer_id=self.writer_id, expected_hashes=dict(expected_hashes or {}))
        response = self._commit_rpc(self._stub.CommitLayout, request)
        self.result = LayoutInfo.from_proto(response.layout)
        return self.result

    @property
    def closed(self) -> bool:
        """Whether the publish was committed or aborted (always True when published_by_other)."""
        return self._ended

    def __enter__(self) -> LayoutWriter:
        return self

    def __repr__(self) -> str:
        if self.published_by_other:
            state = "published by another writer"
        else:
            state = "closed" if self._ended else f"{len(self._tensors)} tensors, open"
        return f"<weightd.LayoutWriter {self.key!r} of {self.model!r} generation {self.generation} rank {self.rank}: " \
               f"{state}>"

    # ------------------------------------------------------------ what StagedWriter says

    _segment_word = "staged memfd"
    _holder_word = "the writer"
    _kind = "the publish"

    def _what(self) -> str:
        return f"the publish of layout {self.key!r} of {self.model!r}"

    def _abort_rpc(self) -> None:
        self._stub.AbortLayout(pb.AbortLayoutRequest(writer_id=self.writer_id))
