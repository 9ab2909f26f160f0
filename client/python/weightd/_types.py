"""Plain records returned by the client: no protobuf type leaks out."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, Tuple

from .v1 import weightd_pb2 as pb


class _StrEnum(str, enum.Enum):
    """A member equals, hashes, prints and formats as its plain string, so code that
    compares or prints the strings the client returned before keeps working."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, format_spec: str) -> str:
        return str.__format__(self, format_spec)


class ModelState(_StrEnum):
    """ModelInfo.state: the names of proto ModelState (docs/api.md)."""
    MODEL_STATE_UNSPECIFIED = "MODEL_STATE_UNSPECIFIED"
    LOADING = "LOADING"
    READY = "READY"
    FAILED = "FAILED"
    DRAINING = "DRAINING"


class WatchEventKind(_StrEnum):
    """WatchEvent.kind: the names of proto ModelEvent.Kind (docs/api.md "WatchModel")."""
    KIND_UNSPECIFIED = "KIND_UNSPECIFIED"
    CURRENT = "CURRENT"
    PUBLISHED = "PUBLISHED"
    DRAINING = "DRAINING"
    FREED = "FREED"
    UNLOADED = "UNLOADED"
    LAYOUT_PUBLISHED = "LAYOUT_PUBLISHED"  # WatchEvent.layout of rank WatchEvent.rank was committed
    LAYOUT_DROPPED = "LAYOUT_DROPPED"      # removed (drop_layout or an unload): no new attaches
    LAYOUT_DRAINING = "LAYOUT_DRAINING"    # its generation drains: publish again for the new one


@dataclass(frozen=True)
class LayoutInfo:
    """One published runtime layout of a generation (docs/api.md "Runtime layouts")."""
    key: str
    rank: int
    identity: Dict[str, str]
    generation: int  # the model generation it belongs to
    tensor_count: int
    host_bytes: int
    device_bytes: Dict[str, int]  # by GPU UUID
    leases: int  # active leases on this layout
    fingerprint: str  # 32 hex digits over names, dtypes, shapes, strides and content hashes
    publish_seconds: float  # sealing, hashing and device copies at commit, on the daemon
    published_at: float  # seconds since the Unix epoch

    @classmethod
    def from_proto(cls, m: Any) -> LayoutInfo:
        return cls(key=m.key, rank=m.rank, identity=dict(m.identity), generation=m.generation,
                   tensor_count=m.tensor_count, host_bytes=m.host_bytes,
                   device_bytes={d.gpu_uuid: d.bytes for d in m.device_bytes}, leases=m.leases,
                   fingerprint=m.fingerprint, publish_seconds=m.publish_seconds, published_at=m.published_at)


@dataclass(frozen=True)
class ModelInfo:
    """One generation of a model, as ListModels / LoadModel / UnloadModel report it."""
    name: str
    generation: int
    state: ModelState
    checkpoint_path: str
    host_bytes: int
    locked_bytes: int
    device_bytes: Dict[str, int]  # by GPU UUID
    leases: int
    fingerprint: str
    tensor_count: int
    tp_size: int
    load_seconds: float
    error: str
    bytes_read: int = 0    # tensor bytes read from storage (or written by a writer)
    bytes_shared: int = 0  # segment bytes shared with the generation before
    version_label: str = ""  # a writer's tag of the generation (e.g. "step-1200"); "" for loads from disk
    source: str = ""  # where its bytes came from: "storage", "writer" or "peer HOST:PORT"
    numa_nodes: Tuple[int, ...] = ()  # nodes holding a copy of the host segments (numa_copies); (): one copy
    layouts: Tuple[LayoutInfo, ...] = ()  # the runtime layouts published on this generation

    @classmethod
    def from_proto(cls, m: Any) -> ModelInfo:
        return cls(
            name=m.name, generation=m.generation, state=ModelState(pb.ModelState.Name(m.state)),
            checkpoint_path=m.checkpoint_path, host_bytes=m.host_bytes, locked_bytes=m.locked_bytes,
            device_bytes={d.gpu_uuid: d.bytes for d in m.device_bytes}, leases=m.leases,
            fingerprint=m.fingerprint, tensor_count=m.tensor_count, tp_size=m.tp_size,
            load_seconds=m.load_seconds, error=m.error, bytes_read=m.bytes_read, bytes_shared=m.bytes_shared,
            version_label=m.version_label, source=m.source, numa_nodes=tuple(m.numa_nodes),
            layouts=tuple(LayoutInfo.from_proto(layout) for layout in m.layouts))


@dataclass(frozen=True)
class LoadResult:
    model: ModelInfo
    reused: bool  # an identical READY generation was reused; nothing was read
    bytes_read: int = 0    # tensor bytes this load read from storage
    bytes_reused: int = 0  # tensor bytes of unchanged files shared with the generation before


