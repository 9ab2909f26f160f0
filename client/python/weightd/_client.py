"""Control RPCs through grpcio, attach (fd socket + native mapping) and update (fd socket + mmap)."""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import grpc

from . import _fdsock, _pin
from ._errors import WeightdError, layout_error
from ._layout import DEFAULT_WAIT_SECONDS, LayoutWriter, TensorSpec, gpu_uuid, tensor_specs
from ._model import EntryTable, Model, TensorTable, _Lease
from ._native import PackedTable, Segment
from ._types import LoadProgress, LoadResult, Manifest, ModelInfo, SegmentInfo, TensorInfo, UnloadResult
from ._update import Update
from ._watch import Watch
from .v1 import weightd_pb2 as pb
from .v1 import weightd_pb2_grpc as pb_grpc

DEFAULT_SOCKET = "/run/weightd/weightd.sock"


def connect(socket_path: Optional[str] = None) -> Client:
    """A Client for the daemon at `socket_path`.

    Default: $WEIGHTD_SOCKET, then /run/weightd/weightd.sock. Accepts a
    socket path (absolute, or any value without ':', taken relative to the
    working directory now), "unix://PATH" or "HOST:PORT". Does not block: the first call
    reports an unreachable daemon (WeightdError with code UNAVAILABLE).
    """
    return Client(socket_path or os.environ.get("WEIGHTD_SOCKET") or DEFAULT_SOCKET)


def _strings(values: Union[str, Iterable[str]]) -> List[str]:
    """A pattern (or device, peer) list: one string is one item, not its characters."""
    return [values] if isinstance(values, str) else list(values)


def _target(socket_path: str) -> str:
    """A Unix socket path (absolute, or any value without ':', such as
    "d1/wd.sock", made absolute against the working directory now) as a
    gRPC unix:// target; anything else ("unix://...", "HOST:PORT")
    unchanged. A relative path with a ':' needs "unix:" before it."""
    if ":" in socket_path and not socket_path.startswith("/"):
        return socket_path
    return "unix://" + os.path.abspath(socket_path)


# Manifests of 100,000+ tensors exceed grpc's 4 MiB default. Reconnect
# backoff capped at 1 s (gRPC's default grows to 120 s).
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]


