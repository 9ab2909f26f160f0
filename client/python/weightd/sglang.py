"""weightd as an SGLang load format.

    sglang.Engine(model_path="/models/llama", load_format=weightd.sglang.WeightdModelLoader,
                  model_loader_extra_config={"socket": ...})
    python -m sglang.launch_server --model-path /models/llama --load-format weightd

The `sglang.srt.plugins` entry point `weightd` (client/python/pyproject.toml)
calls register() in SGLang's processes: it adds `weightd` to the
--load-format choices and maps that string to WeightdModelLoader when
SGLang's LoadConfig checks it (SGLang's get_model_loader instantiates a
load_format that is a class). Options and errors are those of weightd.vllm
(weightd._engine.Options, LoadFormatError).

The model is built as SGLang's DefaultModelLoader builds it; the tensors of
this TP rank come from weightd through the model's own load_weights, checked
for missing and unexpected tensors as vLLM checks them
(weightd._sglang_check), then SGLang post-processes as usual. With runtime
layouts (weightd._sglang_layouts) the post-processed tensors are published
once and attached by later starts. `import weightd.sglang` imports neither
SGLang nor torch until WeightdModelLoader is used.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable

__all__ = ["LOAD_FORMAT", "WeightdModelLoader", "register"]

LOAD_FORMAT = "weightd"

if TYPE_CHECKING:
    from ._sglang_loader import WeightdModelLoader as WeightdModelLoader
else:
    def __getattr__(name: str) -> Any:
        if name == "WeightdModelLoader":  # imports SGLang: only when used, not at plugin load
            return importlib.import_module("._sglang_loader", __package__).WeightdModelLoader
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _verify_load_format(original: Callable[..., Any], config: Any, *args: Any, **kwargs: Any) -> Any:
    """LoadConfig._verify_load_format, with the string "weightd" turned into the loader class
    (SGLang's LoadFormat enum has no member for it; a class is used as the loader)."""
    if isinstance(config.load_format, str) and config.load_format.lower() == LOAD_FORMAT:
        from ._sglang_loader import WeightdModelLoader
        config.load_format = WeightdModelLoader
    return original(config, *args, **kwargs)


_registered = False


def register() -> None:
    """The `sglang.srt.plugins` entry point: `--load-format weightd` on SGLang's command line.
    Idempotent."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES, add_load_format_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if LOAD_FORMAT not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([LOAD_FORMAT])
    HookRegistry.register("sglang.srt.configs.load_config.LoadConfig._verify_load_format", _verify_load_format,
                          HookType.AROUND)
    _registered = True
