"""The weightd Python client against a real daemon (fixtures in conftest.py)."""
import gc
import pathlib
import re
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import numpy as np
import pytest
import torch

import weightd
from weightd import _fdsock
from conftest import MALFORMED_FILE, REAL_CHECKPOINTS, Daemon, read_safetensors, real_checkpoint_cases, require_shared
from conftest import write_safetensors

# Same-width integer types, to compare any tensor bit for bit (NaNs included).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _inside(model, info, address, nbytes):
    base, size = model.mappings[info.segment]
    return base + info.offset == address and address + nbytes <= base + size


def check_model_matches_files(model, expected):
    """Every tensor of `model` equals the file bytes, typed where torch can, without a copy."""
    assert sorted(model) == sorted(expected)
    for name, (dtype, shape, data) in expected.items():
        tensor = model[name]
        assert (tensor.dtype, tensor.shape, tensor.nbytes) == (dtype, shape, len(data)), name
        raw = np.from_dlpack(tensor.raw())
        assert raw.tobytes() == data, name
        if len(data):
            assert _inside(model, tensor.info, raw.__array_interface__["data"][0], len(data)), name
        try:
            target = weightd.torch_dtype(dtype)
        except weightd.UnsupportedDtypeError:
            with pytest.raises(weightd.UnsupportedDtypeError, match=f"{re.escape(repr(name))}.*dtype {dtype}"):
                tensor.to_torch()
            continue
        value = tensor.to_torch()
        if dtype == "F4":  # torch.float4_e2m1fn_x2 holds two elements
            shape = shape[:-1] + (shape[-1] // 2,)
        assert (value.dtype, tuple(value.shape)) == (target, shape), name
        if len(data):
            assert _inside(model, tensor.info, value.data_ptr(), len(data)), f"{name} was copied"
            reference = torch.frombuffer(bytearray(data), dtype=target).reshape(shape)
            width = _BITS[value.element_size()]
            assert torch.equal(value.view(width), reference.view(width)), name


@pytest.mark.parametrize("name,path", real_checkpoint_cases() or [("none", None)])
def test_real_checkpoint_tensors_equal_the_files(daemon, name, path):
    require_shared()
    daemon.client.load(name, path)
    with daemon.client.attach(name) as model:
        check_model_matches_files(model, read_safetensors(path))


def test_real_checkpoints_cover_bf16_and_f8():
    require_shared()
    dtypes = {d for _, p in real_checkpoint_cases() for d, _, _ in read_safetensors(p).values()}
    assert {"BF16", "F8_E4M3", "F8_E5M2", "BOOL", "F16"} <= dtypes


def test_bf16_and_f8_get_their_torch_dtypes(daemon):
    require_shared()
    path = REAL_CHECKPOINTS / "fluxml-nonsharded" / "model.safetensors"
    daemon.client.load("flux-dtypes", path)
    with daemon.client.attach("flux-dtypes") as model:
        assert model["bfloat16_35"].to_torch().dtype == torch.bfloat16
        assert model["bfloat16_35"].to_torch().view(torch.int16).flatten()[0].item() == int.from_bytes(
            read_safetensors(path)["bfloat16_35"][2][:2], "little", signed=True)
        for name, dtype in (("float8_e4m3fn_35", "float8_e4m3fn"), ("float8_e5m2_35", "float8_e5m2")):
            if hasattr(torch, dtype):
                assert model[name].to_torch().dtype == getattr(torch, dtype)
            else:
                with pytest.raises(weightd.UnsupportedDtypeError, match=rf"F8_E[45]M[32] .*\(torch.{dtype} is added in torch 2\.1\)"):
                    model[name].to_torch()


def test_demo_small_tensors_equal_the_files(daemon, demo_small):
    with daemon.client.attach("demo-small") as model:
        check_model_matches_files(model, read_safetensors(demo_small))


def test_hand_made_dtypes_export_or_name_the_dtype(daemon):
    """Dtypes no real file has: C64 and wide unsigned travel through DLPack; F4, F8_E8M0 and FNUZ reach torch
    where it has them (else the error names the torch release that adds them); F6 is refused by name."""
    path = daemon.models / "hand-made.safetensors"
    tensors = {
        "c64": ("C64", (2,), np.array([1 + 2j, -3.5j], dtype=np.complex64).tobytes()),
        "u16": ("U16", (3,), np.array([1, 65535, 7], dtype=np.uint16).tobytes()),
        "u32": ("U32", (2,), np.array([4000000000, 5], dtype=np.uint32).tobytes()),
        "u64": ("U64", (1,), np.array([2**64 - 1], dtype=np.uint64).tobytes()),
        "scalar": ("F32", (), np.array(2.5, dtype=np.float32).tobytes()),
        "empty": ("F32", (0, 4), b""),
        "e8m0": ("F8_E8M0", (2,), b"\x7f\x80"),
        "fnuz": ("F8_E4M3FNUZ", (2,), b"\x01\x02"),
        "f4": ("F4", (4,), b"\x12\x34"),
        "f4odd": ("F4", (2, 3), b"\x12\x34\x56"),
        "f6": ("F6_E2M3", (4,), b"\x01\x02\x03"),
    }
    write_safetensors(path, tensors)
    daemon.client.load("hand-made", path)
    with daemon.client.attach("hand-made") as model:
        assert np.from_dlpack(model["c64"]).tolist() == [1 + 2j, -3.5j]
        assert np.from_dlpack(model["u16"]).tolist() == [1, 65535, 7]
        assert np.from_dlpack(model["u32"]).tolist() == [4000000000, 5]
        assert np.from_dlpack(model["u64"]).tolist() == [2**64 - 1]
        assert model["scalar"].to_torch().item() == 2.5
        assert tuple(model["empty"].to_torch().shape) == (0, 4)
        assert torch.equal(model["c64"].to_torch(), torch.tensor([1 + 2j, -3.5j], dtype=torch.complex64))
        for name in ("u16", "u32", "u64"):
            if hasattr(torch, f"uint{name[1:]}"):  # torch 2.3+
                assert model[name].to_torch().tolist() == np.from_dlpack(model[name]).tolist()
            else:
                with pytest.raises(weightd.UnsupportedDtypeError, match=rf"U{name[1:]} .*\(torch.uint{name[1:]} is added in torch 2\.3\)"):
                    model[name].to_torch()
        # No DLPack 0.6 code: reach torch by reinterpreting bytes where torch
        # has the dtype, else refused naming the torch release that adds it.
        expected = {"e8m0": ("float8_e8m0fnu", "2.7", (2,)), "fnuz": ("float8_e4m3fnuz", "2.2", (2,)),
                    "f4": ("float4_e2m1fn_x2", "2.8", (2,))}
        for name in ("e8m0", "fnuz", "f4", "f6"):
            dtype, _, data = tensors[name]
            if name in ("e8m0", "fnuz"):  # 8-bit floats: uint8 carriers of the same shape
                carrier = np.from_dlpack(model[name])
                assert (carrier.dtype, carrier.shape, carrier.tobytes()) == (np.uint8, (2,), data)
            else:  # no DLPack type holds an element under a byte
                with pytest.raises(ValueError, match=f"safetensors dtype {dtype} has no DLPack equivalent"):
                    model[name].__dlpack__()
            assert np.from_dlpack(model[name].raw()).tobytes() == data
            if name == "f6":
                with pytest.raises(weightd.UnsupportedDtypeError) as e:
                    model[name].to_torch()
                assert str(e.value) == (f"tensor 'f6': safetensors dtype F6_E2M3 has no torch dtype in torch "
                                        f"{torch.__version__} (no torch release has a dtype for it); Tensor.raw() "
                                        "exports its bytes")
                continue
            target, release, torch_shape = expected[name]
            if hasattr(torch, target):
                value = model[name].to_torch()
                assert (value.dtype, tuple(value.shape)) == (getattr(torch, target), torch_shape)
                assert value.view(torch.uint8).numpy().tobytes() == data
                assert value.data_ptr() == np.from_dlpack(model[name].raw()).__array_interface__["data"][0]
            else:
                with pytest.raises(weightd.UnsupportedDtypeError) as e:
                    model[name].to_torch()
                assert str(e.value) == (f"tensor {name!r}: safetensors dtype {dtype} has no torch dtype in torch "
                                        f"{torch.__version__} (torch.{target} is added in torch {release}); "
                                        "Tensor.raw() exports its bytes")
        # F4 pairs along the last dimension: an odd one cannot be a float4_e2m1fn_x2 view.
        if hasattr(torch, "float4_e2m1fn_x2"):
            with pytest.raises(weightd.UnsupportedDtypeError, match=r"'f4odd': F4 shape \[2, 3\] does not pair up"):
                model["f4odd"].to_torch()


def test_weights_iterator_yields_e8m0_scales_and_f4_where_torch_has_them(daemon):
    """Issue 27's done-when: an Engram-style F8_E8M0 scale table and an F4 tensor come out of
    weights_iterator() with their torch dtype and the file's bytes; an older torch's error names
    the tensor, the dtype and the release that adds it (scripts/test-current-torch.sh runs this on
    PyPI's current torch)."""
    path = daemon.models / "e8m0-f4.safetensors"
    tensors = {"engram.embed.scale": ("F8_E8M0", (4, 2), bytes(range(120, 128))),
               "experts.w1": ("F4", (2, 4), b"\x12\x34\x56\x78")}
    write_safetensors(path, tensors)
    daemon.client.load("e8m0-f4", path)
    try:
        with daemon.client.attach("e8m0-f4") as model:
            if hasattr(torch, "float8_e8m0fnu") and hasattr(torch, "float4_e2m1fn_x2"):
                got = dict(model.weights_iterator())
                scale, w1 = got["engram.embed.scale"], got["experts.w1"]
                assert (scale.dtype, tuple(scale.shape)) == (torch.float8_e8m0fnu, (4, 2))
                assert (w1.dtype, tuple(w1.shape)) == (torch.float4_e2m1fn_x2, (2, 2))  # two F4 values a byte
                assert scale.view(torch.uint8).numpy().tobytes() == tensors["engram.embed.scale"][2]
                assert w1.view(torch.uint8).numpy().tobytes() == tensors["experts.w1"][2]
            else:
                with pytest.raises(weightd.UnsupportedDtypeError) as e:
                    list(model.weights_iterator())
                assert str(e.value) == ("tensor 'engram.embed.scale': safetensors dtype F8_E8M0 has no torch dtype in "
                                        f"torch {torch.__version__} (torch.float8_e8m0fnu is added in torch 2.7); "
                                        "Tensor.raw() exports its bytes")
            assert np.from_dlpack(model["engram.embed.scale"].raw()).tobytes() == tensors["engram.embed.scale"][2]
    finally:
        daemon.client.unload("e8m0-f4")


def test_model_is_a_mapping_of_dlpack_tensors(daemon, demo_small):
    info = {m.name: m for m in daemon.client.list()}["demo-small"]
    with daemon.client.attach("demo-small", rank=0) as model:
        assert (model.name, model.rank, model.fingerprint) == ("demo-small", 0, info.fingerprint)
        assert len(model) == info.tensor_count == len(list(model.items()))
        name, tensor = next(iter(model.items()))
        assert name in model and "no.such.tensor" not in model
        assert tensor.__dlpack_device__() == (1, 0)
        assert torch.from_dlpack(tensor).data_ptr() == tensor.data_ptr()
        with pytest.raises(BufferError):
            tensor.__dlpack__(copy=True)
        with pytest.raises(BufferError):
            tensor.__dlpack__(dl_device=(2, 0))
        with pytest.raises(KeyError):
            model["no.such.tensor"]


def test_weights_iterator_and_state_dict_share_the_mapping(daemon, demo_small):
    with daemon.client.attach("demo-small") as model:
        pairs = list(model.weights_iterator())
        assert [n for n, _ in pairs] == list(model)
        state = model.torch_state_dict()
        assert state.keys() == set(model)
        for name, value in pairs:
            assert isinstance(value, torch.Tensor)
            assert value.data_ptr() == state[name].data_ptr()
            nbytes = value.numel() * value.element_size()
            assert _inside(model, model.tensor_info(name), value.data_ptr(), nbytes), f"{name} was copied"


def test_lease_outlives_close_while_a_tensor_is_alive(daemon, demo_small):
    assert daemon.wait_leases("demo-small", 0) == 0
    model = daemon.client.attach("demo-small")
    name = next(iter(model))
    value = model[name].to_torch()
    expected = value.clone()
    model.close()
    assert model.closed
    with pytest.raises(ValueError, match="closed"):
        model[name]
    del model
    gc.collect()
    assert daemon.leases("demo-small") == 1
    assert {m.name: m.leases for m in daemon.client.list()}["demo-small"] == 1
    assert torch.equal(value, expected)  # still mapped
    del value
    gc.collect()
    assert daemon.wait_leases("demo-small", 0) == 0


def test_segments_are_unmapped_before_the_lease_ends(daemon, demo_small):
    # The daemon may free a generation once its last lease ends; for
    # cuda-legacy-ipc arenas that must come after the client's unmap.
    model = daemon.client.attach("demo-small")
    tensor = model[next(iter(model))]  # holds the lease and its segment
    lease = model._lease
    segments = list(lease.segments)  # extra references: closing must not wait for them
    closed_when_lease_ended = []

    class RecordingConnection:
        def __init__(self, inner):
            self.inner = inner

        def close(self):
            closed_when_lease_ended.append([s.closed for s in segments])
            self.inner.close()

    lease.connection = RecordingConnection(lease.connection)
    model.close()
    del model, lease
    gc.collect()
    assert closed_when_lease_ended == []  # the tensor still holds the lease
    del tensor
    gc.collect()
    assert closed_when_lease_ended == [[True] * len(segments)]
    assert daemon.wait_leases("demo-small", 0) == 0
    assert segments[0].address == 0
    with pytest.raises(ValueError, match="the segment is closed: its lease has ended"):
        segments[0].copy_to_host(0, 1)


def test_context_manager_releases_the_lease(daemon, demo_small):
    with daemon.client.attach("demo-small") as model:
        assert daemon.leases("demo-small") == 1
        assert len(model) > 0
    del model
    assert daemon.wait_leases("demo-small", 0) == 0


def _run_python(code, **kwargs):
    """Runs `code` in a fresh interpreter (this one, same environment), without a core dump."""
    def no_core_dump():
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, preexec_fn=no_core_dump, **kwargs)


