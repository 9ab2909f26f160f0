"""The pip-installed package in a bare venv (scripts/check-pip-install.sh): standard library only.

Imports weightd without torch and checks that its type information (py.typed,
_native.pyi) and the engine plugins' entry points (vllm.general_plugins,
sglang.srt.plugins) were installed, with no engine in the venv, then
against a daemon it starts (WEIGHTD_BINARY, WEIGHTCTL_BINARY): loads `make-demo tiny`, attaches, and compares every
tensor's bytes with the files through ctypes; then writes through a
private=True attach and checks that a second attach still reads the file.
Prints one line per check; exits non-zero on the first failure.
"""
import ctypes
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import weightd

assert "site-packages" in weightd.__file__, f"weightd imported from {weightd.__file__}, not the installed wheel"
assert "torch" not in sys.modules
try:
    import torch  # noqa: F401
    raise AssertionError("torch is importable: this venv must not see Debian's packages")
except ImportError:
    pass
print(f"import weightd without torch: ok ({weightd.__file__})")
_missing = [f for f in ("py.typed", "_native.pyi") if not (Path(weightd.__file__).parent / f).is_file()]
assert not _missing, f"the wheel lacks {_missing}: type checkers would not see the package's types"
print("py.typed and _native.pyi installed: ok")


def check_engine_entry_points():
    """The load formats' entry points are in the installed metadata, found the way vLLM and SGLang look
    them up, in a venv without either engine; reading them imports neither engine nor weightd's plugins."""
    from importlib.metadata import entry_points
    from importlib.util import find_spec

    for engine in ("vllm", "sglang", "torch"):
        assert find_spec(engine) is None, f"{engine} is importable: this venv must have no engine"
    expected = {"vllm.general_plugins": "weightd.vllm:register", "sglang.srt.plugins": "weightd.sglang:register"}
    for group, value in expected.items():
        found = [(ep.name, ep.value, ep.dist.name if ep.dist else None) for ep in entry_points(group=group)]
        assert found == [("weightd", value, "weightd")], f"entry points of {group}: {found}"
    assert not [m for m in sys.modules if m.startswith(("weightd.vllm", "weightd.sglang", "vllm", "sglang"))]
    print("entry points vllm.general_plugins and sglang.srt.plugins -> weightd, no engine installed: ok")


check_engine_entry_points()


def file_tensors(folder):
    """{name: bytes} of every safetensors file in `folder`."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        header.pop("__metadata__", None)
        for name, t in header.items():
            begin, end = t["data_offsets"]
            tensors[name] = data[8 + n + begin:8 + n + end]
    return tensors


def mapped_bytes(tensor):
    return ctypes.string_at(tensor.data_ptr(), tensor.nbytes)


def wait_ready(client, daemon, log):
    deadline = time.monotonic() + 20
    while True:
        try:
            return client.list()
        except weightd.WeightdError:
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"weightd did not start: {log.read_text()}")
            time.sleep(0.05)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = root / "models"
        models.mkdir()
        subprocess.run([os.environ["WEIGHTCTL_BINARY"], "make-demo", str(models / "tiny"), "--preset", "tiny"],
                       check=True, capture_output=True)
        socket = str(root / "weightd.sock")
        log = root / "weightd.log"
        with open(log, "wb") as out:
            daemon = subprocess.Popen([os.environ["WEIGHTD_BINARY"], "--socket", socket, "--metrics-address", "",
                                       "--model-root", str(models)], stdout=out, stderr=subprocess.STDOUT)
        try:
            client = weightd.connect(socket)
            wait_ready(client, daemon, log)
            client.load("tiny", models / "tiny")
            expected = file_tensors(models / "tiny")
            with client.attach("tiny") as model:
                assert sorted(model) == sorted(expected)
                for name, data in expected.items():
                    assert mapped_bytes(model[name]) == data, name
            print(f"attach: {len(expected)} tensors equal the files: ok")
            name = sorted(expected)[0]
            with client.attach("tiny", private=True) as mine:
                ctypes.memset(mine[name].data_ptr(), 0x5A, 64)
                assert mapped_bytes(mine[name])[:64] == b"\x5a" * 64
                with client.attach("tiny") as other:
                    assert mapped_bytes(other[name]) == expected[name]
            print("private=True: the write stays in this mapping: ok")
            client.close()
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
    assert "torch" not in sys.modules
    print("pip install check: ok")


if __name__ == "__main__":
    main()
