"""The SGLang loader class of weightd.sglang (imported when first used: it imports SGLang)."""
from __future__ import annotations

import logging
import time
from typing import Any

import torch
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.model_loader.loader import (BaseModelLoader, DefaultModelLoader, _get_quantization_config,
                                             _initialize_model)
from sglang.srt.model_loader.utils import set_default_torch_dtype
from sglang.srt.runtime_context import get_parallel
from torch import nn

from ._engine import LoadFormatError, Options, Session, TrackedNames, mismatch_error
from ._errors import WeightdError

logger = logging.getLogger("sglang.weightd")


class WeightdModelLoader(BaseModelLoader):  # type: ignore[misc]
    """SGLang's BaseModelLoader over weightd: one instance per model runner's load."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options = Options.from_config(load_config.model_loader_extra_config)

    def download_model(self, model_config: Any) -> None:
        """Nothing to download: the daemon holds the checkpoint, or loads it from the local folder."""

    def load_model(self, *, model_config: Any, device_config: Any) -> nn.Module:
        """Builds the model as DefaultModelLoader does, feeds this rank's tensors from weightd
        through model.load_weights, then SGLang's post-processing. The lease ends on return."""
        parallel = get_parallel()  # this process's place, as SGLang's ModelRunner reads it
        tp_rank, tp_size = int(parallel.tp_rank), int(parallel.tp_size)
        session = Session.create(self.options, model_config.model_path, logger)
        rank = session.rank_for(tp_rank, tp_size)
        start = time.perf_counter()
        target_device = torch.device(device_config.device)
        quant_config = _get_quantization_config(model_config, self.load_config)
        with set_default_torch_dtype(model_config.dtype):
            device_context: Any = target_device  # a context manager in torch 2.0+
            with device_context:
                model: nn.Module = _initialize_model(model_config, self.load_config, quant_config)
            try:
                weights = session.client.attach(session.name, rank)
            except WeightdError as e:
                raise LoadFormatError(f"attaching model {session.name!r} rank {rank} failed: {e}") from None
            with weights:
                tracked = TrackedNames(weights.weights_iterator())
                try:
                    DefaultModelLoader.load_weights_only(model, tracked, target_device)
                except Exception as e:  # the model's loader refused a name or a shape
                    raise mismatch_error(session.name, rank, type(model).__name__, refused=tracked.last or "?",
                                         cause=e) from e
            DefaultModelLoader.postprocess_weights(model, target_device)
        logger.info("weightd: fed %d tensors of model %r (generation %d, rank %d) through %s.load_weights; "
                    "loaded and post-processed in %.2f s", tracked.count, session.name, weights.generation, rank,
                    type(model).__name__, time.perf_counter() - start)
        return model.eval()
