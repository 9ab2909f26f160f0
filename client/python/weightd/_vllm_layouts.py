"""Runtime layouts for the vLLM load format (docs/integration.md, "vLLM": "Restarts and runtime layouts").

After vLLM post-processed the weights (process_weights_after_loading: fused,
re-quantized, repacked), the first start publishes the model's parameters and
buffers as a layout of its weightd model, keyed by everything that decides
them (identity below); a later start with the same identity attaches that
layout and binds it into a model built on the meta device, skipping both the
load and the post-processing.

Uses the client API of runtime layouts (Client.attach(..., layout=,
identity=), weightd.torch.publish_module / load_into, weightd.LayoutNotFound
/ LayoutMismatch; docs/api.md "Runtime layouts"). Only plain tensors can be
published: where post-processing leaves state that is not (vLLM's CPU backend
packs linear weights into oneDNN handles held by closures) or a quantized
model whose post-processed state this module does not bind back, the start
loads and post-processes as without layouts, with one log line saying why.
The attach and its one-line identity-mismatch error are the steps shared with
SGLang (weightd._engine_layouts).
"""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch
from torch import nn

from ._engine import LoadFormatError, Options, Session
from ._engine_layouts import EngineLayouts, device_arch, layout_key, own_dispatch, tensor_attributes

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig

LAYOUT_ABI = "weightd-vllm-layout-2"  # bump when what is published or how it is bound changes
# The layout tensor (uint8, JSON {name: device type}) naming the tensors published from outside_state().
OUTSIDE_STATE = "weightd.vllm.outside_state"


def identity_of(vllm_config: VllmConfig, rank: int) -> Dict[str, str]:
    """The strings that decide the post-processed tensors of one rank."""
    import vllm
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    return {
        "engine": f"vllm {vllm.__version__}",
        "layout_abi": LAYOUT_ABI,
        "architecture": ",".join(getattr(model_config.hf_config, "architectures", None) or ["?"]),
        "dtype": str(model_config.dtype).replace("torch.", ""),
        "quantization": str(model_config.quantization or "none"),
        "parallel": f"tp{parallel.tensor_parallel_size} pp{parallel.pipeline_parallel_size} "
                    f"dp{parallel.data_parallel_size}",
        "rank": str(rank),
        "device": f"{current_platform.device_type} {device_arch()}",
    }


def key_of(identity: Dict[str, str]) -> str:
    """The layout key, e.g. "vllm/LlamaForCausalLM/bfloat16/tp1-pp1-dp1": the slot of one model shape
    (the rank is the layout's own field). The rest of the identity (vLLM's version, the layout ABI,
    quantization, device) is checked by attach, so a start whose engine or device changed is refused
    (LayoutMismatch) instead of silently publishing into another slot. Keys are [A-Za-z0-9._:/+=-]."""
    parts = [identity["architecture"], identity["dtype"], identity["parallel"].replace(" ", "-")]
    return layout_key("vllm", parts)


def not_plain_reason(model: nn.Module, model_config: ModelConfig) -> Optional[str]:
    """Why the post-processed state of `model` cannot be a layout, or None when it is plain tensors.

    Not plain: a quantized model (its post-processed state is not bound back yet); a linear layer whose
    weight vLLM's CPU backend moved into a handle (oneDNN, sgl-kernel or zentorch: the parameter is left
    an empty tensor and the packed weight lives only in the closure `layer.cpu_linear`,
    vllm/model_executor/layers/utils.py dispatch_cpu_unquantized_gemm); an outside_state() tensor of a
    tensor subclass with its own dispatch (state its bytes do not show; parameters and buffers are
    checked by EngineLayouts.publish_model, not_plain_tensor).
    Tensors outside parameters and persistent buffers are published (outside_state). A CPU layer whose
    weight stayed in place (vLLM's fallback to
    torch.nn.functional.linear, or a handle made beside a kept weight, as for lm_head) is plain: the
    bound model computes it with torch.nn.functional.linear from the same tensor."""
    if model_config.quantization is not None:
        return f"the post-processed state of quantization {model_config.quantization!r} is not bound back yet"
    packed: List[str] = [name for name, module in model.named_modules()
                         if hasattr(module, "cpu_linear") and _emptied(getattr(module, "weight", None))]
    if packed:
        return (f"vLLM's CPU backend packed {len(packed)} linear weights into oneDNN handles, which are not tensors "
                f"(first: {packed[0]})")
    for name, tensor in outside_state(model).items():
        if own_dispatch(tensor):
            return f"{name} is a {type(tensor).__name__}, a tensor subclass with its own dispatch"
    return None


