"""Loading an attached model into a torch.nn.Module in one call, zero-copy.

    import weightd, weightd.torch
    with weightd.connect().attach("bert") as weights:
        keys = weightd.torch.load_into(module, weights)   # every parameter now lives in weightd's memory

A post-processed module (fused, re-quantized, transposed: any names, dtypes
and shapes) is published once as a runtime layout, and later processes bind
it into the same module structure built on the meta device:

    weightd.torch.publish_module(client, "bert", "myengine/int8", module, identity=identity)
    ...
    with client.attach("bert", layout="myengine/int8", identity=identity) as layout:
        weightd.torch.load_into(meta_module, layout)

Importing this module imports torch; `import weightd` alone does not.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch

import weightd

if TYPE_CHECKING:
    from torch.nn.modules.module import _IncompatibleKeys

__all__ = ["load_into", "publish_module"]


class _Slot:
    """One parameter or buffer object and every (owner module, attribute) that holds it:
    tied parameters (GPT-2's lm_head.weight and wte.weight) are one slot."""

    __slots__ = ("names", "owners", "tensor", "is_parameter")

    def __init__(self, tensor: torch.Tensor, is_parameter: bool) -> None:
        self.names: List[str] = []
        self.owners: List[Tuple[torch.nn.Module, str]] = []
        self.tensor = tensor
        self.is_parameter = is_parameter


# A checkpoint tensor as load_into takes it.
_Value = Union[weightd.Tensor, torch.Tensor]
# (slot, module-relative name, the checkpoint's tensor) of one loaded key.
_Loaded = Tuple[_Slot, str, torch.Tensor]


def _slots(module: torch.nn.Module) -> Tuple[Dict[str, _Slot], Set[str]]:
    """({name: _Slot} for every parameter and persistent buffer, {non-persistent buffer names}).

    Names are the module's state_dict keys; a tensor reachable under several
    names (tied, or a shared submodule) is one slot listing all of them.
    """
    by_object: Dict[int, _Slot] = {}
    by_name: Dict[str, _Slot] = {}
    non_persistent: Set[str] = set()
    for path, owner in module.named_modules(remove_duplicate=False):
        base = path + "." if path else ""
        for attr, tensor in list(owner._parameters.items()) + list(owner._buffers.items()):
            if tensor is None:
                continue
            name = base + attr
            if attr in owner._buffers and attr in owner._non_persistent_buffers_set:
                non_persistent.add(name)
                continue
            slot = by_object.setdefault(id(tensor), _Slot(tensor, attr in owner._parameters))
            slot.names.append(name)
            slot.owners.append((owner, attr))
            by_name[name] = slot
    return by_name, non_persistent


def _as_torch(value: _Value) -> torch.Tensor:
    return value.to_torch() if isinstance(value, weightd.Tensor) else value


def _has_assign() -> bool:
    """Whether Module.load_state_dict takes assign= (torch 2.1+)."""
    import inspect
    return "assign" in inspect.signature(torch.nn.Module.load_state_dict).parameters


def _assign_directly(slot: _Slot, tensor: torch.Tensor) -> None:
    """What load_state_dict(assign=True) does for one key, for torch without assign=:
    the owner's attribute becomes `tensor` itself (a Parameter wrapping it, no copy)."""
    if slot.is_parameter:
        requires_grad = slot.tensor.requires_grad and (tensor.is_floating_point() or tensor.is_complex())
        tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
    owner, attr = slot.owners[0]
    setattr(owner, attr, tensor)


def _retie(slot: _Slot) -> None:
    """Points every alias of `slot` at the object its first owner now holds."""
    owner, attr = slot.owners[0]
    value = getattr(owner, attr)
    for other, other_attr in slot.owners[1:]:
        setattr(other, other_attr, value)


def _match(weights: Mapping[str, _Value], slots: Dict[str, _Slot], non_persistent: Set[str], prefix: str
           ) -> Tuple[Dict[int, Tuple[_Slot, str, _Value]], List[str]]:
    """Pairs checkpoint tensors with slots: ({slot id: (slot, name, value)}, unexpected names)."""
    matched: Dict[int, Tuple[_Slot, str, _Value]] = {}
    unexpected: List[str] = []
    for checkpoint_name in weights:
        if not checkpoint_name.startswith(prefix):
            continue
        name = checkpoint_name[len(prefix):]
        slot = slots.get(name)
        if slot is None:
            if name not in non_persistent:
                unexpected.append(name)
            continue
        matched.setdefault(id(slot), (slot, name, weights[checkpoint_name]))
    return matched, unexpected


def _check_shapes(module: torch.nn.Module, tensors: List[_Loaded]) -> None:
    errors = [f"size mismatch for {name}: copying a param with shape {tuple(tensor.shape)} from checkpoint, "
              f"the shape in current model is {tuple(slot.tensor.shape)}."
              for slot, name, tensor in tensors if tuple(tensor.shape) != tuple(slot.tensor.shape)]
    if errors:
        raise RuntimeError(f"Error(s) in loading weights for {type(module).__name__}:\n\t" + "\n\t".join(errors))


def _incompatible(missing: List[str], unexpected: List[str]) -> _IncompatibleKeys:
    from torch.nn.modules.module import _IncompatibleKeys
    return _IncompatibleKeys(missing, unexpected)


def _raise_if_strict(module: torch.nn.Module, missing: List[str], unexpected: List[str]) -> None:
    errors = []
    if unexpected:
        errors.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ". ")
    if missing:
        errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ". ")
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(errors))


