"""attach(..., pin=...) in a process without a CUDA driver: what is refused
before a lease is kept, the clear error pinning reports while the attach
itself works, and that nothing loads libcuda.so.1 or torch unless pin is
asked. The fake-driver half is test_pin_fake_driver.py (its own CTest,
python_pin_fake_driver: the driver is loaded once per process)."""
import ctypes
import subprocess
import sys
import textwrap

import grpc
import pytest

import weightd


def _driver_installed():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def demo_pin(emulated_daemon, demo_small):
    """demo-small with embed_tokens on the host and the rest on emulated GPU 0."""
    emulated_daemon.client.load("demo-pin", demo_small, host_resident=["embed_tokens"], devices=["0"])
    return emulated_daemon


def test_pin_with_private_is_refused_before_any_lease(demo_pin):
    with pytest.raises(weightd.WeightdError) as e:
        demo_pin.client.attach("demo-pin", private=True, pin=True)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "pin cannot be combined with private=True" in e.value.message
    with pytest.raises(weightd.WeightdError, match=r"pin_chunk_bytes 100 is outside \[4096, 68719476736\]"):
        demo_pin.client.attach("demo-pin", pin=True, pin_chunk_bytes=100)
    assert demo_pin.leases("demo-pin") == 0


@pytest.mark.parametrize("packed", [True, False])
def test_a_pattern_matching_no_host_tensor_is_refused_and_the_lease_ended(demo_pin, packed):
    with pytest.raises(weightd.WeightdError) as e:
        demo_pin.client._attach("demo-pin", pin=["embed_tokens", "q_proj"], packed=packed)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.message.startswith("pin pattern 'q_proj' matches no host tensor of model 'demo-pin' rank 0 (it "
                                      "matches ")
    assert e.value.message.endswith(" device-placed tensors; only host tensors are pinned)")
    assert demo_pin.wait_leases("demo-pin", 0) == 0


def test_without_pin_there_is_nothing_to_wait_for(demo_pin):
    with demo_pin.client.attach("demo-pin") as model:
        assert model.pin_progress() is None
        with pytest.raises(weightd.WeightdError, match="was attached without pin") as e:
            model.wait_pinned(1)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        name = next(n for n in model if "embed_tokens" in n)
        assert model[name].device_ptr == 0
        with pytest.raises(weightd.WeightdError, match=r"has no device pointer: it is not pinned"):
            model[name].cuda_view()


@pytest.mark.skipif(_driver_installed(), reason="a libcuda.so.1 is installed here")
def test_without_a_driver_the_attach_works_and_pinning_says_why(demo_pin):
    with demo_pin.client.attach("demo-pin", pin=["embed_tokens"]) as model:
        name = next(n for n in model if "embed_tokens" in n)
        assert model[name].to_torch().numel() > 0  # mapped as usual
        with pytest.raises(weightd.WeightdError) as e:
            model.wait_pinned(30)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert e.value.message.startswith(
            "pinning host tensors: libcuda.so.1 not found: no NVIDIA driver on this machine")
        progress = model.pin_progress()
        assert progress.state == weightd.PinState.FAILED
        assert progress.error.startswith("UNAVAILABLE: pinning host tensors: libcuda.so.1 not found")
        assert model[name].device_ptr == 0
        with pytest.raises(weightd.WeightdError, match=r"has no device pointer: pinning is FAILED"):
            model[name].cuda_view()


def test_pin_arguments_are_patterns():
    from weightd import _pin
    assert _pin.patterns_of(True) == [""]
    assert _pin.patterns_of(False) == []
    assert _pin.patterns_of("embed") == ["embed"]
    assert _pin.patterns_of(("a", "b")) == ["a", "b"]
    with pytest.raises(TypeError, match="pin patterns are strings, not int: 3"):
        _pin.patterns_of(["a", 3])


def test_import_and_attach_without_pin_load_neither_torch_nor_the_driver(demo_pin):
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import sys, weightd
        with weightd.connect({demo_pin.socket!r}).attach("demo-pin") as model:
            model[next(iter(model))].data_ptr()
        maps = open("/proc/self/maps").read()
        print("torch" in sys.modules, "libcuda" in maps)
    """)], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["False", "False"]
