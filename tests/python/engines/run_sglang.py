"""SGLang's real LlamaForCausalLM built and loaded on the CPU in this process, for test_sglang.py.

    python run_sglang.py load MODEL_DIR EXTRA_CONFIG_JSON
        loads the model twice, with SGLang's DefaultModelLoader from the files and with
        `load_format="weightd"` (the plugin, loaded as SGLang's launchers load it), and
        prints "RESULT {json}": the loader classes and the parameters that differ
    python run_sglang.py args MODEL_DIR
        parses `--load-format weightd` with SGLang's server argument parser and prints
        "RESULT {json}": the parsed load_format and the loader class LoadConfig resolves it to

No forward pass (SGLang's needs a ForwardBatch from its scheduler): SGLang
0.5.23's RotaryEmbedding imports vllm._custom_ops on a CPU without sgl-kernel's
CPU ops, so a stub that fails if called stands in for it.
"""
import json
import socket
import sys
import types


def _stub_vllm_custom_ops():
    def rotary_embedding(*args, **kwargs):
        raise RuntimeError("stub: vllm._custom_ops.rotary_embedding is not available in this test")

    vllm, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = rotary_embedding
    vllm._custom_ops = ops
    sys.modules.setdefault("vllm", vllm)
    sys.modules.setdefault("vllm._custom_ops", ops)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load(folder, extra):
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
        models, classes = {}, {}
        for fmt, config in (("auto", {}), ("weightd", extra)):
            model_config = ModelConfig(model_path=folder, dtype="float32")
            loader = get_model_loader(LoadConfig(load_format=fmt, model_loader_extra_config=config), model_config)
            classes[fmt] = f"{type(loader).__module__}.{type(loader).__name__}"
            models[fmt] = loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
    state = {fmt: dict(list(m.named_parameters()) + list(m.named_buffers())) for fmt, m in models.items()}
    differ = sorted(n for n in state["auto"] if n not in state["weightd"] or
                    not torch.equal(state["auto"][n], state["weightd"][n]))
    return {"classes": classes, "model": type(models["weightd"]).__name__, "tensors": len(state["auto"]),
            "names_equal": sorted(state["auto"]) == sorted(state["weightd"]), "differ": differ}


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
    if sys.argv[1] == "load":
        result = load(sys.argv[2], json.loads(sys.argv[3]))
    else:
        result = parse_args(sys.argv[2])
    print("RESULT " + json.dumps(result), flush=True)
