"""Runtime layouts with real transformers models (issue 25's done-when test).

Process A attaches a BERT or GPT-2 checkpoint through weightd, post-processes
it (post_process.py: q/k/v fused, every linear weight int8 with fp32
per-output-channel scales, the position embedding transposed and made
contiguous) and publishes the result with weightd.torch.publish_module. A
fresh process B attaches the layout, builds the post-processed structure on
the meta device, binds it with weightd.torch.load_into and runs the forward
pass: its output must equal A's bit for bit, every parameter must lie in a
weightd mapping, and B's PSS must grow by less than 5% of the layout's bytes.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

RUNNER = Path(__file__).with_name("run_layout.py")
MODELS = {
    "bert": ("BertModel", lambda: transformers.BertConfig(
        vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
        max_position_embeddings=512)),
    "gpt2": ("GPT2LMHeadModel", lambda: transformers.GPT2Config(
        vocab_size=50257, n_embd=256, n_layer=4, n_head=4, n_positions=512)),
}
KEY = "frameworks-test/int8-qkv-fused/tp1"


@pytest.fixture(scope="module")
def saved(daemon):
    """{kind: folder}: each model built with seed 0, saved as safetensors, loaded as `layout-<kind>`."""
    folders = {}
    for kind, (cls, config) in MODELS.items():
        torch.manual_seed(0)
        folder = daemon.models / f"layout-{kind}"
        getattr(transformers, cls)(config()).save_pretrained(folder, safe_serialization=True)
        daemon.client.load(f"layout-{kind}", folder)
        folders[kind] = folder
    return folders


def _start(mode, folder, kind, out, daemon):
    argv = [sys.executable, str(RUNNER), mode, str(folder), MODELS[kind][0], str(out), daemon.socket,
            f"layout-{kind}", KEY]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(*args):
    child = _start(*args)
    line = child.stdout.readline()
    if not line:
        raise AssertionError(f"run_layout.py failed: {child.wait(timeout=60)}: {child.stderr.read()}")
    _, err = child.communicate("\n", timeout=120)
    assert child.returncode == 0, err
    return json.loads(line)


# Names the pass creates and removes, per model (layer 0; every layer alike).
RENAMED = {
    "bert": (["encoder.layer.0.attention.self.qkv.qweight", "encoder.layer.0.attention.self.qkv.scale",
              "embeddings.position_embeddings.weight_t", "pooler.dense.qweight"],
             ["encoder.layer.0.attention.self.query.weight", "embeddings.position_embeddings.weight"]),
    "gpt2": (["transformer.h.0.attn.c_attn.qweight", "transformer.h.0.mlp.c_fc.scale", "transformer.wpe.weight_t"],
             ["transformer.h.0.attn.c_attn.weight", "transformer.wpe.weight"]),
}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_second_process_runs_the_published_layout_bit_for_bit(daemon, saved, tmp_path, kind):
    a = _run("publish", saved[kind], kind, tmp_path / "a.bin", daemon)
    b = _run("attach", saved[kind], kind, tmp_path / "b.bin", daemon)
    expected = (tmp_path / "a.bin").read_bytes()
    assert len(expected) > 0
    assert (tmp_path / "b.bin").read_bytes() == expected  # torch.equal of the outputs, as bytes
    # The same post-processed parameters, with their dtypes, shapes and strides.
    assert b["params"] == a["params"]
    created, removed = RENAMED[kind]
    assert set(created) <= set(a["params"]) and not set(removed) & set(a["params"])
    quantized = [n for n, (dtype, _, _) in a["params"].items() if n.endswith(".qweight")]
    assert quantized and all(a["params"][n][0] == "torch.int8" for n in quantized)
    assert all(a["params"][n.replace(".qweight", ".scale")][0] == "torch.float32" for n in quantized)
    table = [n for n in a["params"] if n.endswith("weight_t")][0]
    assert a["params"][table][1:] == [[256, 512], [512, 1]]  # [hidden, positions], contiguous
    if kind == "gpt2":  # Conv1D storage kept: a transposed int8 view
        assert a["params"]["transformer.h.0.attn.c_attn.qweight"][1:] == [[768, 256], [1, 768]]
    assert b["outside"] == [] and b["on_meta"] == []
    assert b["pss_load"] < a["layout_bytes"] * 5 // 100, (b["pss_load"], a["layout_bytes"])
