"""Missing and unexpected tensors for the SGLang load format, as vLLM's one-line errors.

vLLM's load_weights raises on a checkpoint name it has no parameter for and
returns the names it loaded; SGLang's (LlamaForCausalLM, 0.5.23) only logs
"Parameter ... not found in params_dict", or skips silently, and returns
nothing. So every parameter's weight_loader is wrapped while load_weights
runs (set also where a parameter has none: models call
getattr(param, "weight_loader", default_weight_loader)), recording which
parameters were written and which checkpoint name was being fed at each
write. Afterwards a name that led to no write is unexpected, unless the
model skips it by design (SKIPPED, tied lm_head), and a parameter never
written is missing. A loader that buffers a tensor and writes it while a
later name is fed would be reported; SGLang's dense loaders write at once.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, List, Set, Tuple

from torch import nn

from ._engine import mismatch_error

# Checkpoint names SGLang's models skip on purpose (llama.py's load_weights:
# rotary caches some trainers save, a vision projector of multimodal exports).
SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached", "projector")
_ABSENT = object()


class WriteTracker:
    """The writes of one model.load_weights call. Thread-safety: the loading thread only."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.current = ""
        self.fed: List[str] = []
        self.writers: Set[str] = set()  # checkpoint names that led to a write
        self.written: Set[int] = set()  # id() of the parameters written

    def feed(self, pairs: Iterable[Tuple[str, Any]]) -> Iterator[Tuple[str, Any]]:
        """`pairs`, remembering each name while the model loads it."""
        for name, tensor in pairs:
            self.current = name
            self.fed.append(name)
            yield name, tensor

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Every parameter's weight_loader records its writes within the block; restored after."""
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        restore: List[Tuple[Any, str, Any]] = []  # (parameter, attribute, its own value or _ABSENT)
        for _, param in self.model.named_parameters():
            # SGLang's BasevLLMParameter subclasses read weight_loader through a property of _weight_loader.
            attr = "_weight_loader" if isinstance(getattr(type(param), "weight_loader", None), property) \
                else "weight_loader"
            restore.append((param, attr, param.__dict__.get(attr, _ABSENT)))
            setattr(param, attr, self._recording(param, getattr(param, attr, None) or default_weight_loader))
        try:
            yield
        finally:
            for param, attr, saved in restore:
                if saved is _ABSENT:
                    delattr(param, attr)
                else:
                    setattr(param, attr, saved)

    def _recording(self, param: nn.Parameter, loader: Callable[..., Any]) -> Callable[..., Any]:
        def weight_loader(*args: Any, **kwargs: Any) -> Any:
            result = loader(*args, **kwargs)
            self.written.add(id(param))
            self.writers.add(self.current)
            return result
        return weight_loader

    def check(self, name: str, rank: int, tied_lm_head: bool, in_this_stage: Callable[[str], bool]) -> None:
        """LoadFormatError (weightd._engine.mismatch_error) for the first unexpected checkpoint name,
        else for every parameter never written. in_this_stage: whether a name's layer is this PP stage's."""
        model_class = type(self.model).__name__
        unexpected = [fed for fed in self.fed if fed not in self.writers and in_this_stage(fed)
                      and not any(s in fed for s in SKIPPED) and not (tied_lm_head and "lm_head.weight" in fed)]
        if unexpected:
            more = f" ({len(unexpected) - 1} more checkpoint tensor(s) likewise)" if len(unexpected) > 1 else ""
            raise mismatch_error(name, rank, model_class, refused=unexpected[0],
                                 cause=LookupError(f"{model_class}.load_weights wrote it into no parameter{more}"))
        missing = [n for n, p in self.model.named_parameters() if id(p) not in self.written]
        if missing:
            raise mismatch_error(name, rank, model_class, missing=missing)

