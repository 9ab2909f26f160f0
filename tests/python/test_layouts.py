"""Runtime layouts from Python (docs/integration.md "Runtime layouts"):
Client.publish_layout, attach(layout=, identity=), LayoutNotFound and
LayoutMismatch, aborts, a killed writer, wait=True, sealing after commit,
and device layouts of TP ranks on the emulated backend."""
import gc
import mmap
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import numpy as np
import pytest
import torch

import weightd
from conftest import read_safetensors, write_safetensors

IDENTITY = {"engine": "testengine 1.0", "layout_abi": "3", "quant": "int8"}


def _tensor_bytes(values):
    return np.ascontiguousarray(values).tobytes()


@pytest.fixture(scope="module")
def base(daemon):
    """A small model of its own, so that its layouts meet no other test: (name, generation, {name: ndarray})."""
    folder = daemon.models / "layout-base"
    folder.mkdir(exist_ok=True)
    q = np.arange(64, dtype=np.float32).reshape(8, 8)
    k = -np.arange(64, dtype=np.float32).reshape(8, 8)
    write_safetensors(folder / "model.safetensors", {"q": ("F32", (8, 8), q.tobytes()),
                                                     "k": ("F32", (8, 8), k.tobytes())})
    generation = daemon.client.load("layout-base", folder).model.generation
    return "layout-base", generation, {"q": q, "k": k}


def _layouts(client, name):
    return [(l.key, l.rank) for m in client.list() if m.name == name for l in m.layouts]


def _daemon_fds(daemon):
    return sorted(os.listdir(f"/proc/{daemon.process.pid}/fd"), key=int)


def _layout_memfds(daemon):
    """The daemon's fds on layout memfds: staged ones, and the sealed ones it serves published host tensors from."""
    links = []
    for fd in _daemon_fds(daemon):
        try:
            links.append(os.readlink(f"/proc/{daemon.process.pid}/fd/{fd}"))
        except OSError:
            pass  # closed meanwhile
    return [link for link in links if "layout-" in link]