class Client:
    """A connection to one daemon. Safe to use from many threads.

    Across a daemon restart or in-place upgrade, attached models stay
    valid (their leases are gone), a call while the daemon is down raises
    WeightdError(UNAVAILABLE), and a call once it is back reconnects (the
    channel's reconnect backoff is capped at 1 s; tests/python/test_restart.py).
    """

    def __init__(self, socket_path: str) -> None:
        self.target = _target(socket_path)
        self._channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.WeightdStub(self._channel)

    def close(self) -> None:
        """Closes the control channel; attached models stay valid."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def load(self, name: str, checkpoint_path: Union[str, os.PathLike[str]], *,
             host_resident: Union[str, Iterable[str]] = (), tp_size: int = 1, tp_rules: Iterable[Tuple[str, int]] = (),
             devices: Union[str, Iterable[str]] = (), peers: Union[str, Iterable[str]] = (),
             include: Union[str, Iterable[str]] = (), exclude: Union[str, Iterable[str]] = (),
             numa_copies: bool = False, progress: Optional[Callable[[LoadProgress], object]] = None) -> LoadResult:
        """Loads (or reuses) `checkpoint_path` under `name`; returns a LoadResult.

        host_resident, devices, peers, include, exclude: lists of strings, or one
        string for a list of one. include / exclude: a subset load (a draft model that reads part of a
        checkpoint): only tensors whose name contains one of `include` (empty:
        every tensor) and none of `exclude` are loaded; the manifest and
        fingerprint cover just those. numa_copies: one copy of the host
        tensors per NUMA node, each on its node's memory (attach maps the
        copy of the caller's node). tp_rules: (pattern, dim) pairs. peers: "HOST:PORT" of other nodes'
        weightd --peer-address, asked in order to seed the model from their
        memory before storage is read (ModelInfo.source says which served).
        progress: called with a LoadProgress for each progress message.
        """
        request = pb.LoadModelRequest(
            name=name, checkpoint_path=os.fspath(checkpoint_path), host_resident_patterns=_strings(host_resident),
            tp_size=tp_size, tp_rules=[pb.TpRule(pattern=p, dim=d) for p, d in tp_rules], devices=_strings(devices),
            peers=_strings(peers), include_patterns=_strings(include), exclude_patterns=_strings(exclude),
            numa_copies=numa_copies)
        return self._load_stream(self._stub.LoadModel, request, progress)

    def reload(self, name: str, checkpoint_path: Union[str, os.PathLike[str], None] = None, *,
               progress: Optional[Callable[[LoadProgress], object]] = None) -> LoadResult:
        """Loads the next generation of READY model `name` with its plan, from `checkpoint_path`
        (None: the path it was loaded from), reading only the files whose identity or header
        changed and sharing the others' segments. Returns a LoadResult (bytes_read, bytes_reused)."""
        request = pb.ReloadModelRequest(name=name, checkpoint_path=os.fspath(checkpoint_path or ""))
        return self._load_stream(self._stub.ReloadModel, request, progress)

    def _load_stream(self, method: Callable[[Any], Iterable[Any]], request: Any,
                     progress: Optional[Callable[[LoadProgress], object]]) -> LoadResult:
        result = None
        try:
            for message in method(request):
                if progress is not None:
                    progress(LoadProgress(pb.LoadModelProgress.Phase.Name(message.phase), message.bytes_done,
                                          message.bytes_total, message.files_done, message.files_total,
                                          message.seconds))
                if message.phase == pb.LoadModelProgress.DONE:
                    result = LoadResult(ModelInfo.from_proto(message.model), message.reused,
                                        message.bytes_total, message.bytes_reused)
        except grpc.RpcError as e:
            raise WeightdError.from_rpc(e) from None
        if result is None:
            raise WeightdError(grpc.StatusCode.INTERNAL, "load stream ended without a DONE message")
        return result

    def list(self) -> List[ModelInfo]:
        """Every live generation (including draining ones) as ModelInfo."""
        response = self._call(self._stub.ListModels, pb.ListModelsRequest())
        return [ModelInfo.from_proto(m) for m in response.models]

    def unload(self, name: str, force: bool = False) -> UnloadResult:
        """Stops new leases of `name`; `force` revokes existing ones (not claimed leases on
        cuda-legacy-ipc arenas, which end when their clients close them). Returns an UnloadResult."""
        response = self._call(self._stub.UnloadModel, pb.UnloadModelRequest(name=name, force=force))
        return UnloadResult(ModelInfo.from_proto(response.model), response.freed)

    def manifest(self, name: str, rank: int = 0) -> Manifest:
        """The Manifest of (name, rank), without taking a lease."""
        pages = []
        try:
            pages = list(self._stub.GetManifest(pb.GetManifestRequest(name=name, rank=rank)))
        except grpc.RpcError as e:
            raise WeightdError.from_rpc(e) from None
        first = pages[0] if pages else pb.ManifestPage()
        return Manifest(first.model, first.generation, first.rank, first.fingerprint,
                        tuple(SegmentInfo.from_proto(s) for p in pages for s in p.segments),
                        tuple(TensorInfo.from_proto(t) for p in pages for t in p.tensors), first.version_label)

    def watch(self, name: str) -> Watch:
        """The events of model `name` (loaded or not) as a Watch: an iterator of WatchEvent.

            for event in client.watch("llama"):
                if event.kind == "PUBLISHED":
                    ...  # re-attach at the next step boundary

        CURRENT comes first when `name` has a READY generation, then every
        PUBLISHED, DRAINING, FREED and UNLOADED in order. Returns once the
        daemon subscribed, so no later event is missed. Raises WeightdError:
        INVALID_ARGUMENT (bad name), RESOURCE_EXHAUSTED (the daemon's
        --max-watchers), UNAVAILABLE (no daemon, or it is stopping).
        """
        return Watch.start(self._stub.WatchModel, pb.WatchModelRequest(name=name))

    def update(self, name: str, tensors: Optional[Iterable[str]] = None, *,
               version_label: Optional[str] = None) -> Update:
        """Opens an update of READY model `name`: the next generation, written by this process.

            with client.update("llama", tensors=["w"]) as up:
                up["w"].copy_(new_w)    # commits on a clean exit, aborts on an exception

        `tensors`: the names this writer will write (None: every tensor). The
        daemon stages writable copies of the segments holding them,
        initialised with the current bytes, and shares the rest; this claims
        them on the fd socket. Returns an Update (see its commit() and
        abort()); its fd-socket connection is the update's lease.
        `version_label` (e.g. f"step-{step}"): the label commit() gives the
        new generation unless it is passed one itself.

        Raises WeightdError: NOT_FOUND (no such model), ALREADY_EXISTS
        (another writer has an update of `name` open), INVALID_ARGUMENT (a
        tensor name the model lacks, or named twice), UNIMPLEMENTED
        (device-placed tensors), RESOURCE_EXHAUSTED (no memory to stage).
        """
        request = pb.BeginUpdateRequest(name=name, tensors=list(tensors or ()))
        response = self._call(self._stub.BeginUpdate, request)
        connection, fds = self._claim_staged(
            response.update_id, response,
            lambda: self._stub.AbortUpdate(pb.AbortUpdateRequest(update_id=response.update_id), timeout=5),
            "staged segments")
        return Update(self._stub, response, connection, fds, version_label)

    def publish_layout(self, model: str, key: str, tensors: Mapping[str, TensorSpec], *, rank: int = 0,
                       identity: Optional[Mapping[str, str]] = None, device: Union[str, int, None] = None,
                       wait: Union[bool, float] = False) -> LayoutWriter:
        """Opens the publish of runtime layout `key` of `model`'s current generation and rank `rank`.

            with client.publish_layout("llama", "myengine/int8", {"qkv": ("I8", (3072, 1024)),
                                                                  "qkv.scale": (torch.float32, (3072,))},
                                       identity={"engine": "myengine 1.2", "quant": "int8"}) as w:
                w["qkv"].copy_(q)        # writable CPU tensors over the staged memory
                w["qkv.scale"].copy_(s)  # committed on a clean exit, aborted on an exception

        tensors: {name: (dtype, shape)} or {name: (dtype, shape, strides)}, in
        the order they are staged; dtype a safetensors string ("I8", "BF16")
        or a torch.dtype, strides in elements as torch.Tensor.stride() gives
        them (the tensor then covers the bytes they reach). identity: the
        strings that decide the layout (engine and version, layout ABI,
        quantization, parallel sizes, device arch); attach(identity=...) must
        match it exactly. device: None places every tensor on the host (one
        shared copy on the node); otherwise every tensor is DEVICE-placed on
        that GPU: a UUID as the daemon reports it ("GPU-...", or
        "GPU-emulated-N" on an emulated backend), "cuda" for the rank's GPU in
        the model's plan, or "cuda:N" / N for this process's CUDA device N
        (resolved to its UUID by torch 2.0+). Device tensors are written on the
        host too and copied onto a daemon-owned arena at commit.
        wait: True (600 s) or seconds: when another writer is publishing the
        same layout, wait for it instead of failing with ALREADY_EXISTS; if it
        commits, the returned writer has published_by_other True and nothing
        to write (attach the layout); if it aborts, this one gets the publish.

        Returns a LayoutWriter whose fd-socket connection is the publish's
        lease: this process dying or closing it aborts. Raises WeightdError:
        NOT_FOUND (no such model or rank), ALREADY_EXISTS (another writer is
        publishing it, or it is published: attach it, or drop_layout first),
        DEADLINE_EXCEEDED (wait ran out), INVALID_ARGUMENT (bad key, identity,
        names, shapes or strides), FAILED_PRECONDITION (an unknown GPU),
        RESOURCE_EXHAUSTED (no memory to stage).
        """
        wait_seconds = DEFAULT_WAIT_SECONDS if wait is True else float(wait or 0)
        placement = pb.HOST if device is None else pb.DEVICE
        request = pb.BeginLayoutRequest(name=model, key=key, identity=dict(identity or {}), rank=rank,
                                        tensors=tensor_specs(tensors, placement),
                                        gpu_uuid="" if device is None else gpu_uuid(device),
                                        wait_seconds=wait_seconds)
        response = self._call(self._stub.BeginLayout, request)
        if response.published:
            return LayoutWriter(self._stub, key, response, None, [])
        connection, fds = self._claim_staged(
            response.writer_id, response,
            lambda: self._stub.AbortLayout(pb.AbortLayoutRequest(writer_id=response.writer_id), timeout=5),
            "staged memfds")
        return LayoutWriter(self._stub, key, response, connection, fds)

    def drop_layout(self, model: str, key: str, rank: Optional[int] = None) -> int:
        """Removes layout `key` (of rank `rank`; None: of every rank) from `model`'s current generation:
        no new attaches, leases on it keep its memory until they end. Returns how many were
        removed; WeightdError NOT_FOUND, naming the layouts it has, when none."""
        request = pb.DropLayoutRequest(name=model, key=key)
        if rank is not None:
            request.rank = rank
        return int(self._call(self._stub.DropLayout, request).dropped)

    def attach(self, model: str, rank: int = 0, *, private: bool = False, prefault: bool = False,
               numa_node: Optional[int] = None, pin: _pin.PinSpec = False,
               pin_chunk_bytes: int = _pin.DEFAULT_CHUNK_BYTES, layout: Optional[str] = None,
               identity: Optional[Mapping[str, str]] = None) -> Model:
        """Takes a lease on `model` and maps rank `rank`; returns a Model.

        numa_node: for a model loaded with numa_copies=True, map the copy on
        that NUMA node (FAILED_PRECONDITION when it has none there); None
        (default): the copy on the node of this process's CPUs (its
        os.sched_getaffinity set, which the daemon maps to a node).
        Model.numa_node says which copy was mapped (-1: the model has one).

        prefault=False (default): pages are mapped lazily, each faulting in on
        first use. prefault=True: every page of the host segments is mapped
        during attach (MADV_POPULATE_READ), so the first pass over the weights
        takes no page fault; attach then costs about what those faults would
        (docs/performance.md, "Attach"). Reading only: with private=True the
        pages stay shared until written.

        private=False (default): segments are mapped shared and read-only;
        writing through a tensor kills this process with SIGSEGV.
        private=True: copy-on-write (MAP_PRIVATE of the sealed memfd, PROT_READ
        | PROT_WRITE): tensors are writable; reads share the daemon's pages and
        the first write to a 4 KiB page copies that page into this process
        (private memory, counted as Private_Dirty in /proc/self/smaps). No other
        process, and not the daemon, ever sees the write. For engines that
        post-process weights in place (docs/integration.md). Host segments and
        emulated device arenas only.

        pin=True, or a sequence of substrings: pin host tensors (every one, or
        those whose name contains one of them) for GPU kernels to read in place
        (docs/api.md, "Pinned host tables"). A background thread registers
        their pages with CUDA (cuMemHostRegister: device-mapped, portable,
        read-only where the GPU supports it; at most `pin_chunk_bytes` per
        call, about 0.1 s per GB) while attach returns at once;
        Model.wait_pinned() waits for it, Model.pin_progress() reports it,
        then Tensor.device_ptr and Tensor.cuda_view() / to_torch_cuda() give
        the GPU's view. libcuda.so.1 is loaded only then, on that thread:
        without a driver or GPU, attach still works and wait_pinned() raises
        WeightdError(UNAVAILABLE). Refused (INVALID_ARGUMENT) with
        private=True, or for a pattern that matches no host tensor.

        layout: attach runtime layout `layout` of the current generation and
        rank instead of its checkpoint tensors (Model.layout names it); the
        lease holds the generation too. Tensors keep the strides they were
        published with (TensorInfo.strides; to_torch() gives them).
        identity: checked strictly against the identity the layout was
        published with (None or {}: not checked; Model.identity gives it).
        Raises weightd.LayoutNotFound (NOT_FOUND, naming the keys published
        for this generation and rank) and weightd.LayoutMismatch
        (FAILED_PRECONDITION, naming every field that differs).

        Raises WeightdError with the daemon's code: NOT_FOUND, FAILED_PRECONDITION
        (draining, or private=True with a CUDA arena), ...; UNAVAILABLE when a
        device arena cannot be imported here (e.g. no CUDA driver in this
        process's view).
        """
        return self._attach(model, rank, private=private, prefault=prefault, numa_node=numa_node, pin=pin,
                            pin_chunk_bytes=pin_chunk_bytes, layout=layout, identity=identity)

    def _attach(self, model: str, rank: int = 0, *, private: bool = False, prefault: bool = False,
                packed: bool = True, numa_node: Optional[int] = None, pin: _pin.PinSpec = False,
                pin_chunk_bytes: int = _pin.DEFAULT_CHUNK_BYTES, layout: Optional[str] = None,
                identity: Optional[Mapping[str, str]] = None) -> Model:
        """attach(); packed=False asks for one TensorEntry per tensor, as clients before the
        packed table did (tests/bench/py_attach.py --entries, and tests comparing the
        two encodings); a daemon that predates the packed table answers so anyway."""
        start = time.monotonic()
        patterns = _pin.patterns_of(pin)
        _pin.check(patterns, private, pin_chunk_bytes)
        encoding = pb.AttachRequest.PACKED_TABLE_V1 if packed else pb.AttachRequest.TENSOR_ENTRIES
        request = pb.AttachRequest(name=model, rank=rank, manifest_encoding=encoding,
                                   cpus=sorted(os.sched_getaffinity(0)))
        if numa_node is not None:
            request.numa_node = numa_node
        if identity and layout is None:
            raise ValueError("attach(identity=...) checks a layout's identity and needs layout=")
        if layout is not None:
            request.layout = layout
            request.identity.update(identity or {})
        try:
            response = self._call(self._stub.Attach, request)
        except WeightdError as e:
            raise (layout_error(e) if layout is not None else e) from None
        fd_socket = os.environ.get("WEIGHTD_FD_SOCKET") or response.fd_socket
        try:
            table = _tensor_table(response)
            pinned = _pin.select(table, patterns, response.model, response.rank) if patterns else []
            connection, fds = _fdsock.claim(fd_socket, response.lease_id, response.claim_timeout_seconds)
        except WeightdError:
            self._detach_quietly(response.lease_id)
            raise
        try:
            lease = _Lease(response.lease_id, connection, _map_segments(response, fds, private, prefault, table))
        except BaseException:
            connection.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        if patterns:
            host = [d.placement != pb.DEVICE for d in response.segments]
            lease.pinner = _pin.start(lease.segments, host, table, pinned, pin_chunk_bytes)
            lease.pinned = {index: j for j, index in enumerate(pinned)}
        return Model(response, lease, time.monotonic() - start, private, table)

    def _call(self, method: Callable[[Any], Any], request: Any) -> Any:
        try:
            return method(request)
        except grpc.RpcError as e:
            raise WeightdError.from_rpc(e) from None

    def _claim_staged(self, writer_id: str, response: Any, abort: Callable[[], Any],
                      what: str) -> Tuple[socket.socket, List[int]]:
        """Claims writer `writer_id` (an update or a layout publish) on the fd
        socket: its connection (the writer's lease) and one fd per staged
        segment of `response`. On a refused claim, `abort` ends the writer
        (best effort: an unclaimed one ends at its claim timeout anyway);
        a wrong fd count closes everything, which makes the daemon abort.
        Raises WeightdError."""
        fd_socket = os.environ.get("WEIGHTD_FD_SOCKET") or response.fd_socket
        try:
            connection, fds = _fdsock.claim(fd_socket, writer_id, response.claim_timeout_seconds)
        except WeightdError:
            try:
                abort()
            except grpc.RpcError:
                pass
            raise
        if len(fds) != len(response.segments):
            for fd in fds:
                os.close(fd)
            connection.close()
            raise WeightdError(grpc.StatusCode.INTERNAL, f"fd socket: {len(fds)} fds for {len(response.segments)} {what}")
        return connection, fds

    def _detach_quietly(self, lease_id: str) -> None:
        try:
            self._stub.Detach(pb.DetachRequest(lease_id=lease_id), timeout=5)
        except grpc.RpcError:
            pass  # the unclaimed lease expires on its own


