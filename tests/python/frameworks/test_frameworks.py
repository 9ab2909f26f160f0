"""Real framework models through weightd (CTest python_frameworks).

A BERT and a GPT-2 are built here from small configurations with random
weights (transformers, seed 0), saved by save_pretrained as safetensors and
loaded by the test daemon. Each is then run in separate processes
(run_model.py): once from the files by from_pretrained, once through
weightd.transformers.load_model, and the outputs must be equal bit for bit,
with every parameter inside weightd's mappings and no private copy of the
weights. Set WEIGHTD_FRAMEWORKS_REPORT=FILE to keep the measured numbers.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

import weightd
from conftest import read_safetensors

RUNNER = Path(__file__).with_name("run_model.py")
MODELS = {
    "bert": ("BertModel", lambda: transformers.BertConfig(
        vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
        max_position_embeddings=512)),
    "gpt2": ("GPT2LMHeadModel", lambda: transformers.GPT2Config(
        vocab_size=50257, n_embd=256, n_layer=4, n_head=4, n_positions=512)),
}
# Bytes of the outputs run_model.py writes, float32: BERT's last_hidden_state
# (2 x 16 x 256) and pooler_output (2 x 256); GPT-2's logits (2 x 16 x 50257).
OUTPUT_BYTES = {"bert": (2 * 16 * 256 + 2 * 256) * 4, "gpt2": 2 * 16 * 50257 * 4}
_report = {}


@pytest.fixture(scope="module")
def saved(daemon):
    """{kind: folder}: each model built with seed 0, saved as safetensors, loaded as `kind`."""
    folders = {}
    for kind, (cls, config) in MODELS.items():
        torch.manual_seed(0)
        folder = daemon.models / kind
        getattr(transformers, cls)(config()).save_pretrained(folder, safe_serialization=True)
        daemon.client.load(kind, folder)
        folders[kind] = folder
    yield folders
    if os.environ.get("WEIGHTD_FRAMEWORKS_REPORT"):
        Path(os.environ["WEIGHTD_FRAMEWORKS_REPORT"]).write_text(json.dumps(_report, indent=2) + "\n")


def _start(mode, folder, kind, out, daemon=None, name=None):
    argv = [sys.executable, str(RUNNER), mode, str(folder), MODELS[kind][0], str(out)]
    if daemon is not None:
        argv += [daemon.socket, name or kind]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _report_of(child):
    """The child's JSON line (it then waits on stdin)."""
    line = child.stdout.readline()
    if not line:
        raise AssertionError(f"run_model.py failed: {child.wait(timeout=60)}: {child.stderr.read()}")
    return json.loads(line)


def _finish(child):
    _, err = child.communicate("\n", timeout=120)
    assert child.returncode == 0, err


def _run(*args, **kwargs):
    child = _start(*args, **kwargs)
    report = _report_of(child)
    _finish(child)
    return report


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_outputs_through_weightd_equal_from_pretrained_bit_for_bit(daemon, saved, tmp_path, kind):
    reference = _run("reference", saved[kind], kind, tmp_path / "reference.bin")
    through = _run("weightd", saved[kind], kind, tmp_path / "weightd.bin", daemon)
    expected = (tmp_path / "reference.bin").read_bytes()
    assert len(expected) == OUTPUT_BYTES[kind]
    assert (tmp_path / "weightd.bin").read_bytes() == expected
    assert through["outside"] == []  # every parameter lies in a weightd mapping
    assert through["tied"] is reference["tied"] is (None if kind == "bert" else True)
    size = through["param_bytes"]
    assert size == reference["param_bytes"] > 40 << 20
    # No copy: loading touches no weight page (the mappings are lazy), and
    # the forward pass reads the daemon's pages in place. Anonymous memory
    # (what a process holds a private copy of) grows by the weights with
    # from_pretrained and not with weightd; the rest of both is the
    # framework's own (buffers such as GPT-2's causal masks, activations).
    # No copy: loading touches no weight page (the mappings are lazy) and the
    # forward pass reads the daemon's pages in place. What Anonymous memory
    # (private copies) grows by is the framework's own: buffers such as
    # GPT-2's causal masks, activations, the 6.4 MB of GPT-2 logits.
    assert through["mapped_pss_load"] == 0
    assert through["pss_load"] < size // 10 and through["anon_load"] < size // 10
    assert through["anon_forward"] < size // 5
    _report[kind] = {"weightd": through, "from_pretrained": reference}