def _until(predicate, timeout=10):
    """Polls `predicate` (the daemon notices a closed fd socket asynchronously); its last value."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_published_layout_attaches_with_its_strides_and_identity(daemon, base):
    client, (name, generation, values) = daemon.client, base
    fused = np.concatenate([values["q"], values["k"]])  # (16, 8)
    transposed = torch.from_numpy(fused).t()  # (8, 16), strides (1, 8)
    scale = np.linspace(0.5, 2.0, 16, dtype=np.float32)
    with client.publish_layout(name, "test/roundtrip", {"qk": (torch.float32, (8, 16), (1, 8)), "scale": ("F32", (16,)),
                                                        "int8": ("I8", (3, 5))}, identity=IDENTITY) as w:
        assert w.tensors == ["qk", "scale", "int8"] and not w.published_by_other
        assert w["qk"].stride() == (1, 8)
        w["qk"].copy_(transposed)
        w["scale"].copy_(torch.from_numpy(scale))
        w["int8"].copy_(torch.arange(-7, 8, dtype=torch.int8).view(3, 5))
    info = w.result
    assert (info.key, info.rank, info.identity, info.generation, info.tensor_count) == (
        "test/roundtrip", 0, IDENTITY, generation, 3)
    assert len(info.fingerprint) == 32
    assert _layouts(client, name) == [("test/roundtrip", 0)]
    with client.attach(name, layout="test/roundtrip", identity=IDENTITY) as model:
        assert (model.layout, model.identity, model.generation) == ("test/roundtrip", IDENTITY, generation)
        assert sorted(model) == ["int8", "qk", "scale"]
        qk = model["qk"].to_torch()
        assert (qk.shape, qk.stride(), qk.dtype) == ((8, 16), (1, 8), torch.float32)
        assert torch.equal(qk, transposed)
        assert model.owns(qk.data_ptr())
        assert model.tensor_info("qk").strides == (1, 8)
        assert model.tensor_info("scale").strides == ()
        assert np.array_equal(model["scale"].to_torch().numpy(), scale)
        assert model["int8"].to_torch().tolist() == torch.arange(-7, 8, dtype=torch.int8).view(3, 5).tolist()
        assert len(model.tensor_info("qk").content_hash) == 16
    # identity=None does not check it
    with client.attach(name, layout="test/roundtrip") as model:
        assert model.identity == IDENTITY


def test_missing_key_raises_layout_not_found_naming_the_keys_there(daemon, base):
    client, (name, generation, _) = daemon.client, base
    with client.publish_layout(name, "test/present", {"x": ("F32", (2,))}, identity=IDENTITY):
        pass
    with pytest.raises(weightd.LayoutNotFound) as e:
        client.attach(name, layout="test/absent")
    assert isinstance(e.value, weightd.WeightdError)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    published = sorted(k for k, r in _layouts(client, name) if r == 0)
    assert e.value.message == (f"model {name!r} generation {generation} has no layout 'test/absent' for rank 0; "
                               f"published for this generation and rank: " + ", ".join(map(repr, published)))
    # A missing model stays a plain NOT_FOUND, not a missing layout.
    with pytest.raises(weightd.WeightdError) as e:
        client.attach("no-such-model", layout="test/present")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and not isinstance(e.value, weightd.LayoutNotFound)


def test_identity_mismatch_raises_layout_mismatch_naming_every_field(daemon, base):
    client, (name, generation, _) = daemon.client, base
    with client.publish_layout(name, "test/identity", {"x": ("F32", (2,))}, identity=IDENTITY):
        pass
    asked = {"engine": "testengine 1.1", "quant": "int8", "arch": "sm90"}
    with pytest.raises(weightd.LayoutMismatch) as e:
        client.attach(name, layout="test/identity", identity=asked)
    assert isinstance(e.value, weightd.WeightdError)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert e.value.message == (
        f"layout 'test/identity' of rank 0 of model {name!r} generation {generation} was published with another "
        f"identity: arch is 'sm90' here but missing from the published layout; engine is 'testengine 1.1' here but "
        f"'testengine 1.0' in the published layout; layout_abi is missing here ('3' in the published layout)")


def test_an_exception_in_the_block_aborts_and_publishes_nothing(daemon, base):
    client, (name, _, _) = daemon.client, base
    before = len(_layout_memfds(daemon))
    with pytest.raises(RuntimeError, match="post-processing failed"):
        with client.publish_layout(name, "test/aborted", {"x": ("F32", (4,))}) as w:
            w["x"].fill_(1.0)
            raise RuntimeError("post-processing failed")
    assert w.closed and w.result is None
    assert ("test/aborted", 0) not in _layouts(client, name)
    with pytest.raises(weightd.LayoutNotFound):
        client.attach(name, layout="test/aborted")
    assert _until(lambda: len(_layout_memfds(daemon)) == before)
    # The slot is free again: another writer publishes the key.
    with client.publish_layout(name, "test/aborted", {"x": ("F32", (4,))}) as w:
        w["x"].fill_(2.0)
    with client.attach(name, layout="test/aborted") as model:
        assert model["x"].to_torch().tolist() == [2.0] * 4


def test_commit_refuses_while_a_tensor_is_kept_and_the_publish_stays_open(daemon, base):
    client, (name, _, _) = daemon.client, base
    w = client.publish_layout(name, "test/kept", {"x": ("F32", (4,))})
    kept = w["x"]
    kept.fill_(3.0)
    with pytest.raises(weightd.WeightdError) as e:
        w.commit()
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "still mapped by tensors or buffers taken from the writer (among 'x')" in e.value.message
    assert not w.closed
    del kept
    assert w.commit().tensor_count == 1


def test_after_commit_the_writers_kept_fds_cannot_change_the_served_bytes(daemon, base):
    client, (name, _, _) = daemon.client, base
    w = client.publish_layout(name, "test/sealed", {"x": ("I32", (1024,))})
    w["x"].copy_(torch.arange(1024, dtype=torch.int32))
    kept = [os.dup(fd) for fd in w._fds]
    try:
        # A writable mapping of a kept fd makes the daemon refuse to seal: the publish stays open.
        other = mmap.mmap(kept[0], 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(weightd.WeightdError) as e:
            w.commit()
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "still mapped writable" in e.value.message
        assert not w.closed
        other.close()
        w.commit()
        assert w.closed and w._fds == []
        for fd in kept:
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"\xff" * 16, 0)
            with pytest.raises(PermissionError):
                mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            private = mmap.mmap(fd, 4096, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
            private[:16] = b"\xff" * 16  # copy-on-write: this process's page only
            private.close()
    finally:
        for fd in kept:
            os.close(fd)
    with client.attach(name, layout="test/sealed") as model:
        assert model["x"].to_torch().tolist() == list(range(1024))


def test_a_writer_killed_mid_publish_leaves_nothing_published_or_open(daemon, base):
    client, (name, _, _) = daemon.client, base
    gc.collect()
    before, memfds = len(_daemon_fds(daemon)), len(_layout_memfds(daemon))
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time, weightd
        w = weightd.connect({daemon.socket!r}).publish_layout({name!r}, "test/killed", {{"x": ("F32", (1 << 20,))}})
        w["x"].fill_(7.0)
        print("written", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "written\n", writer.stderr.read()
        assert len(_layout_memfds(daemon)) == memfds + 1
        with pytest.raises(weightd.WeightdError) as e:
            client.publish_layout(name, "test/killed", {"x": ("F32", (4,))})
        assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
        writer.stdout.close()
        writer.stderr.close()
    assert writer.returncode == -signal.SIGKILL
    assert _until(lambda: len(_daemon_fds(daemon)) == before), (before, _daemon_fds(daemon))
    assert len(_layout_memfds(daemon)) == memfds
    assert ("test/killed", 0) not in _layouts(client, name)
    with pytest.raises(weightd.LayoutNotFound):
        client.attach(name, layout="test/killed")
    with client.publish_layout(name, "test/killed", {"x": ("F32", (4,))}) as w:  # the slot is free
        w["x"].fill_(1.0)


_RACER = """
import sys, weightd
client = weightd.connect(sys.argv[1])
client.list()
print("ready", flush=True)
sys.stdin.readline()
with client.publish_layout(sys.argv[2], "test/together", {"x": ("I64", (4,))}, wait=True) as w:
    if w.published_by_other:
        print("published_by_other", flush=True)
    else:
        print("writing", flush=True)
        w["x"].fill_(int(sys.argv[3]))
        sys.stdin.readline()  # the test lets it commit once the other one is waiting or done
