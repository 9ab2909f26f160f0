"""One vLLM start in a process of its own (vLLM keeps per-process state), for test_vllm.py.

    python run_vllm.py MODEL_DIR LOAD_FORMAT EXTRA_CONFIG_JSON [TP_SIZE]

Builds LLM(model=MODEL_DIR, load_format=LOAD_FORMAT, model_loader_extra_config=...)
on the CPU, generates greedily from tiny_llama.PROMPTS and prints one line
"RESULT {json}" with the tokens and the seconds LLM() took to start.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_llama import MAX_TOKENS, PROMPTS  # noqa: E402


def main():
    model_dir, load_format, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    tp_size = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=model_dir, load_format=load_format, model_loader_extra_config=extra, dtype="float32",
              enforce_eager=True, max_model_len=128, max_num_seqs=4, seed=0, tensor_parallel_size=tp_size)
    start_seconds = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    print("RESULT " + json.dumps({"tokens": tokens, "start_seconds": start_seconds}), flush=True)


if __name__ == "__main__":
    main()
