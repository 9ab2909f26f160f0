"""weightd as a vLLM load format: `vllm serve /models/llama --load-format weightd`.

Installing the package registers it: the `vllm.general_plugins` entry point
`weightd` (client/python/pyproject.toml) calls register() in every vLLM
process (API server, engine core, workers). Options arrive as
`--model-loader-extra-config '{"socket": ..., "model": ..., "load": ...,
"host_resident": [...], "tp_rules": ["PATTERN:DIM"], "devices": [...], "layouts": ...}'`
(weightd._engine.Options; an unknown key is an error naming it).

Each worker attaches its rank of the model in weightd (loading the checkpoint
into the daemon first when it is not there and `load` allows) and feeds the
tensors through the model's own load_weights, so vLLM's stacking, sharding
and quantization loaders see exactly what they would read from disk; then
vLLM post-processes as usual. With runtime layouts (weightd._vllm_layouts)
the post-processed tensors are published once and attached by later starts.

Importing this module imports vLLM and torch; `import weightd` does neither.
Failures an operator can fix raise weightd._engine.LoadFormatError, one line
in vLLM's log (docs/integration.md, "vLLM").
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Optional, Set, cast

import grpc
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from . import _vllm_layouts, _vllm_tp
from ._engine import LoadFormatError, Options, Session, TrackedNames, mismatch_error
from ._errors import WeightdError

__all__ = ["LOAD_FORMAT", "WeightdModelLoader", "register"]

LOAD_FORMAT = "weightd"
logger = init_logger("vllm.weightd")


class WeightdModelLoader(BaseModelLoader):  # type: ignore[misc]
    """vLLM's BaseModelLoader over weightd: one instance per worker process's load."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options = Options.from_config(load_config.model_loader_extra_config)
        self._session: Optional[Session] = None

    def _open(self, model_config: ModelConfig) -> Session:
        if self._session is None:
            self._session = Session.create(self.options, model_config.model, logger)
        self._session.open(_tp_size())
        return self._session

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: the daemon holds the checkpoint, or loads it from the local folder."""

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """Bytes weightd holds on this rank's device for the model (its device-placed tensors):
        GPU memory vLLM's budget must leave to the daemon. Loads the model first when allowed,
        since the daemon would otherwise allocate it after vLLM measured the GPU."""
        session = self._open(vllm_config.model_config)
        rank = session.rank_for(_tp_rank(), _tp_size())
        try:
            manifest = session.client.manifest(session.name, rank)
        except WeightdError as e:
            raise LoadFormatError(f"manifest of model {session.name!r} rank {rank}: {e}") from None
        return sum(t.nbytes for t in manifest.tensors if t.placement == "device")

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Attaches this rank in weightd and feeds every tensor through model.load_weights
        (vLLM copies each into its own parameter); LoadFormatError when the checkpoint does
        not match the model. The lease ends when this returns."""
        session = self._open(model_config)
        rank = session.rank_for(_tp_rank(), _tp_size())
        start = time.perf_counter()
        with _attach(session, rank) as weights:
            split = {t.name for t in weights.manifest.tensors if t.split_dim >= 0}
            tracked = TrackedNames(_vllm_tp.mark_split(weights.weights_iterator(), split))
            load: Any = getattr(model, "load_weights")
            try:
                with _vllm_tp.shard_aware(model) if split else contextlib.nullcontext():
                    loaded = load(tracked)
            except LoadFormatError:
                raise
            except Exception as e:  # the model's loader refused a name or a shape
                raise mismatch_error(session.name, rank, type(model).__name__, refused=tracked.last or "?",
                                     cause=e) from e
        _check_complete(session.name, rank, model, model_config, loaded)
        logger.info("weightd: fed %d tensors of model %r (generation %d, rank %d) through %s.load_weights for TP rank "
                    "%d of %d in %.2f s", tracked.count, session.name, weights.generation, rank, type(model).__name__,
                    _tp_rank(), _tp_size(), time.perf_counter() - start)

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        """A runtime layout of this configuration when weightd has one (no load, no
        post-processing); else vLLM's create/load_weights/post-process, then the layout published."""
        session = self._open(model_config)
        rank = session.rank_for(_tp_rank(), _tp_size())
        start = time.perf_counter()
        layouts = _vllm_layouts.Layouts.for_start(self.options, session, rank, vllm_config, logger)
        model = layouts.attach(vllm_config, model_config, prefix) if layouts is not None else None
        if layouts is not None and model is not None:
            logger.info("weightd: start of model %r rank %d: attached runtime layout %r in %.2f s "
                        "(no load, no post-processing)", session.name, rank, layouts.key, time.perf_counter() - start)
            return model
        model = cast(nn.Module, super().load_model(vllm_config, model_config, prefix))
        logger.info("weightd: start of model %r rank %d: loaded and post-processed in %.2f s", session.name, rank,
                    time.perf_counter() - start)
        if layouts:
            layouts.publish(model, model_config)
        return model


def _attach(session: Session, rank: int) -> Any:
    try:
        return session.client.attach(session.name, rank)
    except WeightdError as e:
        if e.code == grpc.StatusCode.UNAVAILABLE:
            raise LoadFormatError(f"daemon not reachable at {session.client.target} while attaching model "
                                  f"{session.name!r}: {e}") from None
        raise LoadFormatError(f"attaching model {session.name!r} rank {rank} failed: {e}") from None


def _check_complete(name: str, rank: int, model: nn.Module, model_config: ModelConfig,
                    loaded: Optional[Set[str]]) -> None:
    """Every parameter got a tensor (vLLM's own check for unquantized models, as one line)."""
    if loaded is None or model_config.quantization is not None:
        return
    missing = {n for n, _ in model.named_parameters()} - set(loaded)
    if missing:
        raise mismatch_error(name, rank, type(model).__name__, missing=missing)


def _tp_rank() -> int:
    return int(get_tensor_model_parallel_rank())


def _tp_size() -> int:
    return int(get_tensor_model_parallel_world_size())


_registered = False


def register() -> None:
    """Registers the load format `weightd` with vLLM; the entry point vLLM calls in each of
    its processes. Idempotent: a second call (or a second plugin load) does nothing."""
    global _registered
    if not _registered:
        register_model_loader(LOAD_FORMAT)(WeightdModelLoader)
        _registered = True