if not w.published_by_other:
    print("committed", flush=True)
with client.attach(sys.argv[2], layout="test/together") as model:
    print(model["x"].to_torch().tolist()[0], flush=True)
"""


def test_wait_with_two_writers_started_together_does_the_work_once(daemon, base):
    client, (name, _, _) = daemon.client, base
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, daemon.socket, name, str(i + 1)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for i in range(2)]
    try:
        for r in racers:
            assert r.stdout.readline() == "ready\n", r.stderr.read()
        for r in racers:
            r.stdin.write("go\n")
            r.stdin.flush()
        # Exactly one is granted the publish and says so; the other is waiting
        # in BeginLayout (or not there yet) and says nothing before the commit.
        readable, _, _ = select.select([r.stdout for r in racers], [], [], 60)
        assert len(readable) >= 1
        winner = next(r for r in racers if r.stdout is readable[0])
        loser = racers[1 - racers.index(winner)]
        assert winner.stdout.readline() == "writing\n", winner.stderr.read()
        winner.stdin.write("commit\n")
        winner.stdin.flush()
        assert winner.stdout.readline() == "committed\n"
        assert loser.stdout.readline() == "published_by_other\n", loser.stderr.read()
        value = str(racers.index(winner) + 1) + "\n"
        assert winner.stdout.readline() == value
        assert loser.stdout.readline() == value
        for r in racers:
            _, err = r.communicate(timeout=60)
            assert r.returncode == 0, err
    finally:
        for r in racers:
            if r.poll() is None:
                r.kill()
                r.wait()


def test_watch_reports_layout_published_and_its_draining_on_reload(daemon):
    client, name, folder = daemon.client, "layout-watch", daemon.models / "layout-watch"
    folder.mkdir(exist_ok=True)
    write_safetensors(folder / "model.safetensors", {"q": ("F32", (2,), np.float32([1, 2]).tobytes())})
    first = client.load(name, folder).model.generation
    with client.watch(name) as watch:
        events = iter(watch)
        assert next(events).kind == weightd.WatchEventKind.CURRENT
        for key in ("test/watched-a", "test/watched-b"):
            with client.publish_layout(name, key, {"x": ("F32", (2,))}):
                pass
            published = next(events)
            assert (published.kind, published.layout, published.rank, published.generation) == (
                weightd.WatchEventKind.LAYOUT_PUBLISHED, key, 0, first)
        # A changed checkpoint: the reload publishes the next generation and the old one's layouts drain.
        write_safetensors(folder / "model.safetensors", {"q": ("F32", (2,), np.float32([3, 4]).tobytes())})
        reloaded = client.reload(name).model.generation
        assert reloaded == first + 1
        seen = []
        while not seen or seen[-1][0] != weightd.WatchEventKind.FREED:  # no lease: freed without DRAINING
            event = next(events)
            seen.append((event.kind, event.generation, event.layout))
    assert seen == [(weightd.WatchEventKind.PUBLISHED, reloaded, ""),
                    (weightd.WatchEventKind.LAYOUT_DRAINING, first, "test/watched-a"),
                    (weightd.WatchEventKind.LAYOUT_DRAINING, first, "test/watched-b"),
                    (weightd.WatchEventKind.FREED, first, "")]
    assert _layouts(client, name) == []  # the new generation has none: engines publish again
    with pytest.raises(weightd.LayoutNotFound):
        client.attach(name, layout="test/watched-a")


def test_tp2_ranks_publish_device_shards_on_their_gpus_and_others_read_them(emulated_daemon, demo_small):
    """Each rank's process publishes its shard of a fused q/k tensor on its
    (emulated) GPU; a second process per rank attaches it and reads the exact bytes."""
    client = emulated_daemon.client
    client.load("layout-tp", demo_small, host_resident=["embed_tokens"], tp_size=2,
                tp_rules=[("q_proj", 0), ("k_proj", 0)], devices=["0", "1"])
    files = read_safetensors(demo_small)
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    publisher = textwrap.dedent("""
        import sys, torch, weightd
        client, rank = weightd.connect(sys.argv[1]), int(sys.argv[2])
        with client.attach("layout-tp", rank=rank) as shards:
            uuid = {s.gpu_uuid for s in shards.manifest.segments if s.placement == "device"}.pop()
            fused = torch.cat([shards[sys.argv[3]].to_torch(), shards[sys.argv[4]].to_torch()])
            with client.publish_layout("layout-tp", "test/qk-fused/tp2", {"qk": (fused.dtype, tuple(fused.shape))},
                                       rank=rank, device=uuid, identity={"tp": "2"}) as w:
                w["qk"].copy_(fused)
        print(uuid, w.result.device_bytes[uuid], w.result.host_bytes, flush=True)
    """)
    reader = textwrap.dedent("""
        import sys, weightd
        with weightd.connect(sys.argv[1]).attach("layout-tp", rank=int(sys.argv[2]), layout="test/qk-fused/tp2",
                                                 identity={"tp": "2"}) as model:
            t = model["qk"]
            segment = model.manifest.segments[t.info.segment]
            print(t.info.placement, segment.placement, segment.gpu_uuid, t.dtype, list(t.shape), flush=True)
            sys.stdout.buffer.write(model["qk"].to_torch().view(-1).view(__import__("torch").int16).numpy().tobytes())
    """)
    for rank in (0, 1):
        out = subprocess.run([sys.executable, "-c", publisher, emulated_daemon.socket, str(rank), q, k],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        uuid, device_bytes, host_bytes = out.stdout.split()
        rows_q, rows_k = files[q][1][0] // 2, files[k][1][0] // 2
        hidden = files[q][1][1]
        assert (uuid, int(device_bytes), int(host_bytes)) == (f"GPU-emulated-{rank}", (rows_q + rows_k) * hidden * 2, 0)
        out = subprocess.run([sys.executable, "-c", reader, emulated_daemon.socket, str(rank)], capture_output=True)
        assert out.returncode == 0, out.stderr.decode()
        head, data = out.stdout.split(b"\n", 1)
        assert head.decode().split(" ", 3)[:3] == ["device", "device", f"GPU-emulated-{rank}"]
        assert head.decode().endswith(f"BF16 [{rows_q + rows_k}, {hidden}]")
        row_q, row_k = len(files[q][2]) // files[q][1][0], len(files[k][2]) // files[k][1][0]
        expected = (bytes(files[q][2][rank * rows_q * row_q:(rank + 1) * rows_q * row_q])
                    + bytes(files[k][2][rank * rows_k * row_k:(rank + 1) * rows_k * row_k]))
        assert data == expected
    infos = [m for m in client.list() if m.name == "layout-tp"][0].layouts
    assert sorted((l.key, l.rank, tuple(l.device_bytes)) for l in infos) == [
        ("test/qk-fused/tp2", 0, ("GPU-emulated-0",)), ("test/qk-fused/tp2", 1, ("GPU-emulated-1",))]


def test_publish_layout_checks_its_tensor_specs_before_any_rpc(daemon, base):
    client, (name, _, _) = daemon.client, base
    with pytest.raises(ValueError, match=r"layout tensor 'x': expected \(dtype, shape\) or \(dtype, shape, strides\)"):
        client.publish_layout(name, "test/bad", {"x": "F32"})
    with pytest.raises(ValueError, match="torch dtype torch.complex128 has no safetensors dtype"):
        client.publish_layout(name, "test/bad", {"x": (torch.complex128, (2,))})
    with pytest.raises(ValueError, match="needs layout="):
        client.attach(name, identity=IDENTITY)


class _Post(torch.nn.Module):
    """A post-processed module: a transposed int8 matrix (a strided view), a
    slice with gaps, a tied pair, a persistent and a non-persistent buffer."""

    def __init__(self, device=None):
        super().__init__()
        meta = device == "meta"
        base = torch.arange(-12, 12, dtype=torch.int8).view(4, 6)
        self.qt = torch.nn.Parameter(torch.empty((6, 4), dtype=torch.int8, device="meta") if meta else base.t(),
                                     requires_grad=False)
        wide = torch.arange(40, dtype=torch.float32).view(4, 10)
        self.sliced = torch.nn.Parameter(torch.empty((4, 5), device="meta") if meta else wide[:, ::2])
        self.inner = torch.nn.Linear(3, 2, bias=False, device=device)
        self.tied = self.inner.weight
        self.register_buffer("scale", torch.empty(2, device="meta") if meta else torch.tensor([0.5, 2.0]))
        self.register_buffer("position_ids", torch.arange(3), persistent=False)


def test_publish_module_then_load_into_a_meta_module_shares_every_parameter(daemon, base):
    client, (name, _, _) = daemon.client, base
    torch.manual_seed(0)
    source = _Post()
    info = weightd.torch.publish_module(client, name, "test/module", source, identity=IDENTITY)
    assert info.tensor_count == 4  # qt, sliced, tied (= inner.weight, once, by its first name), scale; not position_ids
    with client.attach(name, layout="test/module", identity=IDENTITY) as layout:
        assert sorted(layout) == ["qt", "scale", "sliced", "tied"]
        assert layout.tensor_info("qt").strides == (1, 6)  # a dense transposed view keeps its strides
        assert layout.tensor_info("sliced").strides == ()  # one with gaps is published contiguous
        target = _Post(device="meta")
        weightd.torch.load_into(target, layout)
        mappings = layout.mappings
    assert target.tied is target.inner.weight  # the tie is kept
    assert target.qt.stride() == (1, 6) and target.qt.dtype == torch.int8
    expected = source.state_dict()
    for n, tensor in target.state_dict().items():
        assert torch.equal(tensor, expected[n]), n
        assert any(b <= tensor.data_ptr() < b + size for b, size in mappings), n  # held by the tensors' lease
    assert torch.equal(target.position_ids, torch.arange(3))  # non-persistent: the module's own
