"""Hugging Face `transformers` models built from config.json and loaded from weightd.

    import weightd, weightd.transformers
    weights = weightd.connect().attach("gpt2")
    model = weightd.transformers.load_model(weights, "/models/gpt2")   # reads config.json only

No weight file is read and no parameter memory is allocated: the model is
built with its parameters on the meta device, then weightd.torch.load_into
points them at weightd's memory. Importing this module imports torch and
transformers.
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Iterator, List, Mapping, Optional, Tuple, Union

import torch
import transformers

import weightd
from .torch import _raise_if_strict, load_into

__all__ = ["load_model", "empty_parameters"]


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Within it, every parameter a module registers is moved to the meta device.

    Buffers stay where their module creates them (non-persistent buffers such
    as position_ids are not in checkpoints and must hold real values).
    Works on torch 1.13 and 2.x (as accelerate.init_empty_weights does); a
    parameter's CPU tensor exists only until it is registered, and the
    initialisers that run later touch meta tensors only.
    """
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: Optional[torch.nn.Parameter]) -> None:
        register(module, name, param)
        registered = module._parameters[name]
        if param is not None and registered is not None and param.device.type != "meta":
            module._parameters[name] = type(registered)(registered.to("meta"), requires_grad=param.requires_grad)

    setattr(torch.nn.Module, "register_parameter", register_on_meta)  # (type checkers refuse assigning a method)
    try:
        yield
    finally:
        setattr(torch.nn.Module, "register_parameter", register)


def _config(config: Union[transformers.PretrainedConfig, str, os.PathLike[str]]) -> Any:
    if isinstance(config, transformers.PretrainedConfig):
        return config
    path = os.fspath(config)
    return transformers.AutoConfig.from_pretrained(os.path.dirname(path) if path.endswith(".json") else path)


def _model_class(config: Any, model_class: Optional[type]) -> Any:
    if model_class is not None:
        return model_class
    for name in config.architectures or ():
        if hasattr(transformers, name):
            return getattr(transformers, name)
    return transformers.AutoModel


def _build(cls: Any, config: Any) -> Any:
    with empty_parameters():
        if hasattr(cls, "from_config"):  # Auto classes
            return cls.from_config(config)
        return cls(config)


def _target(model: torch.nn.Module, names: List[str], prefix: Optional[str]) -> Tuple[torch.nn.Module, str]:
    """(module to load, checkpoint prefix), resolving a base-model prefix either way:
    a BertModel from a BertForMaskedLM checkpoint ("bert." stripped), or a
    GPT2LMHeadModel from a GPT2Model checkpoint (loaded into model.transformer)."""
    if prefix is not None:
        return model, prefix
    base = getattr(model, "base_model_prefix", "")
    carries_base = bool(base) and any(n.startswith(base + ".") for n in names)
    has_base = bool(base) and isinstance(getattr(model, base, None), torch.nn.Module)
    if carries_base and not has_base:
        return model, base + "."
    if has_base and not carries_base:
        return getattr(model, base), ""
    return model, ""


def _still_on_meta(model: torch.nn.Module) -> List[str]:
    """State-dict names of parameters and persistent buffers nothing was loaded into."""
    names = [n for n, p in model.named_parameters() if p.is_meta]
    for path, owner in model.named_modules():
        for attr, b in owner._buffers.items():
            if b is not None and b.is_meta and attr not in owner._non_persistent_buffers_set:
                names.append(f"{path}.{attr}" if path else attr)
    return names


def _ignored(model: torch.nn.Module, names: List[str]) -> List[str]:
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    return [n for n in names if not any(re.search(p, n) for p in patterns)]


def load_model(weights: Mapping[str, Union[weightd.Tensor, torch.Tensor]],
               config: Union[transformers.PretrainedConfig, str, os.PathLike[str]], *,
               model_class: Optional[type] = None, prefix: Optional[str] = None, strict: bool = True,
               output_loading_info: bool = False) -> Any:
    """A `transformers` model whose parameters are weightd's memory, in eval mode.

    weights: an attached weightd.Model (or a Mapping of name -> weightd.Tensor
        / torch.Tensor); the model keeps its lease alive.
    config: a transformers.PretrainedConfig, a folder holding config.json, or
        the path of a config.json.
    model_class: the class to build (BertModel, GPT2LMHeadModel, an Auto
        class ...); default: config.architectures[0], else AutoModel.
    prefix: checkpoint name = prefix + parameter name (see
        weightd.torch.load_into). None: automatic, like from_pretrained: the
        model's base_model_prefix ("bert.", "transformer.") is stripped from
        or added to checkpoint names as needed.
    strict: raise RuntimeError naming missing keys (parameters still on the
        meta device after loading and tying) and unexpected ones (minus the
        class's _keys_to_ignore_on_load_unexpected).

    Tied weights are tied again after loading (model.tie_weights()), so a
    checkpoint that stores only one of them (save_pretrained drops
    lm_head.weight) loads completely. Returns the model, or (model,
    {"missing_keys": [...], "unexpected_keys": [...]}) with
    output_loading_info (typed Any: transformers ships no type information).
    """
    config = _config(config)
    model = _build(_model_class(config, model_class), config)
    target, prefix = _target(model, list(weights), prefix)
    keys = load_into(target, weights, prefix=prefix, strict=False)
    model.tie_weights()
    missing, unexpected = _still_on_meta(model), _ignored(model, keys.unexpected_keys)
    if strict:
        _raise_if_strict(model, missing, unexpected)
    model.eval()
    if output_loading_info:
        return model, {"missing_keys": missing, "unexpected_keys": unexpected}
    return model

