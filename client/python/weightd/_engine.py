"""What the engine load formats (weightd.vllm, weightd.sglang) share: their
options, the daemon-side steps before an attach, and the one-line errors.

No engine and no torch is imported here. Every failure an operator can fix
is raised as LoadFormatError, whose message is one line starting with
"weightd:" that names what was wrong and what to do; the engines print it in
their log as the exception's text.
"""
from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import grpc

from ._client import Client, connect
from ._errors import WeightdError
from ._types import LoadProgress, ModelInfo, ModelState

# The keys of --model-loader-extra-config (vLLM) / model_loader_extra_config (SGLang).
OPTION_KEYS = ("socket", "model", "load", "host_resident", "tp_rules", "devices", "layouts")
LOAD_WAIT_SECONDS = 3600.0  # how long a rank waits for a load that another rank started


class LoadFormatError(RuntimeError):
    """A load through weightd that cannot go on; str() is one line starting "weightd:"."""

    def __init__(self, message: str) -> None:
        super().__init__("weightd: " + " ".join(message.split()))


@dataclass(frozen=True)
class Options:
    """The load format's options, checked (from_config)."""
    socket: Optional[str] = None  # None: $WEIGHTD_SOCKET, then weightd.DEFAULT_SOCKET
    model: Optional[str] = None  # None: derived from the engine's model path (model_name_for)
    load: bool = True  # ask the daemon to load the checkpoint when `model` is not loaded
    host_resident: Tuple[str, ...] = ()
    tp_rules: Tuple[Tuple[str, int], ...] = ()
    devices: Tuple[str, ...] = ()  # the daemon's GPUs for a split load, one per TP rank; (): local_gpus()
    layouts: bool = True

    @classmethod
    def from_config(cls, config: Optional[Mapping[str, Any]]) -> Options:
        """Options from the engine's extra-config dict; LoadFormatError naming an unknown or mistyped key."""
        config = dict(config or {})
        unknown = sorted(set(config) - set(OPTION_KEYS))
        if unknown:
            raise LoadFormatError(f"unknown option {unknown[0]!r} in the load format's extra config "
                                  f"(known: {', '.join(OPTION_KEYS)})")
        return cls(socket=_optional_str(config, "socket"), model=_optional_str(config, "model"),
                   load=_bool(config, "load", True), host_resident=_strings(config, "host_resident"),
                   tp_rules=tuple(_tp_rule(rule) for rule in _strings(config, "tp_rules")),
                   devices=_strings(config, "devices"), layouts=_bool(config, "layouts", True))


def _optional_str(config: Mapping[str, Any], key: str) -> Optional[str]:
    value = config.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise LoadFormatError(f"option {key!r} must be a non-empty string, got {value!r}")
    return value


def _bool(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise LoadFormatError(f"option {key!r} must be true or false, got {value!r}")
    return value


def _strings(config: Mapping[str, Any], key: str) -> Tuple[str, ...]:
    value = config.get(key, ())
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) and v for v in values):
        raise LoadFormatError(f"option {key!r} must be a string or a list of non-empty strings, got {value!r}")
    return tuple(values)


def _tp_rule(rule: str) -> Tuple[str, int]:
    """"PATTERN:DIM" as weightctl's --tp-rule spells it."""
    pattern, _, dim = rule.rpartition(":")
    if not pattern or not dim.isdigit():
        raise LoadFormatError(f"option 'tp_rules': {rule!r} is not PATTERN:DIM (e.g. \"proj.weight:0\")")
    return pattern, int(dim)


def model_name_for(model_path: str) -> str:
    """weightd's name for an engine's model path: its last folder name with every character
    that a weightd model name may not hold replaced by '-' (at most 128 characters)."""
    base = os.path.basename(os.path.normpath(model_path)) or "model"
    return re.sub(r"[^A-Za-z0-9._-]", "-", base)[:128]


def _one_line(error: WeightdError) -> str:
    return f"{error.code.name}: {' '.join(error.message.split())}"


