"""The Python writer path (Client.update, weightd.Update) against a real daemon.

Each test loads the demo-small checkpoint under a name of its own, so the
"demo-small" model other tests compare with its files is never written.
"""
import itertools
import mmap
import os
import signal
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
from conftest import read_safetensors, write_safetensors

Q = "model.layers.0.self_attn.q_proj.weight"  # BF16 [1024, 1024]
K = "model.layers.0.self_attn.k_proj.weight"  # BF16 [512, 1024], same segment as Q
V = "model.layers.0.self_attn.v_proj.weight"  # BF16 [512, 1024]
EMBED = "model.embed_tokens.weight"  # BF16 [32000, 1024], another segment

_names = itertools.count()


@pytest.fixture
def served(daemon, demo_small):
    """demo-small loaded under a fresh name; (name, its first generation's ModelInfo)."""
    name = f"update-{next(_names)}"
    info = daemon.client.load(name, demo_small).model
    yield name, info
    daemon.client.unload(name, force=True)


def _bytes(tensor):
    return np.from_dlpack(tensor.raw()).tobytes()


def _bf16_bytes(value, shape):
    return torch.full(shape, value, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()


def _generations(client, name):
    return sorted((m.generation, m.state, m.version_label) for m in client.list() if m.name == name)


def _staged_memfds(daemon, name):
    """The daemon's open fds on the memfds it staged for an update of `name` (named weightd:NAME:updateI)."""
    fd_dir = f"/proc/{daemon.process.pid}/fd"
    links = []
    for fd in os.listdir(fd_dir):
        try:
            links.append(os.readlink(os.path.join(fd_dir, fd)))
        except OSError:
            pass  # closed meanwhile
    return sorted(link for link in links if link.startswith(f"/memfd:weightd:{name}:update"))


def _wait(predicate, timeout=5):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_commit_publishes_exactly_the_written_tensors(daemon, demo_small, served):
    client, (name, first) = daemon.client, served
    files = read_safetensors(demo_small)
    before = client.manifest(name)
    reader = client.attach(name)  # holds generation 1 through the commit
    new_q = _bf16_bytes(0.5, (1024, 1024))
    new_embed = bytes(range(256)) * (len(files[EMBED][2]) // 256)

    up = client.update(name, tensors=[Q, EMBED])
    assert (up.model, up.tensors, up.base_generation, up.closed) == (name, [Q, EMBED], first.generation, False)
    staged = before.segments[0].size + before.segments[1].size  # EMBED's and Q's segments, copied
    assert (up.bytes_staged, up.bytes_shared) == (staged, sum(s.size for s in before.segments) - staged)
    q = up[Q]
    assert (q.dtype, tuple(q.shape), q.is_contiguous()) == (torch.bfloat16, (1024, 1024), True)
    assert q.view(torch.int16).numpy().tobytes() == files[Q][2]  # staged with the current values
    q.copy_(torch.full((1024, 1024), 0.5, dtype=torch.bfloat16))
    embed = up.buffer(EMBED)
    assert (embed.format, embed.nbytes, embed.readonly) == ("B", len(new_embed), False)
    embed[:] = new_embed
    del q, embed
    assert _bytes(client.attach(name)[Q]) == files[Q][2]  # nothing published before the commit

    result = up.commit(version_label="step-1")
    assert isinstance(result, weightd.CommitResult)
    assert (result.model.name, result.model.generation, result.model.state, result.model.version_label) == (
        name, first.generation + 1, "READY", "step-1")
    assert (result.tensors_changed, result.bytes_written, result.bytes_shared) == (
        2, up.bytes_staged, up.bytes_shared)
    assert result.seconds > 0
    assert up.closed and up._connection.fileno() == -1  # the fd-socket connection is closed

    with client.attach(name) as model:
        assert (model.generation, model.version_label) == (first.generation + 1, "step-1")
        expected = {n: data for n, (_, _, data) in files.items()}
        expected.update({Q: new_q, EMBED: new_embed})
        assert {n: _bytes(model[n]) for n in model} == expected
        after = model.manifest
    changed = {t.name for t, old in zip(after.tensors, before.tensors) if t.content_hash != old.content_hash}
    assert changed == {Q, EMBED}
    assert after.fingerprint == result.model.fingerprint != before.fingerprint
    # The reader of generation 1 still sees generation 1's bytes.
    assert (reader.generation, _bytes(reader[Q]), _bytes(reader[EMBED])) == (
        first.generation, files[Q][2], files[EMBED][2])
    assert _generations(client, name) == [(first.generation, "DRAINING", ""),
                                          (first.generation + 1, "READY", "step-1")]
    assert client.manifest(name).version_label == "step-1"
    reader.close()
    del reader
    assert _wait(lambda: _generations(client, name) == [(first.generation + 1, "READY", "step-1")])


def test_with_block_commits_on_a_clean_exit(daemon, served):
    client, (name, first) = daemon.client, served
    with client.update(name, tensors=[Q], version_label="step-2") as up:
        up[Q].fill_(2.0)
    assert up.closed
    assert _generations(client, name) == [(first.generation + 1, "READY", "step-2")]
    with client.attach(name) as model:
        assert _bytes(model[Q]) == _bf16_bytes(2.0, (1024, 1024))


def test_update_of_every_tensor_with_nothing_written_changes_nothing(daemon, served):
    client, (name, first) = daemon.client, served
    before = client.manifest(name)
    with client.update(name) as up:
        assert up.tensors == [t.name for t in before.tensors]
        assert (up.bytes_staged, up.bytes_shared) == (sum(s.size for s in before.segments), 0)
        result = up.commit()
    assert (result.model.generation, result.tensors_changed, result.model.version_label) == (
        first.generation + 1, 0, "")
    assert result.model.fingerprint == before.fingerprint


class _TrainerFailed(Exception):
    pass


def test_exception_in_the_with_block_aborts_and_is_reraised(daemon, demo_small, served):
    client, (name, first) = daemon.client, served
    with pytest.raises(_TrainerFailed, match="^step 3 diverged$"):
        with client.update(name, tensors=[Q], version_label="step-3") as up:
            up[Q].fill_(3.0)
            raise _TrainerFailed("step 3 diverged")
    assert up.closed
    assert _generations(client, name) == [(first.generation, "READY", "")]
    assert _wait(lambda: _staged_memfds(daemon, name) == [])
    with client.attach(name) as model:
        assert _bytes(model[Q]) == read_safetensors(demo_small)[Q][2]
    client.update(name, tensors=[Q]).abort()  # the name takes a new writer at once


def test_explicit_abort_leaves_the_generation_and_ends_the_update(daemon, served):
    client, (name, first) = daemon.client, served
    up = client.update(name, tensors=[Q])
    assert len(_staged_memfds(daemon, name)) == 1
    up[Q].fill_(4.0)
    up.abort()
    up.abort()  # idempotent
    assert up.closed and up._connection.fileno() == -1
    assert _staged_memfds(daemon, name) == []
    assert _generations(client, name) == [(first.generation, "READY", "")]
    with pytest.raises(weightd.WeightdError) as e:
        up.commit()
    assert (e.value.code, e.value.message) == (
        grpc.StatusCode.FAILED_PRECONDITION, f"the update of {name!r} was already committed or aborted")


def test_commit_refused_while_a_tensor_is_referenced_then_retried(daemon, served):
    client, (name, first) = daemon.client, served
    up = client.update(name, tensors=[Q, K])
    q = up[Q]
    q.fill_(5.0)
    row = q[0]  # a view keeps the mapping too
    del q
    with pytest.raises(weightd.WeightdError) as e:
        up.commit(version_label="step-5")
    assert (e.value.code, e.value.message) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"cannot commit the update of {name!r}: 1 staged segment(s) are still mapped by tensors or buffers taken "
        f"from it (among {Q!r}); drop every reference to them (del the tensors, release the memoryviews) and call "
        f"commit() again. Nothing was sent to the daemon; the update is still open")
    assert not up.closed
    assert _generations(client, name) == [(first.generation, "READY", "")]
    del row
    up[K].fill_(6.0)  # the segment is mapped again on use
    result = up.commit(version_label="step-5")
    assert (result.model.generation, result.tensors_changed) == (first.generation + 1, 2)
    with client.attach(name) as model:
        assert (_bytes(model[Q]), _bytes(model[K])) == (_bf16_bytes(5.0, (1024, 1024)), _bf16_bytes(6.0, (512, 1024)))


def test_expected_hash_mismatch_names_the_tensor_and_aborts(daemon, demo_small, served):
    client, (name, first) = daemon.client, served
    files = read_safetensors(demo_small)
    hashes = {t.name: t.content_hash for t in client.manifest(name).tensors}
    up = client.update(name, tensors=[K])
    up.buffer(K)[:] = files[V][2]  # K now holds V's bytes, so its hash is V's
    with pytest.raises(weightd.WeightdError) as e:
        up.commit(expected_hashes={K: "0123456789abcdef"}, version_label="step-6")
    assert (e.value.code, e.value.message) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"tensor {K!r} has content hash {hashes[V]} but the writer expected 0123456789abcdef; the update is aborted")
    assert up.closed
    assert _generations(client, name) == [(first.generation, "READY", "")]
    assert _staged_memfds(daemon, name) == []
    with client.attach(name) as model:
        assert _bytes(model[K]) == files[K][2]
    # The right hash commits.
    with client.update(name, tensors=[K]) as up:
        up.buffer(K)[:] = files[V][2]
        result = up.commit(expected_hashes={K: hashes[V]})
    assert result.model.generation == first.generation + 1
    assert {t.name: t.content_hash for t in client.manifest(name).tensors}[K] == hashes[V]