def test_two_clients_share_one_copy(daemon, saved, tmp_path):
    """PSS divides shared pages among their users: a second process running the
    same model pays about half of what it reads, and copies nothing."""
    first = _start("weightd", saved["gpt2"], "gpt2", tmp_path / "first.bin", daemon)
    try:
        _report_of(first)
        second = _run("weightd", saved["gpt2"], "gpt2", tmp_path / "second.bin", daemon)
    finally:
        _finish(first)
    assert second["mapped_pss_forward"] < second["param_bytes"] * 6 // 10
    assert second["anon_forward"] < second["param_bytes"] // 5
    _report["gpt2_second_client"] = second


def test_private_attach_post_processes_in_place_and_others_see_the_checkpoint(daemon, saved, tmp_path):
    files = read_safetensors(saved["gpt2"])
    child = _start("private", saved["gpt2"], "gpt2", tmp_path / "private.bin", daemon)
    try:
        report = _report_of(child)
        # While the private client holds its lease, with its pass done: the
        # daemon serves the checkpoint's bytes to everyone else.
        with daemon.client.attach("gpt2") as model:
            for name in ("transformer.h.0.ln_1.weight", "transformer.h.3.attn.c_proj.weight"):
                assert np.from_dlpack(model[name].raw()).tobytes() == files[name][2], name
    finally:
        _finish(child)
    # LayerNorm weights (2 x 4 layers and ln_f, 1 KiB each) and 4 square c_proj (256 KiB each).
    assert report["pass_bytes"] == 9 * 1024 + 4 * 256 * 1024
    assert report["outside"] == []
    # Copy-on-write copied exactly the pages the written tensors lie on.
    assert report["pass_copied"] == report["pass_pages_spanned"] >= report["pass_bytes"]
    reference = _run("reference", saved["gpt2"], "gpt2", tmp_path / "reference.bin")
    assert (tmp_path / "private.bin").read_bytes() != (tmp_path / "reference.bin").read_bytes()
    assert reference["param_bytes"] == report["param_bytes"]
    _report["gpt2_private_pass"] = report


def test_sentence_transformers_layout_loads_strictly(daemon, saved, tmp_path):
    """The issue's case: names under "0.auto_model." and the non-persistent
    embeddings.position_ids stored in the checkpoint, as older BERT checkpoints do."""
    torch.manual_seed(0)
    bert = transformers.BertModel(MODELS["bert"][1]())
    state = {"0.auto_model." + k: v.contiguous() for k, v in bert.state_dict().items()}
    state["0.auto_model.embeddings.position_ids"] = torch.arange(512).unsqueeze(0)
    folder = daemon.models / "sentence-bert"
    folder.mkdir()
    save_file(state, folder / "model.safetensors")
    bert.config.save_pretrained(folder)
    daemon.client.load("sentence-bert", folder)
    with daemon.client.attach("sentence-bert") as weights:
        with pytest.raises(RuntimeError, match='Unexpected key.*"0.auto_model.embeddings.word_embeddings.weight"'):
            weightd.transformers.load_model(weights, folder, model_class=transformers.BertModel, prefix="")
        model = weightd.transformers.load_model(weights, folder, model_class=transformers.BertModel,
                                                prefix="0.auto_model.")
        assert all(weights.owns(p.data_ptr()) for p in model.parameters())
        assert model.embeddings.position_ids.tolist() == [list(range(512))]  # the module's own buffer
    _run("reference", saved["bert"], "bert", tmp_path / "reference.bin")
    torch.set_num_threads(1)
    with torch.no_grad():
        ids = (torch.arange(32).reshape(2, 16) * 7919) % 30522
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    got = out.last_hidden_state.numpy().tobytes() + out.pooler_output.numpy().tobytes()
    assert got == (tmp_path / "reference.bin").read_bytes()


def test_hugging_face_helper_resolves_the_base_model_prefix(daemon, saved):
    """A GPT2Model from a GPT2LMHeadModel checkpoint ("transformer." stripped), without reading weight files."""
    with daemon.client.attach("gpt2") as weights:
        model, info = weightd.transformers.load_model(weights, saved["gpt2"] / "config.json",
                                                      model_class=transformers.GPT2Model, output_loading_info=True)
        assert info == {"missing_keys": [], "unexpected_keys": []}
        assert model.wte.weight.data_ptr() == weights["transformer.wte.weight"].data_ptr()
        assert not model.training