def test_writing_a_mapped_tensor_kills_only_the_client(daemon, demo_small):
    name = "model.embed_tokens.weight"
    before = read_safetensors(demo_small)[name][2]
    child = _run_python(f"""
        import torch, weightd
        model = weightd.connect({daemon.socket!r}).attach("demo-small")
        value = model[{name!r}].to_torch()
        print("torch accepts the in-place write", flush=True)
        value.fill_(1.0)
        print("unreachable: the write went through", flush=True)
    """)
    assert child.returncode == -signal.SIGSEGV, child.stdout + child.stderr
    assert "torch accepts the in-place write" in child.stdout
    assert "unreachable" not in child.stdout
    # The daemon still serves, the bytes are intact, and the dead client's lease ended.
    assert daemon.wait_leases("demo-small", 0) == 0
    with daemon.client.attach("demo-small") as model:
        assert np.from_dlpack(model[name].raw()).tobytes() == before
    assert daemon.process.poll() is None


def test_works_when_imported_after_torch_and_grpcio(daemon, demo_small):
    child = _run_python(f"""
        import torch, grpc, weightd
        with weightd.connect({daemon.socket!r}).attach("demo-small") as model:
            state = model.torch_state_dict()
        print(len(state), sum(int(t.numel()) for t in state.values()))
    """)
    assert child.returncode == 0, child.stderr
    with daemon.client.attach("demo-small") as model:
        assert child.stdout.split() == [str(len(model)), str(sum(t.to_torch().numel() for t in model.values()))]


