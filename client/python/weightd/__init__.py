"""weightd: map model weights served by the weightd daemon, zero-copy.

    import torch, weightd
    with weightd.connect().attach("llama", rank=0) as model:
        engine_model.load_weights(model.weights_iterator())  # (name, torch.Tensor), no copy

A writer publishes the next generation (docs/api.md, "Publishing a generation from a writer"):

    with weightd.connect().update("llama", tensors=["w"]) as up:
        up["w"].copy_(new_w)  # writable, zero-copy; commits on a clean exit, aborts on an exception

An engine publishes the weights it post-processed (a runtime layout), once;
later processes attach them (docs/integration.md, "Runtime layouts"):

    try:
        model = client.attach("llama", layout="myengine/int8", identity=identity)
    except weightd.LayoutNotFound:
        ...  # load, post-process, then weightd.torch.publish_module(client, "llama", "myengine/int8", module, ...)

One call for a torch.nn.Module or a Hugging Face model (these import torch):

    weightd.torch.load_into(module, model)                       # zero-copy, ties kept
    weightd.transformers.load_model(model, "/models/bert")       # from config.json only

See docs/integration.md. Tensors are read-only shared memory: writing to
one kills this process with SIGSEGV (the daemon and other clients are
unaffected), unless attached with attach(..., private=True), which maps
copy-on-write. `import weightd` needs grpcio and protobuf, not torch.
"""
from __future__ import annotations

import importlib
import types
from typing import TYPE_CHECKING
from ._client import DEFAULT_SOCKET, Client, connect
from ._errors import LayoutMismatch, LayoutNotFound, WeightdError
from ._layout import LayoutWriter
from ._model import Model, PinnedView, Tensor
from ._torch import UnsupportedDtypeError, torch_dtype
from ._types import (CommitResult, LayoutInfo, LoadProgress, LoadResult, Manifest, ModelInfo, ModelState, PinProgress,
                     PinState, SegmentInfo, TensorInfo, UnloadResult, WatchEvent, WatchEventKind)
from ._update import Update
from ._watch import Watch

__all__ = [
    "DEFAULT_SOCKET", "Client", "connect", "WeightdError", "Model", "Tensor", "UnsupportedDtypeError",
    "torch_dtype", "LoadProgress", "LoadResult", "Manifest", "ModelInfo", "ModelState", "SegmentInfo", "TensorInfo",
    "UnloadResult", "Watch", "WatchEvent", "WatchEventKind", "Update", "CommitResult", "PinnedView", "PinProgress",
    "PinState", "LayoutNotFound", "LayoutMismatch", "LayoutWriter", "LayoutInfo",
]


# weightd.torch and weightd.transformers import their frameworks, so they
# load on first use rather than with the package. Type checkers see them as
# the submodules they are, and no other attribute (a module __getattr__
# would make any misspelt name type-check).
if TYPE_CHECKING:
    from . import torch as torch, transformers as transformers
else:
    def __getattr__(name: str) -> types.ModuleType:
        if name in ("torch", "transformers"):
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
