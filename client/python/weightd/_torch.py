"""safetensors dtype -> torch dtype, and the zero-copy import of one tensor."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import grpc

from ._errors import WeightdError

if TYPE_CHECKING:
    import torch

    from ._model import PinnedView, Tensor

# torch imports these straight through DLPack.
_DIRECT = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "C64": "complex64",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
}
# One byte per element: imported as uint8 with the same shape, then
# reinterpreted in place (DLPack 0.6 has no float8 code; older torch refuses
# DLPack booleans).
_BYTE_VIEWED = {
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
}
# Two 4-bit elements per byte (FP4 E2M1, the OCP MX formats' element type):
# torch's float4_e2m1fn_x2 holds a pair, so a tensor of shape (..., n) is
# imported as uint8 of shape (..., n / 2) and reinterpreted; n must be even.
_PAIR_PACKED = {"F4": "float4_e2m1fn_x2"}
# Newer torch (2.3+) has these; imported as the signed type of the same
# width, then reinterpreted.
_WIDE_UNSIGNED = {"U16": ("uint16", "I16"), "U32": ("uint32", "I32"), "U64": ("uint64", "I64")}
# The torch release that added each dtype above that older ones lack (torch's
# release notes), for the error an older torch gets.
_ADDED_IN = {
    "float8_e4m3fn": "2.1", "float8_e5m2": "2.1", "float8_e4m3fnuz": "2.2", "float8_e5m2fnuz": "2.2",
    "uint16": "2.3", "uint32": "2.3", "uint64": "2.3", "float8_e8m0fnu": "2.7", "float4_e2m1fn_x2": "2.8",
}
# safetensors dtypes no torch release has a dtype for.
_NO_TORCH_DTYPE = {"F6_E2M3", "F6_E3M2"}


class UnsupportedDtypeError(TypeError):
    """A tensor's dtype has no equivalent in the installed torch (or in DLPack)."""


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype.

    UnsupportedDtypeError when the installed torch has none: it names the
    torch release that adds it (F8_E8M0: 2.7, F4: 2.8, ...), or says no
    release has one (F6_E2M3, F6_E3M2). Tensor.raw() exports any dtype's bytes.
    """
    import torch
    name = (_DIRECT.get(dtype) or _BYTE_VIEWED.get(dtype) or _PAIR_PACKED.get(dtype)
            or _WIDE_UNSIGNED.get(dtype, ("",))[0])
    found: Optional[torch.dtype] = getattr(torch, name, None) if name else None
    if found is not None:
        return found
    if name:
        why = f"torch.{name} is added in torch {_ADDED_IN[name]}" if name in _ADDED_IN else f"torch.{name} is missing"
    elif dtype in _NO_TORCH_DTYPE:
        why = "no torch release has a dtype for it"
    else:
        why = "it is not a safetensors dtype weightd knows"
    raise UnsupportedDtypeError(f"safetensors dtype {dtype} has no torch dtype in torch {torch.__version__} "
                                f"({why}); Tensor.raw() exports its bytes")


def element_size(dtype: str) -> int:
    """Bytes per element of the torch dtype of safetensors dtype `dtype` (UnsupportedDtypeError as torch_dtype)."""
    import torch
    return int(torch.empty((), dtype=torch_dtype(dtype)).element_size())


def to_torch_cuda(view: PinnedView) -> torch.Tensor:
    """A torch CUDA tensor over a pinned host tensor's pages (a weightd.PinnedView), no copy.

    WeightdError FAILED_PRECONDITION when this torch cannot use CUDA here: a
    CPU-only build (torch.version.cuda is None) or no GPU visible.
    """
    import torch
    if not torch.cuda.is_available():
        why = "a CPU-only build" if torch.version.cuda is None else "no GPU is visible to it"
        raise WeightdError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"tensor {view.name!r}: torch {torch.__version__} cannot use CUDA here ({why}); a CUDA view "
                           f"of a pinned host tensor needs a CUDA build of torch and a GPU (Tensor.device_ptr gives "
                           f"the raw device address)")
    return to_torch(view)


def to_torch(tensor: Union[Tensor, PinnedView]) -> torch.Tensor:
    """A torch.Tensor sharing `tensor`'s memory (a weightd.Tensor, or the CUDA view of a pinned one), no copy.

    Raises UnsupportedDtypeError naming the tensor and dtype when torch
    cannot represent it.
    """
    from torch.utils.dlpack import from_dlpack  # torch.from_dlpack, which torch 1.13 does not export by name
    dtype = tensor.dtype
    try:
        target = torch_dtype(dtype)
    except UnsupportedDtypeError as e:
        raise UnsupportedDtypeError(f"tensor {tensor.name!r}: {e}") from None
    if dtype in _DIRECT:
        return from_dlpack(tensor)
    if dtype in _BYTE_VIEWED:
        return from_dlpack(tensor._carrier("U8")).view(target)
    if dtype in _PAIR_PACKED:
        shape = tensor.shape
        if not shape or shape[-1] % 2:
            raise UnsupportedDtypeError(
                f"tensor {tensor.name!r}: {dtype} shape {list(shape)} does not pair up into torch.{target} "
                "(its last dimension must be even); Tensor.raw() exports its bytes")
        return from_dlpack(tensor._carrier("U8", shape[:-1] + (shape[-1] // 2,))).view(target)
    return from_dlpack(tensor._carrier(_WIDE_UNSIGNED[dtype][1])).view(target)