def test_extension_links_no_grpc_or_protobuf():
    import weightd._native as native
    linked = subprocess.run(["ldd", native.__file__], capture_output=True, text=True, check=True).stdout
    assert "grpc" not in linked and "protobuf" not in linked, linked


def test_cuda_arena_import_without_a_driver_names_the_reason():
    from weightd._native import Segment
    with pytest.raises(RuntimeError) as info:
        Segment.import_device("cuda-vmm", "GPU-00000000-0000-0000-0000-000000000000", 2 << 20, b"", -1)
    message = str(info.value)
    assert message.startswith("importing cuda-vmm arena on GPU-00000000-0000-0000-0000-000000000000: ")
    assert "libcuda.so.1 not found" in message or "no CUDA device" in message or "without the CUDA toolkit" in message


def test_default_socket_comes_from_the_environment(monkeypatch, daemon):
    monkeypatch.setenv("WEIGHTD_SOCKET", daemon.socket)
    assert weightd.connect().target == "unix://" + daemon.socket
    monkeypatch.delenv("WEIGHTD_SOCKET")
    assert weightd.connect().target == "unix:///run/weightd/weightd.sock"


def test_daemon_errors_carry_code_and_message(daemon, tmp_path):
    with pytest.raises(weightd.WeightdError) as e:
        daemon.client.attach("no-such-model")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "no-such-model" in e.value.message
    with pytest.raises(weightd.WeightdError) as e:
        daemon.client.unload("no-such-model")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    outside = tmp_path / "outside"
    outside.mkdir()
    with pytest.raises(weightd.WeightdError) as e:
        daemon.client.load("outside", outside)
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and str(outside) in e.value.message
    with pytest.raises(weightd.WeightdError) as e:
        weightd.connect(str(tmp_path / "no-daemon.sock")).list()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_refused_fd_socket_connection_raises_the_daemons_reason(tmp_path, demo_small):
    """Regression: the daemon wrote ERR and closed before reading CLAIM, so the
    client usually saw ECONNRESET or EPIPE instead of the reason."""
    d = Daemon(tmp_path, demo_small.parent, "--fd-socket-max-connections", "1")
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        d.client.load("demo-small", demo_small)
        holder.connect(str(tmp_path / "weightd.fd.sock"))  # the one connection allowed, held
        for _ in range(5):
            with pytest.raises(weightd.WeightdError) as e:
                d.client.attach("demo-small")
            assert (e.value.code, e.value.message) == (
                grpc.StatusCode.RESOURCE_EXHAUSTED, "fd socket: too many fd-socket connections (1)")
    finally:
        holder.close()
        assert d.stop() == 0, d.log.read_text()


