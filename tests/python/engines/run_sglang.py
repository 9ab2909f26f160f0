"""SGLang's real LlamaForCausalLM built and loaded on the CPU in this process, for test_sglang.py.

    python run_sglang.py load MODEL_DIR EXTRA_CONFIG_JSON
        loads the model twice, with SGLang's DefaultModelLoader from the files and with
        `load_format="weightd"` (the plugin, loaded as SGLang's launchers load it), and
        prints "RESULT {json}": the loader classes, the parameters and buffers that differ,
        a digest of each of the weightd model's, and each load_model's seconds
    python run_sglang.py weightd MODEL_DIR EXTRA_CONFIG_JSON
        the same with `load_format="weightd"` only
    python run_sglang.py engine MODEL_DIR EXTRA_CONFIG_JSON
        starts sglang.Engine(load_format="weightd", device="cpu") with its scheduler process,
        generates greedily for tiny_llama.PROMPTS and prints "RESULT {json}": the tokens and
        the seconds from Engine() to ready
    python run_sglang.py args MODEL_DIR
        parses `--load-format weightd` with SGLang's server argument parser and prints
        "RESULT {json}": the parsed load_format and the loader class LoadConfig resolves it to

WEIGHTD_TEST_FAKE_AMX=1 marks every linear module as SGLang's CPU AMX
backend marks the modules whose weights it packed (use_intel_amx_backend),
after post-processing: the state of a CPU with AMX, on one without.

SGLang 0.5.23's RotaryEmbedding imports vllm._custom_ops on a device that is
neither CUDA nor SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1, which needs
sgl-kernel's CPU ops: PyPI's sglang-kernel has CUDA builds only), and then
computes rotary embeddings natively on the CPU; a stub package that fails if
called stands in for vLLM, on PYTHONPATH so that the Engine's scheduler
process finds it too.
"""
import hashlib
import json
import os
import socket
import sys
import tempfile
import time


def _stub_vllm_custom_ops():
    folder = os.path.join(tempfile.mkdtemp(prefix="weightd-vllm-stub-"), "vllm")
    os.mkdir(folder)
    open(os.path.join(folder, "__init__.py"), "w").close()
    with open(os.path.join(folder, "_custom_ops.py"), "w") as f:
        f.write("def rotary_embedding(*args, **kwargs):\n"
                "    raise RuntimeError('stub: vllm._custom_ops.rotary_embedding is not available in this test')\n")
    sys.path.insert(0, os.path.dirname(folder))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(folder), os.environ.get("PYTHONPATH")]))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_amx():
    from sglang.srt.model_loader.loader import DefaultModelLoader

    postprocess = DefaultModelLoader.postprocess_weights

    def marked(model, target_device):
        postprocess(model, target_device)
        for module in model.modules():
            if hasattr(module, "quant_method") and type(module).__name__.endswith("Linear"):
                module.use_intel_amx_backend = True
    DefaultModelLoader.postprocess_weights = staticmethod(marked)


def _digest(tensor):
    import torch
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def load(folder, extra, formats=("auto", "weightd")):
    import torch
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_context, get_parallel

    load_plugins()  # as sglang.launch_server and Engine do: weightd.sglang.register()
    ranks = dict(tp_rank=0, pp_rank=0, attn_tp_rank=0, attn_dp_rank=0, attn_cp_rank=0, moe_ep_rank=0)
    with get_context().override_server_args(model_path=folder, device="cpu", dtype="float32"), \
            get_parallel().override(**ranks):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        initialize_model_parallel()
        models, classes, seconds = {}, {}, {}
        for fmt in formats:
            config = extra if fmt == "weightd" else {}
            model_config = ModelConfig(model_path=folder, dtype="float32")
            loader = get_model_loader(LoadConfig(load_format=fmt, model_loader_extra_config=config), model_config)
            classes[fmt] = f"{type(loader).__module__}.{type(loader).__name__}"
            start = time.perf_counter()
            models[fmt] = loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
            seconds[fmt] = round(time.perf_counter() - start, 3)
    state = {fmt: dict(list(m.named_parameters()) + list(m.named_buffers())) for fmt, m in models.items()}
    result = {"classes": classes, "model": type(models["weightd"]).__name__, "seconds": seconds,
              "digests": {n: _digest(t) for n, t in sorted(state["weightd"].items())}}
    if "auto" in state:
        result.update(tensors=len(state["auto"]), names_equal=sorted(state["auto"]) == sorted(state["weightd"]),
                      differ=sorted(n for n in state["auto"] if n not in state["weightd"] or
                                    not torch.equal(state["auto"][n], state["weightd"][n])))
    return result


def engine(folder, extra):
    import sglang
    import tiny_llama

    start = time.perf_counter()
    llm = sglang.Engine(model_path=folder, load_format="weightd", model_loader_extra_config=json.dumps(extra),
                        device="cpu", dtype="float32", max_total_tokens=1024, disable_cuda_graph=True,
                        attention_backend="torch_native", random_seed=0, log_level="info")
    ready = time.perf_counter() - start
    try:
        outputs = llm.generate(tiny_llama.PROMPTS, {"max_new_tokens": tiny_llama.MAX_TOKENS,
                                                    "min_new_tokens": tiny_llama.MAX_TOKENS, "temperature": 0})
    finally:
        llm.shutdown()
    return {"tokens": [o["output_ids"] for o in outputs], "ready_seconds": round(ready, 3)}


def parse_args(folder):
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    args = prepare_server_args(["--model-path", folder, "--load-format", "weightd", "--device", "cpu"])
    resolved = LoadConfig(load_format=args.load_format).load_format
    return {"load_format": str(args.load_format), "loader": f"{resolved.__module__}.{resolved.__name__}"}


if __name__ == "__main__":
    import logging
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # as SGLang's servers log
    _stub_vllm_custom_ops()
    if os.environ.get("WEIGHTD_TEST_FAKE_AMX") == "1":
        _fake_amx()
    if sys.argv[1] == "engine":
        result = engine(sys.argv[2], json.loads(sys.argv[3]))
    elif sys.argv[1] in ("load", "weightd"):
        result = load(sys.argv[2], json.loads(sys.argv[3]), ("auto", "weightd") if sys.argv[1] == "load" else
                      ("weightd",))
    else:
        result = parse_args(sys.argv[2])
    print("RESULT " + json.dumps(result), flush=True)
