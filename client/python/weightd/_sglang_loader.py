"""The SGLang loader class of weightd.sglang (imported when first used: it imports SGLang)."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.layers.utils import get_layer_id
from sglang.srt.model_loader.loader import (BaseModelLoader, DefaultModelLoader, _get_quantization_config,
                                             _initialize_model)
from sglang.srt.model_loader.utils import set_default_torch_dtype
from sglang.srt.runtime_context import get_parallel
from torch import nn

from ._engine import LoadFormatError, Options, Session, TrackedNames, mismatch_error
from ._errors import WeightdError
from ._sglang_check import WriteTracker
from ._sglang_layouts import Layouts, not_plain_reason

logger = logging.getLogger("sglang.weightd")


class WeightdModelLoader(BaseModelLoader):  # type: ignore[misc]
    """SGLang's BaseModelLoader over weightd: one instance per model runner's load."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options = Options.from_config(load_config.model_loader_extra_config)

    def download_model(self, model_config: Any) -> None:
        """Nothing to download: the daemon holds the checkpoint, or loads it from the local folder."""

    def load_model(self, *, model_config: Any, device_config: Any) -> nn.Module:
        """A runtime layout of this configuration when weightd has one (no load, no post-processing);
        else the model built as DefaultModelLoader builds it, this rank's tensors fed from weightd
        through model.load_weights (checked for missing and unexpected tensors), SGLang's
        post-processing, then the layout published. Leases of loaded tensors end on return."""
        parallel = get_parallel()  # this process's place, as SGLang's ModelRunner reads it
        session = Session.create(self.options, model_config.model_path, logger)
        rank = session.rank_for(int(parallel.tp_rank), int(parallel.tp_size))
        start = time.perf_counter()
        target_device = torch.device(device_config.device)
        quant_config = _get_quantization_config(model_config, self.load_config)
        layouts = Layouts.for_start(self.options, session, rank, model_config, target_device, logger)
        attached = layouts.attach(model_config, self.load_config, quant_config) if layouts is not None else None
        if layouts is not None and attached is not None:
            logger.info("weightd: start of model %r rank %d: attached runtime layout %r in %.2f s "
                        "(no load, no post-processing)", session.name, rank, layouts.key, time.perf_counter() - start)
            return attached
        device_context: Any = target_device  # a context manager in torch 2.0+
        with set_default_torch_dtype(model_config.dtype):
            with device_context:
                model: nn.Module = _initialize_model(model_config, self.load_config, quant_config)
            self._load_weights(session, rank, model, target_device, checked=quant_config is None)
            DefaultModelLoader.postprocess_weights(model, target_device)
        logger.info("weightd: start of model %r rank %d: loaded and post-processed in %.2f s", session.name, rank,
                    time.perf_counter() - start)
        if layouts is not None:
            layouts.publish_model(model, not_plain_reason(model, quant_config))
        return model.eval()

    def _load_weights(self, session: Session, rank: int, model: nn.Module, target_device: torch.device,
                      checked: bool) -> None:
        """Feeds this rank's tensors through model.load_weights; LoadFormatError when the model refuses
        one, or (checked: unquantized models) when one is unexpected or a parameter is missing."""
        start = time.perf_counter()
        try:
            weights = session.client.attach(session.name, rank)
        except WeightdError as e:
            raise LoadFormatError(f"attaching model {session.name!r} rank {rank} failed: {e}") from None
        tracker = WriteTracker(model)
        with weights, tracker.watching():
            tracked = TrackedNames(tracker.feed(weights.weights_iterator()))
            try:
                DefaultModelLoader.load_weights_only(model, tracked, target_device)
            except Exception as e:  # the model's loader refused a name or a shape
                raise mismatch_error(session.name, rank, type(model).__name__, refused=tracked.last or "?",
                                     cause=e) from e
        if checked:
            config = getattr(model, "config", None)
            tracker.check(session.name, rank, bool(getattr(config, "tie_word_embeddings", False)),
                          _in_this_stage(model, int(get_parallel().pp_size)))
        logger.info("weightd: fed %d tensors of model %r (generation %d, rank %d) through %s.load_weights in %.2f s",
                    tracked.count, session.name, weights.generation, rank, type(model).__name__,
                    time.perf_counter() - start)


def _in_this_stage(model: nn.Module, pp_size: int) -> Callable[[str], bool]:
    """Whether a checkpoint name is this pipeline stage's to load: a layer in the model's
    [start_layer, end_layer); with PP, a name outside the layers may belong to another stage."""
    inner = getattr(model, "model", None)
    first, end = getattr(inner, "start_layer", None), getattr(inner, "end_layer", None)

    def in_stage(name: str) -> bool:
        layer = get_layer_id(name)
        if layer is None:
            return pp_size == 1
        return first is None or end is None or first <= int(layer) < end
    return in_stage