def test_fd_channel_grammar_reads_every_message_kind():
    """The grammar of docs/api.md ("The fd channel"), as common/transport/fd_channel_codec.h parses it."""
    parse = _fdsock.parse_message
    assert parse("CLAIM 0123456789abcdef0123456789abcdef") == ("CLAIM", "0123456789abcdef0123456789abcdef")
    assert parse("OK 251") == ("OK", 251)
    assert parse("OK 1048576") == ("OK", 1048576)
    assert parse("MORE") == ("MORE", None)
    assert parse("ERR 5 unknown or expired lease id") == ("ERR", (5, "unknown or expired lease id"))
    assert parse("ERR 16") == ("ERR", (16, ""))
    assert parse("ERR 3 " + "n" * 4076 + "...[truncated]") == ("ERR", (3, "n" * 4076 + "...[truncated]"))


@pytest.mark.parametrize("payload", [
    "", "HELLO", "CLAIM", "CLAIM ", "claim x", "OK", "OK ", "OK x", "OK -1", "OK +1", "OK 1 ", "OK \u00b2",
    "OK 99999999999", "OK 1048577", "MORE ", "MORE 1", "ERR", "ERR ", "ERR abc msg", "ERR 0 ok is no error",
    "ERR 17 beyond the codes", "ERR -5 x", "ERR  5 x", "ERR 3 " + "x" * 4096])