def outside_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The tensors a module tree holds outside its parameters and persistent buffers, by dotted name:
    non-persistent buffers (the rotary embedding's cos_sin_cache) and tensors held as plain attributes
    (an attention layer's _k_scale_cpu; MLA's W_UV made by post-processing). A meta-built model has
    none of their values, so a layout carries them (publish_module's extra) and _bind sets them back.
    Empty tensors are slots the engine fills later (attn.kv_cache before the KV cache is bound)."""
    found: Dict[str, torch.Tensor] = {}
    for path, module in model.named_modules():
        for attribute in sorted(module._non_persistent_buffers_set):
            buffer = module._buffers.get(attribute)
            if buffer is not None and buffer.numel():
                found[(path + "." if path else "") + attribute] = buffer
    found.update(tensor_attributes(model))
    return found


def _emptied(weight: Any) -> bool:
    return isinstance(weight, torch.Tensor) and weight.numel() == 0


class Layouts:
    """The layout of one start (one rank): attach it, or publish it after post-processing, through the
    steps shared with SGLang (EngineLayouts)."""

    def __init__(self, session: Session, rank: int, identity: Dict[str, str], logger: logging.Logger) -> None:
        self.key = key_of(identity)
        self.shared = EngineLayouts("vLLM", session, rank, identity, self.key, logger)

    @classmethod
    def for_start(cls, options: Options, session: Session, rank: int, vllm_config: VllmConfig,
                  logger: logging.Logger) -> Optional[Layouts]:
        """Layouts for this start, or None (with one log line) when the path is off or unavailable."""
        if not EngineLayouts.enabled(options, logger):
            return None
        if getattr(vllm_config.cache_config, "calculate_kv_scales", False):
            logger.info("weightd: runtime layouts off: calculate_kv_scales makes vLLM write the attention layers' "
                        "scale buffers in place, and a layout's tensors are read-only")
            return None
        return cls(session, rank, identity_of(vllm_config, rank), logger)

    def attach(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str) -> Optional[nn.Module]:
        """The model bound to the published layout, or None when there is none yet (LayoutNotFound)."""
        weights = self.shared.attach_weights()
        return _bind(weights, vllm_config, model_config, prefix) if weights is not None else None

    def publish(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Publishes the post-processed parameters, buffers and outside state; one log line either way."""
        reason = not_plain_reason(model, model_config)
        outside: Dict[str, torch.Tensor] = {}
        if reason is None:
            # On a GPU the layout is device-placed on this rank's GPU (the daemon copies it into an arena of
            # its own there), so the next start binds GPU tensors; on a CPU it is host-placed.
            self.shared.device = torch.cuda.current_device() if any(p.is_cuda for p in model.parameters()) else None
            outside = outside_state(model)
            devices = {name: tensor.device.type for name, tensor in outside.items()}
            outside[OUTSIDE_STATE] = torch.frombuffer(bytearray(json.dumps(devices, sort_keys=True).encode()),
                                                      dtype=torch.uint8)
        self.shared.publish_model(model, reason, extra=outside)


def _bind(weights: Any, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str) -> nn.Module:
    """A model built on the meta device with the layout's tensors as its parameters and buffers."""
    import weightd.torch
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype

    meta: Any = torch.device("meta")  # a context manager in torch 2.0+
    with set_default_torch_dtype(model_config.dtype), meta:
        model: nn.Module = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
    if OUTSIDE_STATE not in weights:
        raise LoadFormatError(f"runtime layout has no {OUTSIDE_STATE!r}: not published by {LAYOUT_ABI}")
    devices: Dict[str, str] = json.loads(bytes(weights[OUTSIDE_STATE].to_torch().cpu().numpy()).decode())
    weightd.torch.load_into(model, {name: weights[name] for name in weights
                                    if name not in devices and name != OUTSIDE_STATE}, strict=True)
    for name, device in devices.items():
        # A private copy (these are small: scales, a rotary cache) on the device the publishing start had
        # it on: vLLM may write such state in place, which must never reach weightd's read-only memory.
        path, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(path), attribute, weights[name].to_torch().to(device, copy=True))
    if current_platform.is_cpu():  # what CPU post-processing sets besides tensors, for plain state
        for module in model.modules():
            if hasattr(module, "quant_method"):
                setattr(module, "cpu_linear", torch.nn.functional.linear)
    return model.eval()