@dataclass(frozen=True)
class CommitResult:
    """What Update.commit() published (CommitUpdateResponse)."""
    model: ModelInfo      # the new generation (its version_label, bytes_read = bytes written)
    tensors_changed: int  # tensors whose content hash differs from the base generation's
    bytes_written: int    # bytes of the staged segments
    bytes_shared: int     # bytes of segments shared unchanged with the base generation
    seconds: float        # sealing, hashing, verifying and publishing, on the daemon


@dataclass(frozen=True)
class UnloadResult:
    model: ModelInfo
    freed: bool  # False while leases keep the generation DRAINING


@dataclass(frozen=True)
class LoadProgress:
    phase: str  # CATALOG, PLAN, ALLOCATE, READ, SEAL, DONE
    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int
    seconds: float


class PinState(_StrEnum):
    """PinProgress.state (docs/api.md "Pinned host tables")."""
    REGISTERING = "REGISTERING"
    READY = "READY"
    FAILED = "FAILED"  # see PinProgress.error; nothing stays registered
    STOPPED = "STOPPED"  # the model's lease ended first


@dataclass(frozen=True)
class PinProgress:
    """Where the pinning of an attach(pin=...) stands (Model.pin_progress())."""
    state: PinState
    bytes_done: int  # page bytes registered with CUDA so far
    bytes_total: int  # page bytes to register
    chunks_done: int  # cuMemHostRegister calls done
    chunks_total: int
    tensors: int  # tensors pinned, once READY
    read_only: bool  # registered with CU_MEMHOSTREGISTER_READ_ONLY
    device_ordinal: int  # this process's CUDA ordinal that registered (-1 before the driver loaded)
    register_seconds: float  # time inside cuMemHostRegister
    seconds: float  # since attach started it, until READY/FAILED/STOPPED
    error: str  # FAILED: "CODE: message", naming the segment, bytes and tensor; else ""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a rank's manifest. Shapes in elements, sizes in bytes."""
    name: str
    dtype: str  # safetensors spelling: "BF16", "F8_E4M3", ...
    shape: Tuple[int, ...]  # this rank's shape
    placement: str  # "host" or "device"
    segment: int
    offset: int
    nbytes: int
    full_shape: Tuple[int, ...]
    split_dim: int  # -1: not split
    split_start: int
    content_hash: str
    # A layout tensor's strides in elements (as torch.Tensor.stride()); (): contiguous.
    strides: Tuple[int, ...] = ()

    @classmethod
    def from_proto(cls, t: Any) -> TensorInfo:
        return cls(
            name=t.name, dtype=t.dtype, shape=tuple(t.shape),
            placement="device" if t.placement == pb.DEVICE else "host", segment=t.segment,
            offset=t.offset, nbytes=t.nbytes, full_shape=tuple(t.full_shape), split_dim=t.split_dim,
            split_start=t.split_start, content_hash=t.content_hash, strides=tuple(t.strides))


@dataclass(frozen=True)
class SegmentInfo:
    placement: str  # "host" or "device"
    size: int
    backend: str  # "memfd", "emulated", "cuda-vmm", "cuda-legacy-ipc"
    gpu_uuid: str = ""
    fd_attached: bool = True  # its fd arrives on the fd socket; False: imported from handle bytes

    @classmethod
    def from_proto(cls, s: Any) -> SegmentInfo:
        return cls(placement="device" if s.placement == pb.DEVICE else "host", size=s.size,
                   backend=s.backend, gpu_uuid=s.gpu_uuid,
                   fd_attached=s.export_kind == pb.SegmentDescriptor.EXPORT_FD)


@dataclass(frozen=True)
class Manifest:
    model: str
    generation: int
    rank: int
    fingerprint: str
    segments: Tuple[SegmentInfo, ...]
    tensors: Tuple[TensorInfo, ...]
    version_label: str = ""  # as ModelInfo.version_label


@dataclass(frozen=True)
class WatchEvent:
    """One event of a watched model name (docs/api.md "WatchModel")."""
    kind: WatchEventKind
    model: str
    generation: int
    version_label: str
    fingerprint: str
    time: float  # when it happened, seconds since the Unix epoch
    layout: str = ""  # LAYOUT_* events: the layout key
    rank: int = 0     # LAYOUT_* events: its rank

    @classmethod
    def from_proto(cls, e: Any) -> WatchEvent:
        return cls(kind=WatchEventKind(pb.ModelEvent.Kind.Name(e.kind)), model=e.model, generation=e.generation,
                   version_label=e.version_label, fingerprint=e.fingerprint, time=e.time, layout=e.layout,
                   rank=e.rank)