def test_segment_mapped_writable_elsewhere_leaves_the_update_open(daemon, served):
    client, (name, first) = daemon.client, served
    with client.update(name, tensors=[Q]) as up:
        up[Q].fill_(11.0)
        # As if another process mapped the staged memfd writable (the
        # daemon can only tell that some process does).
        elsewhere = mmap.mmap(up._fds[0], 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(weightd.WeightdError) as e:
            up.commit()
        assert (e.value.code, e.value.message) == (
            grpc.StatusCode.FAILED_PRECONDITION, "sealing staged segment 0: the memfd is still mapped writable by a "
            "process (F_SEAL_WRITE refused with EBUSY): unmap it first")
        assert not up.closed
        assert _generations(client, name) == [(first.generation, "READY", "")]
        elsewhere.close()
    assert _generations(client, name) == [(first.generation + 1, "READY", "")]
    with client.attach(name) as model:
        assert _bytes(model[Q]) == _bf16_bytes(11.0, (1024, 1024))


def test_bad_label_leaves_the_update_open(daemon, served):
    client, (name, first) = daemon.client, served
    with client.update(name, tensors=[Q]) as up:
        with pytest.raises(weightd.WeightdError) as e:
            up.commit(version_label="x" * 129)
        assert (e.value.code, e.value.message) == (
            grpc.StatusCode.INVALID_ARGUMENT, "version label is 129 bytes; at most 128 are allowed")
        assert not up.closed
        up.version_label = "x" * 128
    assert _generations(client, name) == [(first.generation + 1, "READY", "x" * 128)]


def test_second_concurrent_update_is_already_exists(daemon, served):
    client, (name, first) = daemon.client, served
    with client.update(name, tensors=[Q]) as first_writer:
        with pytest.raises(weightd.WeightdError) as e:
            client.update(name, tensors=[K])
        assert (e.value.code, e.value.message) == (
            grpc.StatusCode.ALREADY_EXISTS,
            f"model {name!r} already has an open update (one writer per model at a time)")
        first_writer.abort()
    with client.update(name, tensors=[K]) as second:
        assert second.base_generation == first.generation


def test_begin_refuses_unknown_tensors_and_models(daemon, served):
    client, (name, _) = daemon.client, served
    with pytest.raises(weightd.WeightdError) as e:
        client.update(name, tensors=["nope"])
    assert (e.value.code, e.value.message) == (
        grpc.StatusCode.INVALID_ARGUMENT, f"model {name!r} has no tensor 'nope'")
    with pytest.raises(weightd.WeightdError) as e:
        client.update("update-never-loaded")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with client.update(name, tensors=[Q]) as up:
        with pytest.raises(KeyError, match="tensor 'nope' \\(rank 0\\) is not in this update"):
            up["nope"]
        assert (Q in up, K in up) == (True, False)
        up.abort()


def test_unload_during_an_update_aborts_it(daemon, demo_small, served):
    client, (name, _) = daemon.client, served
    up = client.update(name, tensors=[Q])
    up[Q].fill_(7.0)
    client.unload(name, force=True)
    with pytest.raises(weightd.WeightdError) as e:
        up.commit()
    assert (e.value.code, e.value.message) == (grpc.StatusCode.NOT_FOUND, "unknown or ended update id")
    assert up.closed
    assert _staged_memfds(daemon, name) == []
    client.load(name, demo_small)  # for the fixture's unload


def test_a_load_meanwhile_supersedes_the_update(daemon, served):
    client, (name, first) = daemon.client, served
    other = daemon.models / "update-other"
    other.mkdir(exist_ok=True)
    write_safetensors(other / "model.safetensors", {Q: ("BF16", (2,), b"\x00\x3f\x00\x40")})
    up = client.update(name, tensors=[Q])
    loaded = client.load(name, other).model.generation
    with pytest.raises(weightd.WeightdError) as e:
        up.commit(version_label="step-8")
    assert (e.value.code, e.value.message) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"model {name!r} is at generation {loaded} but this update began from generation {first.generation}; "
        f"the update is aborted")
    assert up.closed
    assert [g for g, state, _ in _generations(client, name) if state == "READY"] == [loaded]


