"""attach(..., pin=...) against the fake CUDA driver (tests/gpu/fake_libcuda.cc),
which CTest puts first on LD_LIBRARY_PATH for this file alone
(python_pin_fake_driver): device pointers, the ranges and flags registered,
readiness, and unregistration when the last holder of the lease goes,
including in the middle of pinning. The fake maps registered memory at its
host address and reports its registrations through
weightd_fake_cuda_host_registrations."""
import ctypes
import gc
import os

import grpc
import pytest

import weightd

PAGE = 4096
PORTABLE_DEVICEMAP_READ_ONLY = 0x01 | 0x02 | 0x08  # cuda.h CU_MEMHOSTREGISTER_*

pytestmark = pytest.mark.skipif(
    not os.environ.get("WEIGHTD_FAKE_CUDA_DIR")
    or os.environ["WEIGHTD_FAKE_CUDA_DIR"] not in os.environ.get("LD_LIBRARY_PATH", ""),
    reason="needs the fake CUDA driver on LD_LIBRARY_PATH (CTest python_pin_fake_driver)")


def registrations():
    """The fake driver's registered host ranges: [(base, bytes, flags)]."""
    library = ctypes.CDLL("libcuda.so.1")
    lister = library.weightd_fake_cuda_host_registrations
    bases, sizes, flags = (ctypes.c_uint64 * 64)(), (ctypes.c_uint64 * 64)(), (ctypes.c_uint * 64)()
    n = lister(bases, sizes, flags, 64)
    return [(bases[i], sizes[i], flags[i]) for i in range(min(n, 64))]


def pages(address, nbytes):
    first = address // PAGE * PAGE
    return first, (address + nbytes + PAGE - 1) // PAGE * PAGE - first


@pytest.fixture(scope="module")
def demo_pin(emulated_daemon, demo_small):
    """demo-small with embed_tokens on the host and the rest on emulated GPU 0."""
    emulated_daemon.client.load("demo-pin", demo_small, host_resident=["embed_tokens"], devices=["0"])
    return emulated_daemon


@pytest.mark.parametrize("packed", [True, False])
def test_pinned_host_tensors_get_device_pointers_until_the_lease_goes(demo_pin, packed):
    model = demo_pin.client._attach("demo-pin", pin=["embed_tokens"], packed=packed)
    progress = model.wait_pinned(30)
    names = [n for n in model if "embed_tokens" in n]
    assert names
    assert progress.state == weightd.PinState.READY
    assert progress.tensors == len(names)
    assert progress.read_only
    assert progress.device_ordinal == 0
    assert progress.bytes_done == progress.bytes_total > 0
    assert progress.error == ""
    for name in names:
        t = model[name]
        assert t.device_ptr == t.data_ptr()  # the fake maps registered memory at the host address
        base, size = pages(t.data_ptr(), t.nbytes)
        assert any(b <= base and base + size <= b + s for b, s, _ in registrations()), name
    assert {f for _, _, f in registrations()} == {PORTABLE_DEVICEMAP_READ_ONLY}
    assert sum(s for _, s, _ in registrations()) == progress.bytes_total
    assert model[next(n for n in model if "embed_tokens" not in n)].device_ptr == 0
    view = model[names[0]].cuda_view()
    assert view.__dlpack_device__() == (2, 0)
    assert view.data_ptr() == model[names[0]].data_ptr()
    capsule = view.__dlpack__()
    del view, t
    model.close()
    gc.collect()
    assert registrations(), "an exported CUDA view keeps the pages registered"
    del capsule
    gc.collect()
    assert registrations() == []
    assert demo_pin.wait_leases("demo-pin", 0) == 0


def test_closing_in_the_middle_of_pinning_unregisters_what_was_registered(demo_pin):
    model = demo_pin.client.attach("demo-pin", pin=True, pin_chunk_bytes=PAGE)
    model.close()  # at once, whatever the pinning thread had reached
    del model
    gc.collect()
    assert registrations() == []
    assert demo_pin.wait_leases("demo-pin", 0) == 0


def test_bounded_chunks_each_hold_whole_tensors(demo_pin):
    with demo_pin.client.attach("demo-pin", pin=True, pin_chunk_bytes=1 << 20) as model:
        progress = model.wait_pinned(30)
        regs = registrations()
        assert len(regs) == progress.chunks_total
        assert all(b % PAGE == 0 and s % PAGE == 0 for b, s, _ in regs)
        names = [n for n in model if "embed_tokens" in n]
        for name in names:
            t = model[name]
            base, size = pages(t.data_ptr(), t.nbytes)
            holders = [(b, s) for b, s, _ in regs if b <= base and base + size <= b + s]
            assert len(holders) == 1, name
            b, s = holders[0]
            assert s <= 1 << 20 or s == size, "only a tensor larger than the bound gets a larger registration"
        del t
    gc.collect()
    assert registrations() == []


def test_a_torch_cuda_view_needs_a_cuda_torch(demo_pin):
    torch = pytest.importorskip("torch")
    with demo_pin.client.attach("demo-pin", pin=["embed_tokens"]) as model:
        model.wait_pinned(30)
        t = model[next(n for n in model if "embed_tokens" in n)]
        if torch.cuda.is_available():  # a real GPU with this fake driver cannot happen; keep the branch honest
            pytest.skip("torch sees a GPU")
        with pytest.raises(weightd.WeightdError) as e:
            t.to_torch_cuda()
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert f"torch {torch.__version__} cannot use CUDA here" in e.value.message
        assert "(Tensor.device_ptr gives the raw device address)" in e.value.message


def test_pages_are_unregistered_before_the_segments_are_unmapped(demo_pin):
    model = demo_pin.client.attach("demo-pin", pin=["embed_tokens"])
    model.wait_pinned(30)
    lease = model._lease
    segments = list(lease.segments)
    unmapped_when_unregistered = []

    class RecordingPinner:
        def __init__(self, inner):
            self.inner = inner

        def close(self):
            unmapped_when_unregistered.append([s.closed for s in segments])
            self.inner.close()

        def __getattr__(self, name):
            return getattr(self.inner, name)

    lease.pinner = RecordingPinner(lease.pinner)
    model.close()
    del model, lease
    gc.collect()
    assert unmapped_when_unregistered == [[False] * len(segments)]
    assert registrations() == []