def _fd_attached(descriptor: Any) -> bool:
    return bool(descriptor.export_kind == pb.SegmentDescriptor.EXPORT_FD)


def _tensor_table(response: Any) -> TensorTable:
    """The response's tensors as a TensorTable: the native decoder of the
    packed table, or the TensorEntry messages of a
    daemon that predates it. WeightdError DATA_LOSS for a malformed table."""
    packed = response.packed_tensors  # each read of a bytes field copies it: once
    if not packed:
        return EntryTable(response.tensors)
    if len(response.tensors):
        raise WeightdError(grpc.StatusCode.DATA_LOSS,
                           "the daemon's Attach reply carries both packed_tensors and TensorEntry messages")
    try:
        return PackedTable(packed)
    except RuntimeError as e:
        raise WeightdError.from_number(getattr(e, "code", 15), str(e)) from None


def _map_segments(response: Any, fds: Sequence[int], private: bool, prefault: bool,
                  table: TensorTable) -> List[Segment]:
    """Maps each segment: host segments with mmap (read-only, or copy-on-write
    when `private`; populated now when `prefault`), device arenas imported
    with the backend that exported them. `fds` come in segment order, one per
    segment whose export_kind is EXPORT_FD. Checks that every tensor of
    `table` lies inside its segment."""
    with_fd = [d for d in response.segments if _fd_attached(d)]
    if len(fds) != len(with_fd):
        raise WeightdError(grpc.StatusCode.INTERNAL,
                           f"received {len(fds)} segment fds for {len(with_fd)} fd-exported segments")
    segments: List[Segment] = []
    next_fd = iter(fds)
    try:
        for i, d in enumerate(response.segments):
            try:
                fd = next(next_fd) if _fd_attached(d) else -1
                if d.placement != pb.DEVICE:
                    segments.append(Segment(fd, d.size, private, prefault))
                else:
                    segments.append(Segment.import_device(d.backend, d.gpu_uuid, d.size, d.ipc_handle, fd, private))
            except RuntimeError as e:
                # FAILED_PRECONDITION (copy-on-write refused) keeps its code; any
                # other import failure means the device cannot be reached from here.
                code = 9 if getattr(e, "code", None) == 9 else 14
                raise WeightdError.from_number(
                    code, f"segment {i} of model {response.model!r} ({d.backend} on {d.gpu_uuid}): {e}") from None
        outside = table.first_outside([s.size for s in segments])
        if outside >= 0:
            raise WeightdError(grpc.StatusCode.INTERNAL, f"tensor {table.info(outside)[0]!r} lies outside its segment")
    except BaseException:
        # Unmapped before the caller closes the connection (the lease), not
        # whenever the traceback lets go of them.
        for segment in segments:
            segment.close()
        raise
    return segments
