"""Pinned host tables: attach(..., pin=...) registers host tensors with CUDA for GPU reads.

The registration itself is the C++ client's (weightd._native.Pinner over
common/memory/host_pinner.h): one thread per attached model loads
libcuda.so.1 (only when pin is asked), then registers the chunks of the plan
in common/memory/pin_plan.h, read-only and device-mapped where the GPU
supports it. This module turns attach's `pin` argument into that plan's
input. See docs/api.md, "Pinned host tables".
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Sequence, Tuple, Union

import grpc

from ._errors import WeightdError
from ._native import Pinner

if TYPE_CHECKING:
    from ._model import TensorTable
    from ._native import Segment

# attach(pin=...): True pins every host tensor; a sequence of substrings pins
# the host tensors whose name contains one of them; False or () pins nothing.
PinSpec = Union[bool, Sequence[str]]

DEFAULT_CHUNK_BYTES = 1 << 30  # common/memory/pin_plan.h kDefaultPinChunkBytes
_MIN_CHUNK_BYTES = 4096
_MAX_CHUNK_BYTES = 64 << 30
_DLPACK_CUDA = 2  # kDLCUDA


def patterns_of(pin: PinSpec) -> List[str]:
    """The substrings `pin` stands for: [""] (every name) for True, [] for False;
    one string is one pattern."""
    if isinstance(pin, bool):
        return [""] if pin else []
    if isinstance(pin, str):
        return [pin]
    patterns = list(pin)
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"pin patterns are strings, not {type(p).__name__}: {p!r}")
    return patterns


def check(patterns: Sequence[str], private: bool, chunk_bytes: int) -> None:
    """What attach refuses before it takes a lease (WeightdError INVALID_ARGUMENT)."""
    if not patterns:
        return
    if private:
        raise WeightdError(grpc.StatusCode.INVALID_ARGUMENT,
                           "pin cannot be combined with private=True: a page written after registration would be "
                           "copied for this process while the GPU kept reading the shared one")
    if not _MIN_CHUNK_BYTES <= chunk_bytes <= _MAX_CHUNK_BYTES:
        raise WeightdError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"pin_chunk_bytes {chunk_bytes} is outside [{_MIN_CHUNK_BYTES}, {_MAX_CHUNK_BYTES}]")


def select(table: TensorTable, patterns: Sequence[str], model: str, rank: int) -> List[int]:
    """The table indices of the host tensors to pin. WeightdError INVALID_ARGUMENT
    naming a pattern that matches no host tensor."""
    indices, counts = table.select(list(patterns))
    for pattern, (host, device) in zip(patterns, counts):
        if host == 0:
            raise WeightdError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"pin pattern {pattern!r} matches no host tensor of model {model!r} rank {rank} (it "
                               f"matches {device} device-placed tensors; only host tensors are pinned)")
    return indices


def device_ordinal(segments: Sequence[Segment]) -> int:
    """The CUDA ordinal that registers: the model's first CUDA arena's, else 0."""
    for segment in segments:
        kind, ordinal = segment.device
        if kind == _DLPACK_CUDA:
            return int(ordinal)
    return 0


def start(segments: Sequence[Segment], host: Sequence[bool], table: TensorTable, indices: Sequence[int],
          chunk_bytes: int) -> Pinner:
    """A Pinner for tensors `indices` of `table`; `host` says which segments are
    host mappings. Returns at once; raises WeightdError for a bad plan."""
    bases = [s.address if is_host else 0 for s, is_host in zip(segments, host)]
    tensors: List[Tuple[str, int, int, int]] = []
    for i in indices:
        name, _, _, _, segment, offset, nbytes, *_ = table.info(i)
        tensors.append((name, segment, offset, nbytes))
    try:
        return Pinner(bases, [s.size for s in segments], tensors, chunk_bytes, device_ordinal(segments))
    except RuntimeError as e:
        raise WeightdError.from_number(getattr(e, "code", 3), str(e)) from None
