"""weightd: map model weights served by the weightd daemon, zero-copy.

    import torch, weightd
    with weightd.connect().attach("llama", rank=0) as model:
        engine_model.load_weights(model.weights_iterator())  # (name, torch.Tensor), no copy

See docs/integration.md. Tensors are read-only shared memory: writing to
one kills this process with SIGSEGV (the daemon and other clients are
unaffected).
"""
from ._client import DEFAULT_SOCKET, Client, connect
from ._errors import WeightdError
from ._model import Model, Tensor
from ._torch import UnsupportedDtypeError, torch_dtype
from ._types import LoadProgress, LoadResult, Manifest, ModelInfo, SegmentInfo, TensorInfo, UnloadResult, WatchEvent
from ._watch import Watch

__all__ = [
    "DEFAULT_SOCKET", "Client", "connect", "WeightdError", "Model", "Tensor", "UnsupportedDtypeError",
    "torch_dtype", "LoadProgress", "LoadResult", "Manifest", "ModelInfo", "SegmentInfo", "TensorInfo",
    "UnloadResult", "Watch", "WatchEvent",
]
