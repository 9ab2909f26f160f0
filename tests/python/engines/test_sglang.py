"""weightd.sglang in the real SGLang 0.5.23, on the CPU (scripts/test-sglang.sh).

SGLang's own LlamaForCausalLM is built and loaded in a process of its own
per start (run_sglang.py): by SGLang's DefaultModelLoader from the files, and
through `load_format="weightd"` resolved by the plugin from a test daemon;
every parameter and buffer must be equal. The first start publishes its
runtime layout, the second attaches it. A full sglang.Engine on the CPU
generates transformers' tokens both ways. Each bad case gives its one line.
`--load-format weightd` must parse with SGLang's server argument parser when
the plugin is installed, and be refused by it when the plugin is not loaded.
Set WEIGHTD_ENGINES_REPORT=FILE to keep the measured start times.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

if os.environ.get("WEIGHTD_REQUIRE_ENGINES") != "1":  # scripts/test-sglang.sh sets it: there, a missing SGLang fails
    pytest.importorskip("sglang", reason="SGLang is not installed here (scripts/test-sglang.sh makes its venv)")

import tiny_llama  # noqa: E402
from conftest import Daemon, DaemonStartError, read_safetensors, write_safetensors  # noqa: E402

RUNNER = Path(__file__).with_name("run_sglang.py")
KEY = "sglang/LlamaForCausalLM/float32/tp1-pp1"
HIT = 'weightd_layout_attaches_total{result="hit"}'
NOT_FOUND = 'weightd_layout_attaches_total{result="not_found"}'
_report = {}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A daemon with a metrics listener and the tiny Llama in its model root (folder tiny-sglang)."""
    root = tmp_path_factory.mktemp("weightd-sglang")
    (root / "models").mkdir()
    try:
        daemon = Daemon(root, root / "models", "--metrics-address", "127.0.0.1:0")
    except DaemonStartError as e:
        pytest.fail(str(e))
    daemon.folder = tiny_llama.make(root / "models" / "tiny-sglang")
    yield daemon
    assert daemon.stop() == 0, daemon.log.read_text()
    if os.environ.get("WEIGHTD_ENGINES_REPORT"):
        Path(os.environ["WEIGHTD_ENGINES_REPORT"]).write_text(json.dumps(_report, indent=2) + "\n")


def growth(before, after, name):
    return after.get(name, 0) - before.get(name, 0)


