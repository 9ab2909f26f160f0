"""Tensors that weightd split by a TP plan (option `tp_rules`), fed to vLLM as shards.

vLLM's linear layers narrow every tensor to their TP rank's slice unless the
parameter says the tensor is already sharded (`is_sharded_weight`, as for
pre-sharded bitsandbytes checkpoints). weightd's even split along a rule's
dim is the slice vLLM's column- and row-parallel layers take (q/k/v, gate/up,
o/down projections), so a tensor that weightd split is marked, and while
load_weights runs each parameter's weight_loader sets `is_sharded_weight`
for exactly the marked tensors. A marked tensor that reaches any other
loader (an embedding, a layer that is not a linear layer) is refused with a
LoadFormatError naming it: vLLM would take another slice than weightd did.
Untested on this project's CPU machines (vLLM CPU with TP > 1 needs more
cores than CI has); a whole model (no tp_rules) is the tested path.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterable, Iterator, Set, Tuple

from torch import nn

from ._engine import LoadFormatError

_MARK = "_weightd_split_name"  # attribute on a torch tensor: the weightd name of a split tensor


def mark_split(pairs: Iterable[Tuple[str, Any]], split: Set[str]) -> Iterator[Tuple[str, Any]]:
    """The (name, tensor) pairs with every tensor named in `split` marked as a shard."""
    for name, tensor in pairs:
        if name in split:
            setattr(tensor, _MARK, name)
        yield name, tensor


def _wrapped(param: nn.Parameter, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    from vllm.model_executor.layers.linear import LinearBase

    def weight_loader(target: nn.Parameter, loaded_weight: Any, *args: Any, **kwargs: Any) -> Any:
        split_name = getattr(loaded_weight, _MARK, None)
        if split_name is None:
            return original(target, loaded_weight, *args, **kwargs)
        if not isinstance(getattr(original, "__self__", None), LinearBase):
            raise LoadFormatError(f"tensor {split_name!r} is split by weightd's tp_rules, but vLLM's parameter "
                                  f"{name!r} shards whole tensors itself: remove the rule that matches it")
        target.is_sharded_weight = True  # type: ignore[attr-defined]
        try:
            return original(target, loaded_weight, *args, **kwargs)
        finally:
            del target.is_sharded_weight  # type: ignore[attr-defined]
    return weight_loader


@contextlib.contextmanager
def shard_aware(model: nn.Module) -> Iterator[None]:
    """Within: every parameter's weight_loader honours tensors marked by mark_split."""
    originals: Dict[int, Tuple[nn.Parameter, Any]] = {}
    for name, param in model.named_parameters():
        original = getattr(param, "weight_loader", None)
        if original is not None and id(param) not in originals:
            originals[id(param)] = (param, original)
            setattr(param, "weight_loader", _wrapped(param, name, original))
    try:
        yield
    finally:
        for param, original in originals.values():
            setattr(param, "weight_loader", original)
