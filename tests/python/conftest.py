"""Fixtures for the Python client tests: a real daemon on a temporary socket,
checkpoints to load, and an independent reader of safetensors files.

Environment (set by CTest, see tests/python/CMakeLists.txt):
  WEIGHTD_BINARY, WEIGHTCTL_BINARY   the built daemon and CLI
  WEIGHTD_SHARED_DIR                 holds real-checkpoints/ (tests skip without it)
  WEIGHTD_REQUIRE_SHARED=1           ...unless this is set: then they fail
"""
import json
import mmap
import os
import re
import struct
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

import weightd

SHARED_DIR = Path(os.environ.get("WEIGHTD_SHARED_DIR", "/nonexistent"))
REAL_CHECKPOINTS = SHARED_DIR / "real-checkpoints"
MALFORMED_FILE = "safetensors_abuse_attempt_1.safetensors"


def _binary(variable):
    path = os.environ.get(variable)
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"{variable} must name the built binary (ctest sets it; see tests/python/CMakeLists.txt)")
    return path


def require_shared():
    """Skips the calling test without the shared inputs, or fails where CI demands them."""
    if REAL_CHECKPOINTS.is_dir():
        return
    message = f"real checkpoints not found at {REAL_CHECKPOINTS} (set WEIGHTD_SHARED_DIR)"
    if os.environ.get("WEIGHTD_REQUIRE_SHARED") == "1":
        pytest.fail(message + ", but WEIGHTD_REQUIRE_SHARED=1")
    pytest.skip(message)


def real_checkpoint_cases():
    """(model name, path) for every valid real checkpoint: the sharded folder as one, other files one by one."""
    if not REAL_CHECKPOINTS.is_dir():
        return []
    cases = [REAL_CHECKPOINTS / "fluxml-sharded"]
    cases += sorted(p for p in REAL_CHECKPOINTS.glob("*/*.safetensors")
                    if p.parent.name != "fluxml-sharded" and p.name != MALFORMED_FILE)
    return [(re.sub(r"[^A-Za-z0-9._-]", "-", str(p.relative_to(REAL_CHECKPOINTS))), p) for p in cases]


# ------------------------------------------------------------ safetensors

def read_safetensors(path):
    """{name: (dtype, shape, memoryview of the bytes)} for a file or a checkpoint folder, straight from the files."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif (path / "model.safetensors.index.json").exists():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        files = sorted({path / f for f in index["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    tensors = {}
    for f in files:
        with open(f, "rb") as handle:
            data = memoryview(mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ))
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(bytes(data[8:8 + n]))
        header.pop("__metadata__", None)
        for name, t in header.items():
            begin, end = t["data_offsets"]
            tensors[name] = (t["dtype"], tuple(t["shape"]), data[8 + n + begin:8 + n + end])
    return tensors


def write_safetensors(path, tensors):
    """Writes {name: (dtype, shape, bytes)} as a safetensors file (8-aligned header)."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(d for _, _, d in tensors.values()))


# ------------------------------------------------------------ daemon

class DaemonStartError(Exception):
    pass


class Daemon:
    """A weightd process on a socket under `root`, serving `models` (and the shared inputs)."""

    def __init__(self, root, models, *extra_args):
        self.root = root
        self.socket = str(root / "weightd.sock")
        self.models = models
        self.weightctl = _binary("WEIGHTCTL_BINARY")
        self.log = root / "weightd.log"
        roots = ["--model-root", str(self.models)]
        if SHARED_DIR.is_dir():
            roots += ["--model-root", str(SHARED_DIR)]
        # No metrics listener: a fixed port would collide with other tests.
        argv = [_binary("WEIGHTD_BINARY"), "--socket", self.socket, "--metrics-address", "", *roots, *extra_args]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.client = weightd.connect(self.socket)
        self._wait_ready()

    def _wait_ready(self):
        deadline = time.monotonic() + 20
        while True:
            if self.process.poll() is not None:
                raise DaemonStartError(f"weightd exited with {self.process.returncode}: {self.log.read_text()}")
            try:
                self.client.list()
                return
            except weightd.WeightdError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise DaemonStartError(f"weightd did not answer on {self.socket}: {self.log.read_text()}")
                time.sleep(0.05)

    def metrics(self):
        """{sample name with labels: value} from the daemon's /metrics (started with --metrics-address
        127.0.0.1:0 among its extra arguments: the address is read from its log)."""
        address = re.search(r"metrics on (http://\S+/metrics)", self.log.read_text()).group(1)
        text = urllib.request.urlopen(address, timeout=10).read().decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def weightctl_json(self, *args):
        out = subprocess.run([self.weightctl, "--socket", self.socket, *args, "--json"], check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out)

    def leases(self, name):
        """The lease count of `name`'s newest generation, as `weightctl ls --json` reports it."""
        models = [m for m in self.weightctl_json("ls")["models"] if m["name"] == name]
        return max(models, key=lambda m: m["generation"])["leases"] if models else 0

    def wait_leases(self, name, expected, timeout=10):
        """Polls until `name` has `expected` leases (the daemon sees a closed fd socket asynchronously)."""
        deadline = time.monotonic() + timeout
        while self.leases(name) != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.leases(name)

    def stop(self):
        self.client.close()
        self.process.terminate()
        return self.process.wait(timeout=30)


def _start(root, models, *extra_args):
    try:
        return Daemon(root, models, *extra_args)
    except DaemonStartError as e:
        pytest.fail(str(e))


def _stop(d):
    code = d.stop()
    assert code == 0, f"weightd exited with {code}: {d.log.read_text()}"


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("weightd")
    (root / "models").mkdir()
    d = _start(root, root / "models")
    yield d
    _stop(d)


@pytest.fixture(scope="session")
def demo_small(daemon):
    """The `make-demo small` checkpoint, loaded as "demo-small"; returns its folder."""
    path = daemon.models / "demo-small"
    subprocess.run([daemon.weightctl, "make-demo", str(path), "--preset", "small"], check=True,
                   capture_output=True)
    daemon.client.load("demo-small", path)
    return path


@pytest.fixture(scope="session")
def emulated_daemon(tmp_path_factory, daemon, demo_small):
    """A second daemon with the emulated (memfd-backed) device backend, serving the same models."""
    root = tmp_path_factory.mktemp("weightd-emulated")
    try:
        d = Daemon(root, daemon.models, "--device-backend", "emulated")
    except DaemonStartError as e:
        pytest.skip(f"device backend not built yet: {e}")
    yield d
    _stop(d)
