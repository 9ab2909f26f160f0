"""Runtime layouts for the SGLang load format (docs/integration.md, "SGLang").

After SGLang's post-processing (DefaultModelLoader.postprocess_weights: each
module's quant_method.process_weights_after_loading), the first start
publishes the model's parameters and buffers as a layout of its weightd
model, keyed by what decides them (identity_of); a later start with the same
identity attaches it and binds it into a model built on the meta device, with
no load and no post-processing (weightd._engine_layouts, shared with vLLM).

Buffers SGLang computes at construction and keeps out of the state_dict (the
rotary embedding's cos_sin_cache) are published and bound too: a model built
on the meta device would otherwise run on meta tensors there. Where
post-processing leaves state that is not plain tensors (the CPU AMX backend's
packed weights, which modules use only when flagged use_intel_amx_backend) or
the model is quantized, the start publishes nothing and says why in one line.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch
from torch import nn

from ._engine import Options, Session
from ._engine_layouts import EngineLayouts, device_arch, layout_key, tensor_attributes

if TYPE_CHECKING:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig

LAYOUT_ABI = "weightd-sglang-layout-1"  # bump when what is published or how it is bound changes


def identity_of(model_config: ModelConfig, tp_size: int, pp_size: int, rank: int, device_type: str) -> Dict[str, str]:
    """The strings that decide the post-processed tensors of one rank."""
    import sglang

    return {
        "engine": f"sglang {sglang.__version__}",
        "layout_abi": LAYOUT_ABI,
        "architecture": ",".join(getattr(model_config.hf_config, "architectures", None) or ["?"]),
        "dtype": str(model_config.dtype).replace("torch.", ""),
        "quantization": str(model_config.quantization or "none"),
        "parallel": f"tp{tp_size} pp{pp_size}",
        "rank": str(rank),
        "device": f"{device_type} {device_arch()}",
    }


def key_of(identity: Dict[str, str]) -> str:
    """The layout key, e.g. "sglang/LlamaForCausalLM/bfloat16/tp1-pp1" (the rank is the layout's own
    field; the rest of the identity is checked by attach, as for vLLM's keys)."""
    return layout_key("sglang", [identity["architecture"], identity["dtype"], identity["parallel"].replace(" ", "-")])


def not_plain_reason(model: nn.Module, quant_config: Any) -> Optional[str]:
    """Why the post-processed state of `model` cannot be a layout, or None (tensor types are
    checked when publishing)."""
    if quant_config is not None:
        return f"the post-processed state of quantization {quant_config.get_name()!r} is not bound back yet"
    amx = [name for name, module in model.named_modules() if getattr(module, "use_intel_amx_backend", False)]
    if amx:
        return (f"SGLang's CPU AMX backend packed the weights of {len(amx)} modules for sgl-kernel, which uses them "
                f"only where the module's flag use_intel_amx_backend (not a tensor) is set (first: {amx[0]})")
    attributes = tensor_attributes(model)  # e.g. DeepSeek's w_kc/w_vc, made by its own load_weights
    if attributes:
        return (f"{next(iter(attributes))} is a tensor held outside the model's parameters and buffers "
                f"({len(attributes)} such), which SGLang's layouts do not carry yet")
    return None


class Layouts(EngineLayouts):
    """The layout of one SGLang start (one rank): attach it, or publish it after post-processing."""

    @classmethod
    def for_start(cls, options: Options, session: Session, rank: int, model_config: ModelConfig,
                  target_device: torch.device, logger: logging.Logger) -> Optional[Layouts]:
        """Layouts for this start, or None (with one log line) when the option 'layouts' is false."""
        from sglang.srt.runtime_context import get_parallel

        if not cls.enabled(options, logger):
            return None
        parallel = get_parallel()
        identity = identity_of(model_config, int(parallel.tp_size), int(parallel.pp_size), rank, target_device.type)
        device = None  # host-placed on a CPU; on a GPU every tensor on this process's device
        if target_device.type == "cuda":
            device = f"cuda:{torch.cuda.current_device() if target_device.index is None else target_device.index}"
        return cls("SGLang", session, rank, identity, key_of(identity), logger, all_buffers=True, device=device)

    def attach(self, model_config: ModelConfig, load_config: LoadConfig, quant_config: Any) -> Optional[nn.Module]:
        """The model built on the meta device and bound to the published layout, or None when there
        is none yet."""
        from sglang.srt.model_loader.loader import _initialize_model
        from sglang.srt.model_loader.utils import set_default_torch_dtype

        weights = self.attach_weights()
        if weights is None:
            return None
        meta: Any = torch.device("meta")  # a context manager in torch 2.0+
        with set_default_torch_dtype(model_config.dtype), meta:
            model: nn.Module = _initialize_model(model_config, load_config, quant_config)
        return self.bind(model, weights).eval()
