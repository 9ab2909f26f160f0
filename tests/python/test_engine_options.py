"""The engine load formats' shared part (weightd._engine), without any engine:
their options and the daemon-side steps before an attach, against a real daemon.
The engines themselves are tested in tests/python/engines/ (scripts/test-engines.sh)."""
import logging
import shutil
import subprocess
import sys

import pytest

from weightd._engine import LoadFormatError, Options, Session, model_name_for

LOG = logging.getLogger("test_engine_options")


def test_options_default_and_parsed():
    assert Options.from_config(None) == Options()
    options = Options.from_config({"socket": "/s.sock", "model": "m", "load": False, "host_resident": ".embed.",
                                   "tp_rules": ["proj.weight:0", "a:b:1"], "devices": ["GPU-a", "1"], "layouts": False})
    assert options == Options(socket="/s.sock", model="m", load=False, host_resident=(".embed.",),
                              tp_rules=(("proj.weight", 0), ("a:b", 1)), devices=("GPU-a", "1"), layouts=False)


@pytest.mark.parametrize("config, message", [
    ({"sockets": "x"}, "weightd: unknown option 'sockets' in the load format's extra config "
                       "(known: socket, model, load, host_resident, tp_rules, devices, layouts)"),
    ({"load": "yes"}, "weightd: option 'load' must be true or false, got 'yes'"),
    ({"model": ""}, "weightd: option 'model' must be a non-empty string, got ''"),
    ({"host_resident": [1]}, "weightd: option 'host_resident' must be a string or a list of non-empty strings, got [1]"),
    ({"tp_rules": ["proj.weight"]}, "weightd: option 'tp_rules': 'proj.weight' is not PATTERN:DIM (e.g. \"proj.weight:0\")"),
])
def test_bad_options_are_one_line_naming_the_key(config, message):
    with pytest.raises(LoadFormatError) as e:
        Options.from_config(config)
    assert str(e.value) == message


def test_model_name_from_the_path():
    assert model_name_for("/models/Llama 3.1 8B/") == "Llama-3.1-8B"
    assert model_name_for("meta-llama/Llama-3-8B") == "Llama-3-8B"


def test_daemon_not_reachable(tmp_path):
    session = Session.create(Options(socket=str(tmp_path / "none.sock")), "/models/x", LOG)
    with pytest.raises(LoadFormatError) as e:
        session.open(1)
    assert str(e.value).startswith(f"weightd: daemon not reachable at unix://{tmp_path}/none.sock (UNAVAILABLE: ")
    assert "\n" not in str(e.value)


def test_not_loaded_and_load_off(daemon, demo_small):
    session = Session.create(Options(socket=daemon.socket, model="absent", load=False), str(demo_small), LOG)
    with pytest.raises(LoadFormatError) as e:
        session.open(1)
    assert str(e.value) == (f"weightd: model 'absent' is not loaded in weightd at unix://{daemon.socket} and the "
                            f"option 'load' is false: run `weightctl load absent {demo_small}` first")


def test_loads_when_absent_then_reuses(daemon, demo_small):
    copy = daemon.models / "engine-options-demo"
    shutil.copytree(demo_small, copy)
    session = Session.create(Options(socket=daemon.socket), str(copy), LOG)
    info = session.open(1)
    assert (info.name, info.state, info.tp_size) == ("engine-options-demo", "READY", 1)
    again = Session.create(Options(socket=daemon.socket), str(copy), LOG).open(1)
    assert again.generation == info.generation
    # A whole model serves every engine TP rank from weightd's rank 0.
    assert [session.rank_for(r, 4) for r in range(4)] == [0, 0, 0, 0]


def test_split_load_on_the_named_devices(emulated_daemon, demo_small):
    """tp_rules split the load into the engine's TP size, on the daemon's GPUs named by `devices`;
    engine TP rank r then attaches weightd rank r."""
    copy = emulated_daemon.models / "engine-options-split"
    shutil.copytree(demo_small, copy)
    options = Options(socket=emulated_daemon.socket, tp_rules=(("q_proj", 0), ("down_proj", 1)), devices=("0", "1"))
    session = Session.create(options, str(copy), LOG)
    info = session.open(2)
    assert (info.name, info.state, info.tp_size) == ("engine-options-split", "READY", 2)
    assert [session.rank_for(r, 2) for r in range(2)] == [0, 1]
    split = {t.name: t.split_dim for t in emulated_daemon.client.manifest("engine-options-split", 1).tensors
             if t.split_dim >= 0}
    assert split and set(split.values()) == {0, 1}
    assert all(("q_proj" in n) == (d == 0) and ("down_proj" in n) == (d == 1) for n, d in split.items())


def _cuda_devices():
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_cuda_devices() > 0, reason="this process sees a CUDA device: the line is for nodes without one")
def test_split_load_without_devices_where_there_is_no_gpu(emulated_daemon, demo_small):
    """Without `devices` a split load takes this process's CUDA devices 0..N-1 (one node's TP ranks);
    a process with none (a CPU engine, this machine) gets one line saying what to give."""
    copy = emulated_daemon.models / "engine-options-no-devices"
    shutil.copytree(demo_small, copy)
    session = Session.create(Options(socket=emulated_daemon.socket, tp_rules=(("q_proj", 0),)), str(copy), LOG)
    with pytest.raises(LoadFormatError) as e:
        session.open(2)
    assert str(e.value) == ("weightd: option 'tp_rules' splits the model into 2 TP ranks, one GPU each, but this "
                            "process sees 0 CUDA device(s): name the daemon's GPUs in the option 'devices' (UUIDs "
                            "or the daemon's ordinals, one per TP rank)")
    assert "engine-options-no-devices" not in {m.name for m in emulated_daemon.client.list()}  # nothing was asked


def test_load_refused_outside_the_model_roots(daemon, demo_small, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(demo_small, outside)
    with pytest.raises(LoadFormatError) as e:
        Session.create(Options(socket=daemon.socket), str(outside), LOG).open(1)
    assert str(e.value).startswith(f"weightd: weightd at unix://{daemon.socket} refused to load {outside} as model "
                                   "'outside': PERMISSION_DENIED: ")


def test_import_weightd_loads_no_engine_module():
    code = ("import sys, weightd, weightd.sglang; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang') "
            "or m in ('weightd.vllm', 'weightd._sglang_loader')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