def test_fd_channel_grammar_refuses_what_it_does_not_produce(payload):
    with pytest.raises(ValueError):
        _fdsock.parse_message(payload)


def test_fd_socket_claim_of_an_unknown_lease_raises_the_daemons_reason(daemon):
    with pytest.raises(weightd.WeightdError) as e:
        _fdsock.claim(str(daemon.root / "weightd.fd.sock"), "0123456789abcdef0123456789abcdef", 5)
    assert (e.value.code, e.value.message) == (grpc.StatusCode.NOT_FOUND, "fd socket: unknown or expired lease id")


def test_daemon_answers_a_malformed_claim_in_the_grammar(daemon):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(5)
        sock.connect(str(daemon.root / "weightd.fd.sock"))
        sock.send(b"CLAIM")
        assert _fdsock.parse_message(sock.recv(4096).decode()) == ("ERR", (3, "expected 'CLAIM <lease_id>'"))


def test_segments_say_whether_their_fd_comes_on_the_fd_socket(emulated_daemon, demo_small):
    client = emulated_daemon.client
    client.load("demo-export", demo_small, host_resident=["embed_tokens"], devices=["0"])
    segments = client.manifest("demo-export").segments
    # Host segments first, then arenas; neither mixes two of the demo's five
    # files (server/load/plan.h): the embedding's file also holds a small device tensor.
    assert [(s.placement, s.backend, s.fd_attached) for s in segments] == [
        ("host", "memfd", True)] + [("device", "emulated", True)] * 5
    client.unload("demo-export")


