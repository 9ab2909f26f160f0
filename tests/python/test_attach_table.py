"""Attach's packed tensor table (decoded natively) and prefault, in the Python client."""
import struct
from concurrent import futures

import grpc
import numpy as np
import pytest

import weightd
from weightd import _native
from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc
from conftest import write_safetensors


def _table(tensors):
    """A packed tensor table, version 1 (docs/api.md), of
    (name, dtype, shape, full_shape, placement, segment, offset, nbytes, split_dim, split_start, hash)."""
    records, dims, dtypes, names = b"", b"", [], b""
    for name, dtype, shape, full, placement, segment, offset, nbytes, split_dim, split_start, h in tensors:
        if dtype not in dtypes:
            dtypes.append(dtype)
        records += struct.pack("<QQQQIIIIIIiHBB", offset, nbytes, split_start, h, len(names), len(name), segment,
                               len(dims) // 8, len(shape), len(full), split_dim, dtypes.index(dtype), placement, 0)
        dims += b"".join(struct.pack("<Q", d) for d in (*shape, *full))
        names += name
    dtype_table = b"".join(bytes([len(d)]) + d for d in dtypes)
    header = b"WDPM" + struct.pack("<HHIIIIII", 1, 64, len(tensors), len(dtypes), len(dtype_table), len(dims) // 8,
                                   len(names), 0)
    return header + records + dims + dtype_table + names


_TWO = [(b"model.a", b"BF16", (4, 8), (8, 8), 2, 1, 4096, 64, 0, 4, 0x0123456789abcdef),
        (b"b", b"F32", (3,), (3,), 1, 0, 0, 12, -1, 0, 7)]


def test_native_table_decodes_the_documented_layout():
    table = _native.PackedTable(_table(_TWO))
    assert len(table) == 2
    assert table.index() == {"model.a": 0, "b": 1}
    assert table.info(0) == ("model.a", "BF16", (4, 8), "device", 1, 4096, 64, (8, 8), 0, 4, "0123456789abcdef")
    assert table.info(1) == ("b", "F32", (3,), "host", 0, 0, 12, (3,), -1, 0, "0000000000000007")
    assert table.first_outside([12, 4160]) == -1
    assert table.first_outside([12, 4159]) == 0
    assert table.first_outside([12]) == 0
    with pytest.raises(IndexError):
        table.info(2)


def test_native_table_refuses_every_truncation_and_bad_utf8():
    data = _table(_TWO)
    for n in range(len(data)):
        with pytest.raises(RuntimeError) as e:
            _native.PackedTable(data[:n])
        assert e.value.code == 15 and "packed manifest" in str(e.value), n
    bad = _table([(b"\xff\xfe", b"U8", (1,), (1,), 1, 0, 0, 1, -1, 0, 0)])
    table = _native.PackedTable(bad)  # the layout is valid; the name is not UTF-8
    with pytest.raises(RuntimeError, match="tensor record 0: name is not UTF-8") as e:
        table.index()
    assert e.value.code == 15


def _write_model(daemon):
    write_safetensors(daemon.models / "table.safetensors", {
        "cols": ("U8", (2, 4), b"abcdefgh"),
        "norm": ("F32", (2,), b"12345678"),
        "big": ("U8", (3 * 4096 + 5,), b"b" * (3 * 4096 + 5)),
    })


def test_packed_and_entry_manifests_are_the_same_model(emulated_daemon):
    _write_model(emulated_daemon)
    client = emulated_daemon.client
    client.load("table", emulated_daemon.models / "table.safetensors", tp_size=2, tp_rules=[("cols", 1)],
                host_resident=["big"], devices=["GPU-emulated-0", "GPU-emulated-1"])
    with client.attach("table", 1) as packed, client._attach("table", 1, packed=False) as entries:
        assert packed.manifest == entries.manifest
        assert list(packed) == list(entries) == ["cols", "norm", "big"]
        assert len(packed) == 3 and "cols" in packed and "nope" not in packed
        cols = packed.tensor_info("cols")
        assert (cols.shape, cols.full_shape, cols.split_dim, cols.split_start, cols.placement) == \
            ((2, 2), (2, 4), 1, 2, "device")
        assert packed["cols"].raw().__dlpack_device__() == entries["cols"].raw().__dlpack_device__()
        assert bytes(memoryview(np.from_dlpack(packed["big"].raw()))) == b"b" * (3 * 4096 + 5)
        with pytest.raises(KeyError):
            packed.tensor_info("nope")
    client.unload("table", force=True)


def _smaps(address):
    """{field: kB} of the mapping starting at `address` in /proc/self/smaps."""
    out, found = {}, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if found:
                    break
                found = int(head.split("-")[0], 16) == address
            elif found and len(line.split()) == 3 and line.split()[2] == "kB":
                out[head.rstrip(":")] = int(line.split()[1])
    assert out, f"no mapping starts at {address:#x}"
    return out


def test_prefault_maps_every_page_lazy_none(daemon):
    _write_model(daemon)
    daemon.client.load("table-host", daemon.models / "table.safetensors")
    with daemon.client.attach("table-host") as lazy, daemon.client.attach("table-host", prefault=True) as eager:
        (lazy_base, _), = lazy.mappings
        (eager_base, _), = eager.mappings
        assert _smaps(lazy_base)["Rss"] == 0
        populated = _smaps(eager_base)
        assert populated["Size"] >= 16 and populated["Rss"] == populated["Size"]
        assert bytes(np.from_dlpack(eager["norm"].raw())) == b"12345678"
    with daemon.client.attach("table-host", private=True, prefault=True) as mine:
        (base, _), = mine.mappings
        stats = _smaps(base)
        assert stats["Rss"] == stats["Size"] and stats["Private_Dirty"] == 0  # read, not copied
    daemon.client.unload("table-host", force=True)


class _LyingDaemon(pb_grpc.WeightdServicer):
    """Answers Attach with a given packed_tensors (and a TensorEntry when `entries`)."""

    def __init__(self, packed, entries=False):
        self.packed, self.entries, self.detached, self.asked = packed, entries, [], None

    def Attach(self, request, context):
        self.asked = request.manifest_encoding
        return pb.AttachResponse(lease_id="lease-1", fd_socket="/nonexistent", model=request.name,
                                 packed_tensors=self.packed,
                                 tensors=[pb.TensorEntry(name="x")] if self.entries else [])

    def Detach(self, request, context):
        self.detached.append(request.lease_id)
        return pb.DetachResponse()


def _attach_from(tmp_path, service):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_WeightdServicer_to_server(service, server)
    socket = str(tmp_path / "fake.sock")
    server.add_insecure_port("unix://" + socket)
    server.start()
    try:
        with pytest.raises(weightd.WeightdError) as e:
            weightd.connect(socket).attach("m")
        return e.value
    finally:
        server.stop(None)


@pytest.mark.parametrize("cut", [1, 31, 40, -1])
def test_hostile_truncated_table_is_data_loss_and_detaches(tmp_path, cut):
    service = _LyingDaemon(_table(_TWO)[:cut])
    error = _attach_from(tmp_path, service)
    assert error.code == grpc.StatusCode.DATA_LOSS and "packed manifest" in error.message
    assert service.asked == pb.AttachRequest.PACKED_TABLE_V1
    assert service.detached == ["lease-1"]


def test_hostile_table_with_entries_is_data_loss(tmp_path):
    error = _attach_from(tmp_path, _LyingDaemon(_table(_TWO), entries=True))
    assert error.code == grpc.StatusCode.DATA_LOSS and "both packed_tensors" in error.message


def test_model_turns_a_bad_name_into_data_loss(tmp_path):
    bad = _native.PackedTable(_table([(b"\xff", b"U8", (1,), (1,), 1, 0, 0, 1, -1, 0, 0)]))
    model = weightd.Model(pb.AttachResponse(model="m"), _FakeLease(), 0.0, table=bad)
    assert len(model) == 1  # no name decoded yet
    with pytest.raises(weightd.WeightdError) as e:
        "w" in model
    assert e.value.code == grpc.StatusCode.DATA_LOSS and "not UTF-8" in e.value.message


class _FakeLease:
    lease_id = "lease-1"
    segments = ()
