"""weightd.torch.load_into on plain nn.Modules, and copy-on-write attaches (private=True)."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import weightd
import weightd.torch
from conftest import read_safetensors, write_safetensors


def _f32(*values):
    return np.asarray(values, dtype="<f4").tobytes()


class Block(torch.nn.Module):
    """A linear layer, a persistent buffer and a non-persistent one (like BERT's position_ids)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2, bias=True)
        self.register_buffer("scale", torch.zeros(2))
        self.register_buffer("position_ids", torch.arange(3), persistent=False)


class TiedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(3, 2)
        self.block = Block()
        self.head = torch.nn.Linear(2, 3, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2's lm_head and wte


def _checkpoint():
    return {
        "embed.weight": ("F32", (3, 2), _f32(1, 2, 3, 4, 5, 6)),
        "block.proj.weight": ("F32", (2, 2), _f32(7, 8, 9, 10)),
        "block.proj.bias": ("F32", (2,), _f32(11, 12)),
        "block.scale": ("F32", (2,), _f32(13, 14)),
        "block.position_ids": ("I64", (3,), np.asarray([9, 9, 9], dtype="<i8").tobytes()),
    }


@pytest.fixture(scope="module")
def tied(daemon):
    """The TiedModel checkpoint (position_ids included, head.weight left out) loaded as "tied",
    and the same tensors under "0.auto_model." as "prefixed"."""
    write_safetensors(daemon.models / "tied.safetensors", _checkpoint())
    prefixed = {"0.auto_model." + k: v for k, v in _checkpoint().items()}
    prefixed["1.pooling.weight"] = ("F32", (1,), _f32(0))
    write_safetensors(daemon.models / "prefixed.safetensors", prefixed)
    daemon.client.load("tied", daemon.models / "tied.safetensors")
    daemon.client.load("prefixed", daemon.models / "prefixed.safetensors")
    return daemon


def _check_loaded(module, model):
    assert module.head.weight is module.embed.weight  # still one object
    assert module.embed.weight.tolist() == [[1, 2], [3, 4], [5, 6]]
    assert module.block.proj.weight.tolist() == [[7, 8], [9, 10]]
    assert module.block.scale.tolist() == [13, 14]
    assert module.block.position_ids.tolist() == [0, 1, 2]  # non-persistent: the module's own
    assert isinstance(module.embed.weight, torch.nn.Parameter) and module.embed.weight.requires_grad
    for name, tensor in list(module.named_parameters()) + [("block.scale", module.block.scale)]:
        assert model.owns(tensor.data_ptr()), f"{name} was copied"


def test_load_into_is_zero_copy_keeps_ties_and_skips_non_persistent_buffers(tied):
    module = TiedModel()
    with tied.client.attach("tied") as model:
        keys = weightd.torch.load_into(module, model)
        assert keys.missing_keys == [] and keys.unexpected_keys == []
        assert type(keys).__name__ == "_IncompatibleKeys"
        _check_loaded(module, model)


def test_load_into_strips_a_checkpoint_prefix_and_ignores_other_modules(tied):
    module = TiedModel()
    with tied.client.attach("prefixed") as model:
        keys = weightd.torch.load_into(module, model, prefix="0.auto_model.")
        assert (keys.missing_keys, keys.unexpected_keys) == ([], [])
        _check_loaded(module, model)


def test_load_into_reports_missing_and_unexpected_like_torch(tied):
    module = TiedModel()
    module.extra = torch.nn.Linear(1, 1, bias=False)
    with tied.client.attach("prefixed") as model:
        with pytest.raises(RuntimeError) as info:
            weightd.torch.load_into(module, model)  # no prefix: every name is unexpected
        assert str(info.value).startswith("Error(s) in loading state_dict for TiedModel:\n\t")
        assert '"0.auto_model.embed.weight"' in str(info.value)
        assert str(info.value).endswith('\n\tMissing key(s) in state_dict: "embed.weight", "block.scale", '
                                        '"block.proj.weight", "block.proj.bias", "head.weight", "extra.weight". ')
        keys = weightd.torch.load_into(module, model, prefix="0.auto_model.", strict=False)
        assert keys.missing_keys == ["extra.weight"]
        assert keys.unexpected_keys == []
        assert module.embed.weight.tolist() == [[1, 2], [3, 4], [5, 6]]  # the rest loaded


def test_load_into_refuses_a_shape_mismatch_even_when_not_strict(tied):
    module = TiedModel()
    module.block.proj = torch.nn.Linear(2, 3)
    with tied.client.attach("tied") as model:
        with pytest.raises(RuntimeError, match=r"size mismatch for block.proj.weight: copying a param with shape "
                                               r"\(2, 2\) from checkpoint, the shape in current model is \(3, 2\)"):
            weightd.torch.load_into(module, model, strict=False)


def test_load_into_takes_a_plain_state_dict_too():
    module = torch.nn.Linear(2, 1, bias=False)
    weight = torch.tensor([[1.0, 2.0]])
    keys = weightd.torch.load_into(module, {"weight": weight})
    assert keys.missing_keys == [] and module.weight.data_ptr() == weight.data_ptr()


def test_import_weightd_does_not_import_torch():
    child = subprocess.run([sys.executable, "-c", "import sys, weightd; print('torch' in sys.modules)"],
                           capture_output=True, text=True, timeout=60)
    assert (child.returncode, child.stdout.strip()) == (0, "False"), child.stderr


# ------------------------------------------------------------ private=True


def _anonymous_bytes(address):
    """Anonymous of the mapping starting at `address` in /proc/self/smaps, in bytes: the
    pages a write copied out of the memfd. Not Private_Dirty, which also counts a shmem
    page only this process maps at the moment (the daemon pins its own mapping in the
    background), so a page merely read, or brought in by fault-around, counted as copied
    (seen on PyPI's torch 2.15: 57 pages for 13 written)."""
    found = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start = int(head.split("-")[0], 16)
                found = start == address
            elif found and head == "Anonymous:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping starts at {address:#x}")


def _pages(model, names, page=4096):
    """The distinct 4 KiB pages, per segment, that holding the tensors `names` spans."""
    spans = set()
    for name in names:
        info = model.tensor_info(name)
        first, last = info.offset // page, (info.offset + info.nbytes - 1) // page
        spans.update((info.segment, p) for p in range(first, last + 1))
    return spans


def _copied_bytes(model):
    return sum(_anonymous_bytes(base) for base, size in model.mappings if size)


def test_private_attach_copies_exactly_the_pages_written(daemon, demo_small):
    with daemon.client.attach("demo-small", private=True) as model:
        assert model.private
        norms = [n for n in model if n.endswith("norm.weight")]
        assert len(norms) == 13  # 2 per layer x 6, and the final norm
        before = _copied_bytes(model)
        for name in norms:  # a Gemma-style offset pass: w += 1, in place
            model[name].to_torch().add_(1)
        assert before == 0
        assert _copied_bytes(model) == len(_pages(model, norms)) * 4096
        expected = read_safetensors(demo_small)
        value = model[norms[0]].to_torch()
        original = torch.frombuffer(bytearray(expected[norms[0]][2]), dtype=torch.bfloat16)
        assert torch.equal(value, original + 1)


def test_private_write_is_invisible_to_other_clients_and_the_daemon(daemon, demo_small):
    name = "model.layers.0.self_attn.q_proj.weight"
    original = read_safetensors(demo_small)[name][2]
    with daemon.client.attach("demo-small", private=True) as mine:
        mine[name].to_torch().fill_(2.0)
        assert mine[name].to_torch().unique().tolist() == [2.0]
        # Another process attached now reads the daemon's bytes.
        child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import numpy as np, weightd
            with weightd.connect({daemon.socket!r}).attach("demo-small") as model:
                print(np.from_dlpack(model[{name!r}].raw()).tobytes().hex())
        """)], capture_output=True, text=True, timeout=120)
        assert child.returncode == 0, child.stderr
        assert bytes.fromhex(child.stdout.strip()) == original
    with daemon.client.attach("demo-small", private=True) as again:
        assert np.from_dlpack(again[name].raw()).tobytes() == original


def test_load_into_a_private_attach_gives_writable_parameters(daemon, demo_small):
    with daemon.client.attach("demo-small", private=True) as model:
        norm = torch.nn.Module()
        norm.weight = torch.nn.Parameter(torch.empty(1024, dtype=torch.bfloat16))
        weightd.torch.load_into(norm, model, prefix="model.norm.", strict=False)
        with torch.no_grad():
            norm.weight.mul_(0)
        assert norm.weight.abs().sum().item() == 0
        assert model.owns(norm.weight.data_ptr())


def test_emulated_device_arenas_map_copy_on_write_too(emulated_daemon, demo_small):
    emulated_daemon.client.load("demo-device", demo_small, devices=["GPU-emulated-0"])
    with emulated_daemon.client.attach("demo-device", private=True) as model:
        name = "model.norm.weight"
        assert model.tensor_info(name).placement == "device"
        model[name].to_torch().zero_()
        assert model[name].to_torch().abs().sum().item() == 0
    with emulated_daemon.client.attach("demo-device") as model:
        assert np.from_dlpack(model[name].raw()).tobytes() == read_safetensors(demo_small)[name][2]


@pytest.mark.parametrize("backend", ["cuda-vmm", "cuda-legacy-ipc"])
def test_cuda_arenas_refuse_copy_on_write_before_loading_a_driver(backend):
    from weightd._native import Segment
    uuid = "GPU-00000000-0000-0000-0000-000000000000"
    with pytest.raises(RuntimeError) as info:
        Segment.import_device(backend, uuid, 2 << 20, b"", -1, True)
    assert str(info.value) == (
        f"importing {backend} arena on {uuid}: a {backend} arena on {uuid} cannot be mapped copy-on-write "
        "(GPU memory has no private pages): attach without it and copy the device tensors you change")
    assert info.value.code == 9  # FAILED_PRECONDITION