def test_malformed_checkpoint_is_invalid_argument(daemon):
    require_shared()
    path = REAL_CHECKPOINTS / "syoyo-safetensors-cpp" / MALFORMED_FILE
    with pytest.raises(weightd.WeightdError) as e:
        daemon.client.load("malformed", path)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and MALFORMED_FILE in e.value.message


def test_unload_drains_while_attached(daemon, demo_small):
    daemon.client.load("drain-me", demo_small)
    model = daemon.client.attach("drain-me")
    value = model[next(iter(model))].to_torch()
    result = daemon.client.unload("drain-me")
    assert (result.freed, result.model.state) == (False, "DRAINING")
    with pytest.raises(weightd.WeightdError) as e:
        daemon.client.attach("drain-me")
    assert e.value.code == grpc.StatusCode.NOT_FOUND  # draining generations take no new leases
    model.close()
    del model, value
    gc.collect()
    deadline = time.monotonic() + 10
    while any(m.name == "drain-me" for m in daemon.client.list()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(m.name == "drain-me" for m in daemon.client.list())


def _check_tp_shards(ranks, name, dtype, shape, data):
    """Rank r holds slice r of `name` (or all of it), zero-copy; the shards make up the file tensor."""
    full = torch.frombuffer(bytearray(data), dtype=weightd.torch_dtype(dtype)).reshape(shape)
    width = _BITS[full.element_size()]
    shards = []
    for model in ranks:
        info = model.tensor_info(name)
        assert info.placement == ("host" if "embed_tokens" in name else "device"), name
        assert model[name].__dlpack_device__() == (1, 0)
        value = model[name].to_torch()
        assert _inside(model, info, value.data_ptr(), info.nbytes), f"{name} was copied"
        want = full if info.split_dim < 0 else full.narrow(info.split_dim, info.split_start,
                                                           info.shape[info.split_dim])
        assert torch.equal(value.view(width), want.contiguous().view(width)), name
        shards.append(value)
    split_dim = ranks[0].tensor_info(name).split_dim
    assert split_dim == (0 if "q_proj" in name else 1 if "down_proj" in name else -1), name
    if split_dim >= 0:
        assert torch.equal(torch.cat(shards, dim=split_dim).view(width), full.view(width)), name


def test_emulated_device_backend_tp_ranks(emulated_daemon, demo_small):
    """Each TP rank of a model on the emulated device backend holds its shards of the file tensors."""
    client = emulated_daemon.client
    client.load("demo-tp", demo_small, host_resident=["embed_tokens"], tp_size=2,
                tp_rules=[("q_proj", 0), ("down_proj", 1)], devices=["0", "1"])
    ranks = [client.attach("demo-tp", rank=r) for r in (0, 1)]
    assert emulated_daemon.leases("demo-tp") == 2
    for rank, model in enumerate(ranks):
        segments = model.manifest.segments
        assert {s.gpu_uuid for s in segments if s.placement == "device"} == {f"GPU-emulated-{rank}"}
        assert {s.backend for s in segments} == {"memfd", "emulated"}
    for name, (dtype, shape, data) in read_safetensors(demo_small).items():
        _check_tp_shards(ranks, name, dtype, shape, data)
    for model in ranks:
        model.close()
    del ranks, model
    gc.collect()
    assert emulated_daemon.wait_leases("demo-tp", 0) == 0


# ------------------------------------------------------------ watch

def _take(watch, n, timeout=10):
    """The next `n` events of `watch` as (kind, generation); cancels the watch if they do not come in time."""
    timer = threading.Timer(timeout, watch.cancel)
    timer.start()
    try:
        return [(e.kind, e.generation) for _, e in zip(range(n), watch)]  # range first: no extra next()
    finally:
        timer.cancel()


def _tiny_checkpoint(path, fill):
    path.mkdir(exist_ok=True)
    write_safetensors(path / "model.safetensors", {"w": ("F32", (2, 2), bytes([fill]) * 16)})
    return path


def test_watch_sees_publish_drain_free_and_unload_in_order(daemon):
    client = daemon.client
    one = _tiny_checkpoint(daemon.models / "watch-one", 1)
    two = _tiny_checkpoint(daemon.models / "watch-two", 2)
    with client.watch("watch-py") as watch:  # not loaded yet
        first = client.load("watch-py", one).model.generation
        model = client.attach("watch-py")
        second = client.load("watch-py", two).model.generation
        assert _take(watch, 3) == [("PUBLISHED", first), ("PUBLISHED", second), ("DRAINING", first)]
        model.close()
        del model
        gc.collect()
        assert _take(watch, 1) == [("FREED", first)]
        client.unload("watch-py")
        assert _take(watch, 2) == [("UNLOADED", second), ("FREED", second)]


def test_watch_of_a_loaded_name_starts_with_current(daemon):
    client = daemon.client
    loaded = client.load("watch-current", _tiny_checkpoint(daemon.models / "watch-one", 1)).model
    before = time.time()
    with client.watch("watch-current") as watch:
        event = next(watch)
    assert event == weightd.WatchEvent("CURRENT", "watch-current", loaded.generation, "", loaded.fingerprint,
                                       event.time)
    assert before - 3600 < event.time <= time.time()
    info = next(m for m in client.list() if m.name == "watch-current")
    assert (info.version_label, client.manifest("watch-current").version_label) == ("", "")
    with client.attach("watch-current") as model:
        assert model.version_label == ""
    client.unload("watch-current")


def test_watch_cancelled_from_another_thread_ends_the_iteration(daemon):
    watch = daemon.client.watch("watch-nothing-happens")
    threading.Timer(0.2, watch.cancel).start()
    start = time.monotonic()
    assert list(watch) == []
    assert time.monotonic() - start < 5


def test_watch_refuses_a_bad_name(daemon):
    with pytest.raises(weightd.WeightdError) as e:
        daemon.client.watch("a/b")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "'a/b'" in e.value.message


def test_watch_ends_with_unavailable_when_the_daemon_stops(tmp_path):
    (tmp_path / "models").mkdir()
    d = Daemon(tmp_path, tmp_path / "models", "--max-watchers", "1")
    client = weightd.connect(d.socket)  # d.stop() closes d.client's channel first
    try:
        watch = client.watch("m")
        with pytest.raises(weightd.WeightdError) as e:
            client.watch("m")
        assert (e.value.code, e.value.message) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED, "1 watch streams are open, as many as --max-watchers (1) allows")
    finally:
        assert d.stop() == 0, d.log.read_text()
    with pytest.raises(weightd.WeightdError) as e:
        next(watch)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_load_with_an_unreachable_peer_falls_back_to_storage(daemon, demo_small):
    # A copy of the files: over demo_small's own files the load would share
    # demo-small's segments and ask no peer (docs/devices.md "One copy across
    # names and plans").
    copy = daemon.models / "demo-small-copy"
    subprocess.run([daemon.weightctl, "make-demo", str(copy), "--preset", "small"], check=True, capture_output=True)
    result = daemon.client.load("demo-peerless", copy, peers=["127.0.0.1:1"])
    try:
        assert result.model.state == "READY"
        assert result.model.source == "storage"
        listed = {m.name: m for m in daemon.client.list()}
        assert listed["demo-peerless"].source == "storage"
        assert listed["demo-peerless"].fingerprint == listed["demo-small"].fingerprint
    finally:
        daemon.client.unload("demo-peerless")
    assert "peer 127.0.0.1:1 did not seed 'demo-peerless' (unavailable)" in daemon.log.read_text()