def load_into(module: torch.nn.Module, weights: Mapping[str, Union[weightd.Tensor, torch.Tensor]], *,
              prefix: str = "", strict: bool = True) -> _IncompatibleKeys:
    """Makes weightd's memory the parameters and persistent buffers of `module`, without copying.

    module: a torch.nn.Module, typically built on the meta device (its own
        parameters are replaced, so they need never be allocated).
    weights: an attached weightd.Model, or any Mapping from checkpoint name
        to weightd.Tensor or torch.Tensor.
    prefix: the checkpoint name of the module's parameter `n` is `prefix + n`
        (e.g. "0.auto_model." for a sentence-transformers checkpoint loaded
        into its BertModel); checkpoint tensors outside `prefix` are not this
        module's and are ignored.
    strict: raise RuntimeError, naming them, when keys are missing or unexpected.

    Each parameter becomes torch.nn.Parameter(weight tensor) with the old
    parameter's requires_grad (load_state_dict(assign=True) on torch 2.1+,
    an equivalent setattr on owners on older torch such as 1.13): its dtype,
    shape and device are the checkpoint's as weightd placed it (host tensors
    on the CPU, device tensors on this process's GPU), its data_ptr lies inside
    the attach's mappings, and it keeps the lease alive while referenced.
    Tied parameters (one object under several names) stay one object.
    Checkpoint tensors that are non-persistent buffers of `module`
    (BERT's embeddings.position_ids) are skipped: neither loaded nor
    unexpected. The tensors are read-only unless the model was attached with
    private=True.

    Returns torch's _IncompatibleKeys(missing_keys, unexpected_keys), in
    module-relative names (a tied group counts as loaded when any of its
    names is in the checkpoint). Raises RuntimeError on a shape mismatch
    (always) and on missing or unexpected keys when `strict`;
    weightd.UnsupportedDtypeError for a dtype torch cannot hold.
    """
    slots, non_persistent = _slots(module)
    matched, unexpected = _match(weights, slots, non_persistent, prefix)
    tensors = [(slot, name, _as_torch(value)) for slot, name, value in matched.values()]
    _check_shapes(module, tensors)
    loaded = {id(slot) for slot, _, _ in tensors}
    missing = [name for name, slot in slots.items() if id(slot) not in loaded]
    if strict:
        _raise_if_strict(module, missing, unexpected)
    if _has_assign():
        state = {slot.names[0]: tensor for slot, _, tensor in tensors}
        load_state_dict: Any = module.load_state_dict  # assign=: torch 2.1+, perhaps newer than the type checker's
        load_state_dict(state, strict=False, assign=True)
    else:
        for slot, _, tensor in tensors:
            _assign_directly(slot, tensor)
    for slot, _, _ in tensors:
        _retie(slot)
    return _incompatible(missing, unexpected)


def _dense_strides(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s elements fill exactly the span its strides reach, with
    no gap and no overlap (contiguous, or a permutation of dims such as .t())."""
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _layout_strides(tensor: torch.Tensor) -> Optional[Sequence[int]]:
    """The strides a tensor is published with: None (contiguous) when it is
    contiguous or has gaps or overlaps (it is then published contiguous), its
    own when it is a dense permutation (a transposed matrix keeps its layout)."""
    if tensor.is_contiguous() or not _dense_strides(tensor):
        return None
    return tuple(tensor.stride())


def publish_module(client: weightd.Client, model: str, key: str, module: torch.nn.Module, *, rank: int = 0,
                   identity: Optional[Mapping[str, str]] = None, device: Union[str, int, None] = None,
                   wait: Union[bool, float] = False,
                   extra: Optional[Mapping[str, torch.Tensor]] = None) -> Optional[weightd.LayoutInfo]:
    """Publishes every parameter and persistent buffer of `module` as runtime layout `key` of `model`.

    Names are the module's state_dict keys; a tied group (one tensor under
    several names) is published once, under its first name, and load_into
    ties it again. Each tensor keeps its dtype and shape; a dense
    non-contiguous tensor (a transposed matrix) keeps its strides, so that
    the attached tensor is laid out, and computes, exactly as this one; one
    with gaps or overlaps (a slice, an expand) is published contiguous.
    Values are copied from CPU or CUDA tensors into the staged memory (one
    copy; device-to-host for CUDA). rank, identity, device, wait: as
    Client.publish_layout (device None: every tensor is host-placed,
    wherever the module's tensors are). extra: more tensors to publish
    beside the module's, by layout name (state the module holds outside its
    parameters and buffers, which load_into does not bind: the caller binds
    it); a name that is also one of the module's is a ValueError.

    Returns the published LayoutInfo, or None when wait found the layout
    published by another writer (nothing of this module was written).
    Raises WeightdError as Client.publish_layout and LayoutWriter.commit
    (nothing is published then); ValueError for a dtype safetensors cannot name.
    """
    slots, _ = _slots(module)
    tensors: Dict[str, torch.Tensor] = {}
    for name, slot in slots.items():
        if name == slot.names[0]:
            tensors[name] = slot.tensor.detach()
    for name, tensor in (extra or {}).items():
        if name in slots:
            raise ValueError(f"extra tensor {name!r} is also a parameter or buffer of the module")
        tensors[name] = tensor.detach()
    specs: Dict[str, Any] = {}
    for name, tensor in tensors.items():
        strides = _layout_strides(tensor)
        specs[name] = (tensor.dtype, tuple(tensor.shape)) if strides is None else \
            (tensor.dtype, tuple(tensor.shape), strides)
    with client.publish_layout(model, key, specs, rank=rank, identity=identity, device=device, wait=wait) as writer:
        if writer.published_by_other:
            return None
        with torch.no_grad():
            for name, tensor in tensors.items():
                if tensor.numel():
                    writer[name].copy_(tensor)
    return writer.result
