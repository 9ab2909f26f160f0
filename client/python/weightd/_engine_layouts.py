"""What the engine load formats' runtime layouts share (weightd._vllm_layouts,
weightd._sglang_layouts; docs/integration.md "Restarts and runtime layouts").

One start (one rank) either attaches the layout its identity names and binds
it into a model built on the meta device, or loads and post-processes as
without layouts and then publishes the post-processed parameters and buffers
once (wait=True: ranks of two engines starting together publish once). What
differs per engine (the identity, how a model is built, which engine state is
not plain tensors) stays in the engine's module; the log lines and the
identity-mismatch error are the same for every engine, with its name in them.
vLLM's Layouts (weightd._vllm_layouts) uses attach_weights, device_arch and
layout_key and publishes with its own step; SGLang's uses all of this module.

Imports torch, no engine.
"""
from __future__ import annotations

import contextlib
import logging
import re
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ._engine import LoadFormatError, Options, Session


def device_arch() -> str:
    """This process's compute device for an identity: "sm_90" on a CUDA GPU, else torch's CPU capability ("AVX512")."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    cpu: Any = getattr(torch.backends, "cpu")  # torch 2.0+
    return str(cpu.get_cpu_capability())


def layout_key(engine: str, parts: Sequence[str]) -> str:
    """"ENGINE/PART/PART...", each part with the characters a layout key may not hold replaced by '_'."""
    return engine + "/" + "/".join(re.sub(r"[^A-Za-z0-9._:+=-]", "_", p) for p in parts)


def own_dispatch(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a subclass that dispatches torch ops itself (FP8 or torchao tensors, DTensor):
    state its bytes do not show. The engines' own parameter classes (vLLM's and SGLang's
    ModelWeightParameter, ...) subclass nn.Parameter for their weight loaders only, and do not."""
    return getattr(type(tensor), "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__


def not_plain_tensor(model: nn.Module) -> Optional[str]:
    """Why a parameter or buffer of `model` cannot be published (a tensor subclass with its own
    dispatch), or None."""
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if own_dispatch(tensor):
            return f"{name} is a {type(tensor).__name__}, a tensor subclass with its own dispatch"
    return None


def tensor_attributes(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The non-empty tensors a module tree holds as plain attributes, neither parameters nor buffers,
    by dotted name: state a model built on the meta device lacks (vLLM's attention _k_scale_cpu; MLA's
    w_kc / W_UV that an engine's load_weights or post-processing makes). An empty tensor is a slot the
    engine fills later (vLLM's attn.kv_cache before the KV cache is bound) and is left out."""
    found: Dict[str, torch.Tensor] = {}
    for path, module in model.named_modules():
        for attribute, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.numel():
                found[(path + "." if path else "") + attribute] = value
    return found


@contextlib.contextmanager
def all_buffers_persistent(model: nn.Module) -> Iterator[None]:
    """Within the block, every buffer of `model` is in its state_dict, so publish_module publishes
    and load_into binds them too: a non-persistent buffer (a rotary embedding's cos/sin cache) is
    computed at construction, and a model built on the meta device would keep a meta tensor there."""
    saved = [(module, set(module._non_persistent_buffers_set)) for module in model.modules()]
    for module, _ in saved:
        module._non_persistent_buffers_set.clear()
    try:
        yield
    finally:
        for module, names in saved:
            module._non_persistent_buffers_set.update(names)


class EngineLayouts:
    """The layout of one start (one rank) of one engine: attach its tensors, or publish them.

    engine: the engine's name in log lines and errors ("vLLM", "SGLang").
    all_buffers: publish and bind non-persistent buffers too (all_buffers_persistent).
    device: as Client.publish_layout's (None: every tensor host-placed).
    Thread-safety: the loading thread only.
    """

    def __init__(self, engine: str, session: Session, rank: int, identity: Dict[str, str], key: str,
                 logger: logging.Logger, *, all_buffers: bool = False, device: Union[str, int, None] = None) -> None:
        self.engine = engine
        self.session = session
        self.rank = rank
        self.identity = identity
        self.key = key
        self.logger = logger
        self.all_buffers = all_buffers
        self.device = device

    @staticmethod
    def enabled(options: Options, logger: logging.Logger) -> bool:
        """Whether this start uses layouts; one log line when the option 'layouts' turns them off."""
        if not options.layouts:
            logger.info("weightd: runtime layouts off (option 'layouts' is false)")
        return options.layouts

    def attach_weights(self) -> Any:
        """The attached layout (a weightd.Model; its tensors keep the lease), or None when there is
        none yet (LayoutNotFound, one log line); LoadFormatError when its identity differs."""
        import weightd

        client: Any = self.session.client
        try:
            return client.attach(self.session.name, self.rank, layout=self.key, identity=self.identity)
        except weightd.LayoutNotFound:
            self.logger.info("weightd: no runtime layout %r of model %r yet: loading and post-processing",
                             self.key, self.session.name)
            return None
        except weightd.LayoutMismatch as e:
            raise LoadFormatError(f"runtime layout {self.key!r} of model {self.session.name!r} has another "
                                  f"identity than this {self.engine} start ({e}): drop it (weightctl drop-layout "
                                  f"{self.session.name} {self.key}) or start with the option 'layouts' false") from None

    def bind(self, model: nn.Module, weights: Any) -> nn.Module:
        """`model` (built on the meta device) with the layout's tensors as its parameters and buffers."""
        import weightd.torch

        with all_buffers_persistent(model) if self.all_buffers else contextlib.nullcontext():
            weightd.torch.load_into(model, weights, strict=True)
        return model

    def publish_model(self, model: nn.Module, reason: Optional[str],
                      extra: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        """Publishes the post-processed parameters and buffers of `model` (and the tensors of `extra`,
        as publish_module's), or not when `reason` (why its state is not plain tensors) is given; one
        log line either way."""
        import weightd.torch

        reason = reason or not_plain_tensor(model)
        if reason is not None:
            self.logger.info("weightd: runtime layout not published, the next start loads and post-processes "
                             "again: %s", reason)
            return
        # wait: ranks of two engines starting together publish once; the
        # later one finds it published and keeps its own post-processed copy.
        with all_buffers_persistent(model) if self.all_buffers else contextlib.nullcontext():
            published = weightd.torch.publish_module(self.session.client, self.session.name, self.key, model,
                                                     rank=self.rank, identity=self.identity, device=self.device,
                                                     wait=True, extra=extra)
        if published is None:
            self.logger.info("weightd: runtime layout %r of model %r rank %d was published by another start meanwhile",
                             self.key, self.session.name, self.rank)
            return
        where = ", ".join(f"{n} bytes on {gpu}" for gpu, n in sorted(published.device_bytes.items())) or \
            f"{published.host_bytes} bytes on the host"
        self.logger.info("weightd: published runtime layout %r of model %r rank %d (%d tensors, %s)",
                         self.key, self.session.name, self.rank, published.tensor_count, where)