def test_a_relative_socket_path_is_a_path_not_a_host_name(daemon, monkeypatch):
    # "DIR/weightd.sock" and "weightd.sock" (no ':') name the daemon's socket
    # from the directory they are relative to; before, both were dialled as
    # DNS names.
    sock = pathlib.Path(daemon.socket)
    monkeypatch.chdir(sock.parent.parent)
    assert weightd.connect(f"{sock.parent.name}/{sock.name}").list() == daemon.client.list()
    monkeypatch.chdir(sock.parent)
    assert weightd.connect(sock.name).list() == daemon.client.list()
    assert weightd._client._target("node-a:7400") == "node-a:7400"
    assert weightd._client._target("unix:///run/w.sock") == "unix:///run/w.sock"
    assert weightd._client._target("/run/w.sock") == "unix:///run/w.sock"
    assert weightd._client._target("d1/w.sock") == "unix://" + str(sock.parent / "d1/w.sock")
    client = weightd.connect(sock.name)
    monkeypatch.chdir("/")  # resolved once, at connect
    assert client.list() == daemon.client.list()


def test_a_subset_load_holds_exactly_the_chosen_tensors_and_shares_their_segments(daemon, demo_small):
    full = {t.name: t for t in daemon.client.manifest("demo-small").tensors}
    result = daemon.client.load("demo-draft", demo_small, include=["model.layers."], exclude=["mlp."])
    try:
        chosen = {n for n in full if "model.layers." in n and "mlp." not in n}
        assert {t.name for t in daemon.client.manifest("demo-draft").tensors} == chosen
        assert result.model.tensor_count == len(chosen)
        assert chosen and len(chosen) < len(full)
        # Another subset of the same host segments' tensors lays them out
        # anew, so it is read, not shared (server/load/shared_segments.h).
        assert result.bytes_read == sum(full[n].nbytes for n in chosen)
    finally:
        daemon.client.unload("demo-draft")
    with pytest.raises(weightd.WeightdError) as e:
        daemon.client.load("demo-none", demo_small, include=["no-such-tensor"])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "the subset selects none of the" in e.value.message
    assert "(include 'no-such-tensor'; exclude none)" in e.value.message
    with pytest.raises(weightd.WeightdError) as e:
        daemon.client.load("demo-none", demo_small, exclude=[""])
    assert (e.value.code, e.value.message) == (grpc.StatusCode.INVALID_ARGUMENT, "--exclude pattern 1 is empty")
    # The same plan under another name shares every segment: nothing read.
    twin = daemon.client.load("demo-twin", demo_small)
    try:
        assert twin.bytes_read == 0
        assert twin.model.fingerprint == daemon.client.manifest("demo-small").fingerprint
    finally:
        daemon.client.unload("demo-twin")


