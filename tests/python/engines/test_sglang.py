"""weightd.sglang in the real SGLang 0.5.23, on the CPU (scripts/test-sglang.sh).

SGLang's own LlamaForCausalLM is built and loaded twice in one process
(run_sglang.py): by SGLang's DefaultModelLoader from the files, and through
`load_format="weightd"` resolved by the plugin from a test daemon; every
parameter and buffer must be equal. `--load-format weightd` must parse with
SGLang's server argument parser when the plugin is installed, and be refused
by it when the plugin is not loaded.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("WEIGHTD_REQUIRE_ENGINES") != "1":  # scripts/test-sglang.sh sets it: there, a missing SGLang fails
    pytest.importorskip("sglang", reason="SGLang is not installed here (scripts/test-sglang.sh makes its venv)")

import tiny_llama  # noqa: E402

RUNNER = Path(__file__).with_name("run_sglang.py")


@pytest.fixture(scope="module")
def tiny(daemon):
    return tiny_llama.make(daemon.models / "tiny-sglang")


def run(*args, env=None):
    done = subprocess.run([sys.executable, str(RUNNER), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600, env={**os.environ, **(env or {})})
    results = [line[len("RESULT "):] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return (json.loads(results[0]) if results else None), done.stdout


def test_llama_through_weightd_equals_sglangs_default_loader(daemon, tiny):
    result, output = run("load", str(tiny), json.dumps({"socket": daemon.socket}))
    assert result == {"classes": {"auto": "sglang.srt.model_loader.loader.DefaultModelLoader",
                                  "weightd": "weightd._sglang_loader.WeightdModelLoader"},
                      "model": "LlamaForCausalLM", "tensors": 16, "names_equal": True, "differ": []}, output
    assert "weightd: fed 21 tensors of model 'tiny-sglang' (generation 1, rank 0) through LlamaForCausalLM" in output
    assert daemon.leases("tiny-sglang") == 0


def test_load_format_weightd_parses_with_the_plugin(tiny):
    result, output = run("args", str(tiny))
    assert result == {"load_format": "weightd", "loader": "weightd._sglang_loader.WeightdModelLoader"}, output


def test_load_format_weightd_is_refused_without_the_plugin(tiny):
    result, output = run("args", str(tiny), env={"SGLANG_PLUGINS": "none"})
    assert result is None
    assert "error: argument --load-format: invalid choice: 'weightd'" in output
