"""A client across a daemon restart and an in-place upgrade (issue 15):
mappings stay valid, and the same Client reconnects on its next call once
the daemon is back instead of waiting out gRPC's reconnect backoff."""
import signal
import subprocess
import time

import pytest

import weightd
from conftest import _binary, _start, read_safetensors
from test_client import check_model_matches_files


def _demo(root):
    models = root / "models"
    models.mkdir()
    subprocess.run([_binary("WEIGHTCTL_BINARY"), "make-demo", str(models / "tiny")], check=True, capture_output=True)
    return models


def _wait_answers(socket, weightctl, timeout=20):
    """Waits until the daemon answers a separate process (not the client under test)."""
    deadline = time.monotonic() + timeout
    while subprocess.run([weightctl, "--socket", socket, "ls"], capture_output=True).returncode != 0:
        assert time.monotonic() < deadline, "the daemon did not come back"
        time.sleep(0.05)


def test_the_same_client_reconnects_on_its_next_call_after_a_restart(tmp_path):
    models = _demo(tmp_path)
    d = _start(tmp_path, models)
    client = weightd.connect(d.socket)
    client.load("tiny", models / "tiny")
    # The daemon dies; calls fail with UNAVAILABLE for a while (long enough
    # for gRPC's backoff to grow past what a test waits).
    d.process.send_signal(signal.SIGKILL)
    d.process.wait()
    deadline = time.monotonic() + 3
    failures = 0
    while time.monotonic() < deadline:
        with pytest.raises(weightd.WeightdError) as error:
            client.list()
        assert error.value.code.name == "UNAVAILABLE"
        failures += 1
        time.sleep(0.2)
    assert failures >= 10
    again = _start(tmp_path, models)
    _wait_answers(again.socket, again.weightctl)
    assert client.list() == []  # the first call after the daemon is back succeeds: a new daemon, no models
    client.load("tiny", models / "tiny")
    assert [m.name for m in client.list()] == ["tiny"]
    client.close()
    again.stop()


def test_attached_tensors_stay_valid_across_an_in_place_upgrade(tmp_path):
    models = _demo(tmp_path)
    d = _start(tmp_path, models)
    client = weightd.connect(d.socket)
    client.load("tiny", models / "tiny")
    before = {m.name: (m.generation, m.fingerprint) for m in client.list()}
    model = client.attach("tiny")
    expected = read_safetensors(models / "tiny")
    out = subprocess.run([d.weightctl, "--socket", d.socket, "upgrade", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert d.process.poll() is None  # the same process, re-executed
    after = {m.name: (m.generation, m.fingerprint) for m in client.list()}
    assert after == before
    check_model_matches_files(model, expected)  # mapped before the upgrade, read after it
    fresh = client.attach("tiny")
    check_model_matches_files(fresh, expected)
    model.close()
    fresh.close()
    client.close()
    d.stop()