def test_numa_copies_give_each_node_its_copy_and_a_named_node_must_have_one(daemon, demo_small):
    # This machine has one NUMA node: one copy, bound to it (the two-node
    # cases run on a stand-in topology in tests/server/load/numa_copies_test.cc).
    nodes = sorted(int(p.name[4:]) for p in pathlib.Path("/sys/devices/system/node").glob("node[0-9]*"))
    if not nodes:
        pytest.skip("this kernel has no NUMA support (/sys/devices/system/node)")
    result = daemon.client.load("demo-numa", demo_small, numa_copies=True)
    try:
        listed = {m.name: m for m in daemon.client.list()}
        assert listed["demo-numa"].numa_nodes == tuple(nodes)
        assert listed["demo-small"].numa_nodes == ()
        with daemon.client.attach("demo-numa") as m:
            assert m.numa_node == nodes[0]
            assert m.fingerprint == result.model.fingerprint
        with daemon.client.attach("demo-small") as m:
            assert m.numa_node == -1
        with pytest.raises(weightd.WeightdError) as e:
            daemon.client.attach("demo-numa", numa_node=nodes[-1] + 1)
        assert (e.value.code, e.value.message) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            f"no NUMA copy on node {nodes[-1] + 1}; the model has copies on nodes "
            + ", ".join(str(n) for n in nodes))
        out = subprocess.run([daemon.weightctl, "--socket", daemon.socket, "attach", "demo-numa"],
                             capture_output=True, text=True, check=True).stdout
        assert f", NUMA node {nodes[0]}'s copy (fingerprint" in out
    finally:
        daemon.client.unload("demo-numa")


def test_one_string_is_a_list_of_one_not_its_characters(daemon, demo_small):
    full = {t.name for t in daemon.client.manifest("demo-small").tensors}
    result = daemon.client.load("demo-one", demo_small, include="model.norm.weight")
    try:
        assert {t.name for t in daemon.client.manifest("demo-one").tensors} == {"model.norm.weight"} & full
        assert result.model.tensor_count == 1
    finally:
        daemon.client.unload("demo-one")