def test_writer_killed_mid_update_leaves_the_generation_untouched(daemon, demo_small, served):
    client, (name, first) = daemon.client, served
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time, weightd
        up = weightd.connect({daemon.socket!r}).update({name!r}, tensors=[{Q!r}])
        up[{Q!r}].fill_(9.0)
        print("written", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "written\n", writer.stderr.read()
        assert len(_staged_memfds(daemon, name)) == 1
        with pytest.raises(weightd.WeightdError) as e:
            client.update(name, tensors=[Q])
        assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
        writer.stdout.close()
        writer.stderr.close()
    assert writer.returncode == -signal.SIGKILL
    # The daemon polls the fd socket's connections: the dead writer's update
    # ends within a poll interval, and a new writer can begin.
    start = time.monotonic()
    while True:
        try:
            probe = client.update(name, tensors=[Q])
            break
        except weightd.WeightdError as e:
            assert e.code == grpc.StatusCode.ALREADY_EXISTS
            assert time.monotonic() - start < 2, "the killed writer's update did not end"
            time.sleep(0.01)
    with probe:
        assert probe.base_generation == first.generation
        assert probe[Q].view(torch.int16).numpy().tobytes() == read_safetensors(demo_small)[Q][2]
        probe.abort()
    assert _generations(client, name) == [(first.generation, "READY", "")]
    assert _staged_memfds(daemon, name) == []  # nothing of the killed writer's staging is left


def test_watch_delivers_published_with_the_label(daemon, served):
    client, (name, first) = daemon.client, served
    with client.watch(name) as watch:
        timer = threading.Timer(10, watch.cancel)  # never hang the run
        timer.start()
        try:
            current = next(watch)
            assert (current.kind, current.generation, current.version_label) == ("CURRENT", first.generation, "")
            with client.update(name, tensors=[Q]) as up:
                up[Q].fill_(10.0)
                result = up.commit(version_label="step-10")
            published = next(watch)
        finally:
            timer.cancel()
    assert (published.kind, published.model, published.generation, published.version_label,
            published.fingerprint) == ("PUBLISHED", name, first.generation + 1, "step-10", result.model.fingerprint)


def test_buffer_works_without_torch(daemon, served, monkeypatch):
    client, (name, first) = daemon.client, served
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with client.update(name, tensors=[V]) as up:
        with pytest.raises(ImportError, match="Update.buffer\\(name\\) gives a writable memoryview without it"):
            up[V]
        view = up.buffer(V)
        view[:] = b"\x80\x3f" * (512 * 1024)  # bf16 1.0
        view.release()
    monkeypatch.undo()
    with client.attach(name) as model:
        assert (model.generation, _bytes(model[V])) == (first.generation + 1, _bf16_bytes(1.0, (512, 1024)))


def test_reload_reads_only_the_changed_file_and_reports_it(daemon, tmp_path):
    """client.reload after one of the demo's five files changed reads that file only."""
    path = daemon.models / "reload-small"
    subprocess.run([daemon.weightctl, "make-demo", str(path), "--preset", "small"], check=True, capture_output=True)
    first = daemon.client.load("reload-small", path)
    changed = path / "model-00003-of-00005.safetensors"
    data = bytearray(changed.read_bytes())
    header = int.from_bytes(data[:8], "little")
    for i in range(8 + header, min(len(data), 8 + header + 4096)):
        data[i] ^= 0xFF
    tmp = changed.with_suffix(".tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, changed)  # a new inode, as a trainer's checkpoint writer makes
    second = daemon.client.reload("reload-small")
    assert second.model.generation == first.model.generation + 1
    assert second.bytes_read == len(data) - 8 - header
    assert second.bytes_reused == first.bytes_read - second.bytes_read  # a full load reads every tensor byte
    assert second.model.bytes_read == second.bytes_read
    assert second.model.fingerprint != first.model.fingerprint
    same = daemon.client.reload("reload-small")  # nothing changed since: reused whole
    assert (same.reused, same.bytes_read, same.model.generation) == (True, 0, second.model.generation)
    daemon.client.unload("reload-small", force=True)