def run(*args, env=None):
    done = subprocess.run([sys.executable, str(RUNNER), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600, env={**os.environ, **(env or {})})
    results = [line[len("RESULT "):] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return (json.loads(results[0]) if results else None), done.stdout


def weightd_lines(output):
    """The distinct `weightd: ...` lines of a start's output (log lines and the error's text)."""
    return sorted(set(re.findall(r"(?<![.\w])(weightd: [^\n]*)", output)))


def identity(**changes):
    """The layout identity of the tiny Llama's rank 0 started by run_sglang.py on this machine."""
    import torch
    return {"engine": f"sglang {version('sglang')}", "layout_abi": "weightd-sglang-layout-1",
            "architecture": "LlamaForCausalLM", "dtype": "float32", "quantization": "none", "parallel": "tp1 pp1",
            "rank": "0", "device": f"cpu {torch.backends.cpu.get_cpu_capability()}", **changes}


@pytest.fixture(scope="module")
def first_start(served):
    """The run's first start of tiny-sglang: loaded into the daemon, post-processed, layout published."""
    before = served.metrics()
    result, output = run("load", str(served.folder), json.dumps({"socket": served.socket}))
    return result, output, before, served.metrics()


def test_first_start_equals_sglangs_default_loader_and_publishes_its_layout(served, first_start):
    result, output, before, after = first_start
    assert result is not None, output
    assert result["classes"] == {"auto": "sglang.srt.model_loader.loader.DefaultModelLoader",
                                 "weightd": "weightd._sglang_loader.WeightdModelLoader"}
    assert (result["model"], result["tensors"], result["names_equal"], result["differ"]) == \
        ("LlamaForCausalLM", 16, True, []), output
    assert "weightd: fed 21 tensors of model 'tiny-sglang' (generation 1, rank 0) through " \
           "LlamaForCausalLM.load_weights in " in output
    assert f"weightd: no runtime layout '{KEY}' of model 'tiny-sglang' yet: loading and post-processing" in output
    assert re.search(r"weightd: start of model 'tiny-sglang' rank 0: loaded and post-processed in \d+\.\d\d s",
                     output), output
    (model,) = [m for m in served.client.list() if m.name == "tiny-sglang"]
    (layout,) = model.layouts
    assert (layout.key, layout.rank, layout.identity, layout.tensor_count) == (KEY, 0, identity(), 16)
    assert (f"weightd: published runtime layout '{KEY}' of model 'tiny-sglang' rank 0 (16 tensors, "
            f"{layout.host_bytes} bytes on the host)") in output
    assert (growth(before, after, NOT_FOUND), growth(before, after, HIT)) == (1, 0)
    assert served.wait_leases("tiny-sglang", 0) == 0
    _report["first_start_seconds"] = result["seconds"]["weightd"]
    _report["files_seconds"] = result["seconds"]["auto"]


def test_second_start_attaches_the_layout(served, first_start):
    """A restart: the layout is attached and bound into a meta-built model, no tensor is fed and
    nothing post-processed; every parameter and buffer equals the first start's and the files'."""
    first = first_start[0]
    before = served.metrics()
    result, output = run("load", str(served.folder), json.dumps({"socket": served.socket}))
    after = served.metrics()
    assert result is not None, output
    assert (result["tensors"], result["names_equal"], result["differ"]) == (16, True, []), output
    assert result["digests"] == first["digests"]
    assert re.search(rf"weightd: start of model 'tiny-sglang' rank 0: attached runtime layout '{KEY}' in \d+\.\d\d s "
                     r"\(no load, no post-processing\)", output), output
    assert "weightd: fed " not in output and "weightd: published" not in output
    assert (growth(before, after, HIT), growth(before, after, NOT_FOUND)) == (1, 0)
    assert served.wait_leases("tiny-sglang", 0) == 0
    _report["second_start_seconds"] = result["seconds"]["weightd"]


def test_layouts_false_loads_and_post_processes(served, first_start):
    before = served.metrics()
    result, output = run("weightd", str(served.folder), json.dumps({"socket": served.socket, "layouts": False}))
    after = served.metrics()
    assert result is not None, output
    assert result["digests"] == first_start[0]["digests"]
    assert "weightd: runtime layouts off (option 'layouts' is false)" in weightd_lines(output)
    assert "weightd: fed 21 tensors of model 'tiny-sglang' (generation 1, rank 0)" in output
    assert (growth(before, after, HIT), growth(before, after, NOT_FOUND)) == (0, 0)


def _variant(served, name, change=None):
    folder = served.models / name
    shutil.copytree(served.folder, folder)
    if change:
        tensors = {k: (d, s, bytes(b)) for k, (d, s, b) in read_safetensors(folder / "model.safetensors").items()}
        change(tensors)
        write_safetensors(folder / "model.safetensors", tensors)
    return folder


def test_amx_packed_state_is_not_published(served):
    """A CPU with AMX (simulated: run_sglang.py flags the linear modules as SGLang's AMX backend does)
    leaves state that is not plain tensors: the start says so and publishes nothing."""
    folder = _variant(served, "tiny-sglang-amx")
    result, output = run("weightd", str(folder), json.dumps({"socket": served.socket}),
                         env={"WEIGHTD_TEST_FAKE_AMX": "1"})
    assert result is not None, output
    assert ("weightd: runtime layout not published, the next start loads and post-processes again: SGLang's CPU AMX "
            "backend packed the weights of 8 modules for sgl-kernel, which uses them only where the module's flag "
            "use_intel_amx_backend (not a tensor) is set (first: model.layers.0.self_attn.qkv_proj)") \
        in weightd_lines(output), output
    (model,) = [m for m in served.client.list() if m.name == "tiny-sglang-amx"]
    assert model.layouts == ()


def test_engine_generates_transformers_tokens_from_the_files_and_from_the_layout(served):
    """Two full sglang.Engine(load_format="weightd", device="cpu") starts, scheduler process and all: the
    first loads, post-processes and publishes, the second runs on the attached layout; both generate
    transformers' greedy tokens."""
    folder = _variant(served, "tiny-sglang-engine")
    expected = tiny_llama.transformers_tokens(folder)
    first, output = run("engine", str(folder), json.dumps({"socket": served.socket}))
    assert first is not None, output
    assert first["tokens"] == expected
    assert f"weightd: published runtime layout '{KEY}' of model 'tiny-sglang-engine' rank 0 (16 tensors," in output
    before = served.metrics()
    second, output = run("engine", str(folder), json.dumps({"socket": served.socket}))
    assert second is not None, output
    assert second["tokens"] == expected
    assert f"weightd: start of model 'tiny-sglang-engine' rank 0: attached runtime layout '{KEY}' in " in output
    assert growth(before, served.metrics(), HIT) == 1
    _report["engine_first_ready_seconds"] = first["ready_seconds"]
    _report["engine_second_ready_seconds"] = second["ready_seconds"]


def _failed_lines(folder, extra):
    result, output = run("weightd", str(folder), json.dumps(extra))
    assert result is None, "SGLang loaded although it should not have"
    return weightd_lines(output), output


def test_layout_identity_mismatch(served):
    """A layout published under this start's key by another SGLang (here: another version in the identity)
    is refused with one line, not bound."""
    folder = _variant(served, "tiny-sglang-mismatch")
    served.client.load("tiny-sglang-mismatch", folder)
    with served.client.publish_layout("tiny-sglang-mismatch", KEY, {"x": ("F32", (1,))}, rank=0,
                                      identity=identity(engine="sglang 0.0.0")):
        pass
    lines, output = _failed_lines(folder, {"socket": served.socket})
    (model,) = [m for m in served.client.list() if m.name == "tiny-sglang-mismatch"]
    assert (f"weightd: runtime layout '{KEY}' of model 'tiny-sglang-mismatch' has another identity than this SGLang "
            f"start (FAILED_PRECONDITION: layout '{KEY}' of rank 0 of model 'tiny-sglang-mismatch' generation "
            f"{model.generation} was published with another identity: engine is 'sglang {version('sglang')}' here but "
            f"'sglang 0.0.0' in the published layout): drop it (weightctl drop-layout tiny-sglang-mismatch {KEY}) or "
            "start with the option 'layouts' false") in lines, output


def test_checkpoint_with_an_unexpected_tensor(served):
    folder = _variant(served, "tiny-sglang-extra", lambda t: t.update({"model.layers.0.mlp.extra.weight":
                                                                         ("F32", (2,), bytes(8))}))
    lines, output = _failed_lines(folder, {"socket": served.socket})
    assert ("weightd: model 'tiny-sglang-extra' (weightd rank 0) does not match LlamaForCausalLM: unexpected tensor "
            "'model.layers.0.mlp.extra.weight' (LookupError: LlamaForCausalLM.load_weights wrote it into no "
            "parameter)") in lines, output


def test_checkpoint_with_a_missing_tensor(served):
    folder = _variant(served, "tiny-sglang-missing",
                      lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    lines, output = _failed_lines(folder, {"socket": served.socket})
    assert ("weightd: model 'tiny-sglang-missing' (weightd rank 0) does not match LlamaForCausalLM: missing "
            "tensor(s) for parameter(s) model.layers.1.post_attention_layernorm.weight") in lines, output


def test_unknown_option(served):
    lines, output = _failed_lines(served.folder, {"socket": served.socket, "sockets": "x"})
    assert ("weightd: unknown option 'sockets' in the load format's extra config "
            "(known: socket, model, load, host_resident, tp_rules, devices, layouts)") in lines, output


def test_load_format_weightd_parses_with_the_plugin(served):
    result, output = run("args", str(served.folder))
    assert result == {"load_format": "weightd", "loader": "weightd._sglang_loader.WeightdModelLoader"}, output


def test_load_format_weightd_is_refused_without_the_plugin(served):
    result, output = run("args", str(served.folder), env={"SGLANG_PLUGINS": "none"})
    assert result is None
    assert "error: argument --load-format: invalid choice: 'weightd'" in output
