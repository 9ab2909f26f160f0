"""A tiny Llama checkpoint made here with transformers, for the engine tests.

    python tiny_llama.py DIR      writes config.json, model.safetensors and a tokenizer into DIR

2 layers, hidden 128, 2 heads of head_dim 64 (vLLM's CPU attention refuses
head_dim 16), float32, seeded weights drawn wider than transformers' default
so that greedy decoding has clear margins; the tokenizer is byte-level BPE
without merges (256 byte tokens plus <s> and </s>), built offline.
"""
import json
import sys
from pathlib import Path

PROMPTS = ["The capital of France is", "weightd maps weights", "1 2 3 4 5"]
MAX_TOKENS = 8


def make_tokenizer(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(sorted(alphabet))}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return len(vocab)


def make(folder):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(folder)
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, torch_dtype="float32",
                         initializer_range=0.2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def transformers_tokens(folder, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    """Greedy continuation token ids from Hugging Face transformers, one list per prompt."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        out.append(generated[0, ids.shape[1]:].tolist())
    return out


if __name__ == "__main__":
    make(sys.argv[1])
    print(json.dumps(transformers_tokens(sys.argv[1])))
