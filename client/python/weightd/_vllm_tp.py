"""Tensors that weightd split by a TP plan (option `tp_rules`), fed to vLLM as shards.

vLLM's linear layers narrow every tensor to their TP rank's slice: the
weight_loader of a plain parameter unless it says the tensor is already
sharded (`is_sharded_weight`, as for pre-sharded bitsandbytes checkpoints),
weight_loader_v2 of a BasevLLMParameter always, at `param.tp_rank` times the
slice's size. weightd's even split along a rule's dim is the slice vLLM's
column- and row-parallel layers take (q/k/v, gate/up, o/down projections),
so a tensor that weightd split is marked, and while load_weights runs each
parameter's weight_loader, for exactly the marked tensors, sets
`is_sharded_weight` and makes the parameter's tp_rank 0 for the call (the
slice at offset 0 of a shard is the whole shard). A marked tensor that reaches any other
loader (an embedding, a layer that is not a linear layer) is refused with a
LoadFormatError naming it: vLLM would take another slice than weightd did.
Tested against the real vLLM on the CPU with TP 2 (tests/python/engines/test_vllm.py,
a daemon on the emulated device backend splitting the tiny Llama's q/k/v/o,
gate/up/down projections).
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
        # weight_loader honours is_sharded_weight; weight_loader_v2 (vLLM's BasevLLMParameter, e.g. every
        # unquantized linear layer) ignores it and narrows at its tp_rank's offset, which on a shard of
        # exactly the slice's size is the whole shard at offset 0: so rank 0 for the call.
        target.is_sharded_weight = True  # type: ignore[attr-defined]
        rank = getattr(target, "tp_rank", None)
        if rank is not None:
            target.tp_rank = 0  # type: ignore[attr-defined]
        try:
            return original(target, loaded_weight, *args, **kwargs)
        finally:
            del target.is_sharded_weight  # type: ignore[attr-defined]
            if rank is not None:
                target.tp_rank = rank  # type: ignore[attr-defined]
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