@dataclass
class Session:
    """The daemon side of one engine process's load: which model, which rank.

    open() checks that the daemon answers and that the model is READY,
    loading it when allowed. Thread-safety: one loading thread.
    """
    options: Options
    model_path: str
    name: str
    client: Client
    logger: logging.Logger
    info: Optional[ModelInfo] = None
    _last_phase: Dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, options: Options, model_path: str, logger: logging.Logger) -> Session:
        name = options.model or model_name_for(model_path)
        return cls(options, model_path, name, connect(options.socket), logger)

    def open(self, tp_size: int) -> ModelInfo:
        """The READY ModelInfo of the model; loads it (tp_size, options' plan) when absent and allowed."""
        if self.info is None:
            self.info = self._ready() or self._load(tp_size)
        return self.info

    def rank_for(self, tp_rank: int, tp_size: int) -> int:
        """The weightd rank an engine TP rank attaches: its own for a model split into tp_size
        ranks, 0 for a model loaded whole (every engine rank shares the one host copy and the
        engine takes its slice, as from disk)."""
        info = self.open(tp_size)
        if info.tp_size == tp_size:
            return tp_rank
        if info.tp_size == 1:
            return 0
        raise LoadFormatError(f"model {self.name!r} is split into {info.tp_size} TP ranks in weightd but the engine "
                              f"runs {tp_size}: load it with tp_size 1 or {tp_size}")

    def _ready(self) -> Optional[ModelInfo]:
        try:
            models = self.client.list()
        except WeightdError as e:
            if e.code == grpc.StatusCode.UNAVAILABLE:
                raise LoadFormatError(f"daemon not reachable at {self.client.target} ({_one_line(e)}); start weightd "
                                      "or set the option 'socket' (default $WEIGHTD_SOCKET)") from None
            raise LoadFormatError(f"listing models at {self.client.target} failed: {_one_line(e)}") from None
        ready = [m for m in models if m.name == self.name and m.state == ModelState.READY]
        if not ready:
            return None
        info = max(ready, key=lambda m: m.generation)
        self.logger.info("weightd: model %r generation %d is READY in weightd at %s (%d tensors, from %s)",
                         self.name, info.generation, self.client.target, info.tensor_count, info.checkpoint_path)
        return info

    def _load(self, tp_size: int) -> ModelInfo:
        if not self.options.load:
            raise LoadFormatError(f"model {self.name!r} is not loaded in weightd at {self.client.target} and the "
                                  f"option 'load' is false: run `weightctl load {self.name} {self.model_path}` first")
        if not os.path.isdir(self.model_path):
            raise LoadFormatError(f"model {self.name!r} is not loaded in weightd and {self.model_path!r} is not a "
                                  "local checkpoint folder the daemon could load: load it with weightctl first")
        path = os.path.abspath(self.model_path)
        split = tp_size if self.options.tp_rules else 1
        devices = self.options.devices or (local_gpus(split) if self.options.tp_rules else ())
        self.logger.info("weightd: loading %s as model %r into weightd at %s%s", path, self.name, self.client.target,
                         f", split into {split} TP ranks on {', '.join(devices)}" if self.options.tp_rules else "")
        try:
            result = self.client.load(self.name, path, host_resident=self.options.host_resident, tp_size=split,
                                      tp_rules=self.options.tp_rules, devices=devices, progress=self._progress)
        except WeightdError as e:
            if e.code == grpc.StatusCode.ALREADY_EXISTS:  # another rank of this engine (or another engine) loads it
                return self._wait_loaded(path)
            raise LoadFormatError(f"weightd at {self.client.target} refused to load {path} as model "
                                  f"{self.name!r}: {_one_line(e)}") from None
        info = result.model
        self.logger.info("weightd: model %r generation %d loaded: %d tensors, %.2f s", self.name, info.generation,
                         info.tensor_count, info.load_seconds)
        return info

    def _wait_loaded(self, path: str, timeout: float = LOAD_WAIT_SECONDS) -> ModelInfo:
        """The READY ModelInfo once the load another process started ends; LoadFormatError when it fails."""
        self.logger.info("weightd: another process is loading model %r; waiting for it", self.name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = {m.state: m for m in self.client.list() if m.name == self.name}
            if ModelState.READY in states:
                return states[ModelState.READY]
            if ModelState.LOADING not in states:
                failed = states.get(ModelState.FAILED)
                raise LoadFormatError(f"the load of {path} as model {self.name!r} by another process failed: "
                                      f"{failed.error if failed else 'the model is gone'}")
            time.sleep(0.2)
        raise LoadFormatError(f"model {self.name!r} was still loading in weightd at {self.client.target} after "
                              f"{timeout:.0f} s")

    def _progress(self, progress: LoadProgress) -> None:
        if self._last_phase.get("phase") != progress.phase:
            self._last_phase["phase"] = progress.phase
            self.logger.info("weightd: loading %r: %s (%d of %d bytes)", self.name, progress.phase,
                             progress.bytes_done, progress.bytes_total)


def local_gpus(count: int) -> Tuple[str, ...]:
    """The UUIDs ("GPU-...", as the daemon names GPUs) of this process's CUDA devices 0..count-1: the GPUs
    of TP ranks 0..count-1 of an engine on one node (vLLM and SGLang run TP rank r on local device r).
    LoadFormatError when this process sees fewer (no CUDA, or a CPU engine)."""
    seen = 0
    try:
        import torch
        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        pass
    if seen < count:
        raise LoadFormatError(f"option 'tp_rules' splits the model into {count} TP ranks, one GPU each, but this "
                              f"process sees {seen} CUDA device(s): name the daemon's GPUs in the option 'devices' "
                              "(UUIDs or the daemon's ordinals, one per TP rank)")
    properties: List[Any] = [torch.cuda.get_device_properties(i) for i in range(count)]
    if not all(hasattr(p, "uuid") for p in properties):  # torch before 2.0 does not report it
        raise LoadFormatError(f"option 'tp_rules' splits the model into {count} TP ranks, one GPU each, but this "
                              f"torch {torch.__version__} does not report GPU UUIDs: name the daemon's GPUs in the "
                              "option 'devices' (UUIDs or the daemon's ordinals, one per TP rank)")
    return tuple(f"GPU-{p.uuid}" for p in properties)


class TrackedNames:
    """Wraps (name, tensor) pairs on their way into an engine's load_weights and remembers
    the last name handed over, so an exception raised inside can name the tensor."""

    def __init__(self, pairs: Iterable[Tuple[str, Any]]) -> None:
        self._pairs = iter(pairs)
        self.last: Optional[str] = None
        self.count = 0

    def __iter__(self) -> Iterator[Tuple[str, Any]]:
        for name, tensor in self._pairs:
            self.last = name
            self.count += 1
            yield name, tensor


def mismatch_error(name: str, rank: int, model_class: str, *, refused: Optional[str] = None,
                   cause: Optional[BaseException] = None, missing: Iterable[str] = ()) -> LoadFormatError:
    """The one line for a checkpoint that does not match the engine's model."""
    if refused is not None:
        text = " ".join(str(cause).split())[:300] if cause is not None else ""
        return LoadFormatError(f"model {name!r} (weightd rank {rank}) does not match {model_class}: unexpected "
                               f"tensor {refused!r} ({type(cause).__name__}: {text})")
    names: List[str] = sorted(missing)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return LoadFormatError(f"model {name!r} (weightd rank {rank}) does not match {model_class}: missing tensor(s) "
                           f"for parameter(s) {shown}")
