"""safetensors dtype -> torch dtype, and the zero-copy import of one tensor."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

    from ._model import Tensor

# torch imports these straight through DLPack.
_DIRECT = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "C64": "complex64",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
}
# One byte per element: imported as uint8 with the same shape, then
# reinterpreted in place (DLPack 0.6 has no float8 code; older torch refuses
# DLPack booleans).
_BYTE_VIEWED = {"BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
# Newer torch (2.3+) has these; imported as the signed type of the same
# width, then reinterpreted.
_WIDE_UNSIGNED = {"U16": ("uint16", "I16"), "U32": ("uint32", "I32"), "U64": ("uint64", "I64")}


class UnsupportedDtypeError(TypeError):
    """A tensor's dtype has no equivalent in the installed torch (or in DLPack)."""


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype; UnsupportedDtypeError when the installed torch has none."""
    import torch
    name = _DIRECT.get(dtype) or _BYTE_VIEWED.get(dtype) or _WIDE_UNSIGNED.get(dtype, ("",))[0]
    found: Optional[torch.dtype] = getattr(torch, name, None) if name else None
    if found is None:
        raise UnsupportedDtypeError(
            f"safetensors dtype {dtype} has no torch dtype in torch {torch.__version__}"
            + (f" (torch.{name} is missing)" if name else "")
            + "; Tensor.raw() exports its bytes")
    return found


def to_torch(tensor: Tensor) -> torch.Tensor:
    """A torch.Tensor sharing `tensor`'s memory (a weightd.Tensor), no copy.

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
    return from_dlpack(tensor._carrier(_WIDE_UNSIGNED[dtype][1])).view(target)
