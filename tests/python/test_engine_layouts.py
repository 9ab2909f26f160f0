"""The engines' shared runtime-layout steps (weightd._engine_layouts), without any engine, against a
real daemon: what vLLM's and SGLang's load formats log, raise, publish and bind.
The engines themselves are tested in tests/python/engines/ (scripts/test-engines.sh)."""
import logging

import pytest
import torch
from torch import nn

from conftest import write_safetensors
from weightd._engine import LoadFormatError, Options, Session
from weightd._engine_layouts import EngineLayouts, layout_key, not_plain_tensor, own_dispatch, tensor_attributes

LOG = logging.getLogger("test_engine_layouts")
IDENTITY = {"engine": "testengine 1.0", "layout_abi": "1", "rank": "0"}


class _Rotary(nn.Module):
    """A weight, and a buffer computed at construction and kept out of the state_dict (as a rotary cache)."""

    def __init__(self, device=None):
        super().__init__()
        self.proj = nn.Linear(4, 3, bias=False, device=device)
        self.register_buffer("cache", torch.arange(6.0, device=device).reshape(2, 3), persistent=False)


@pytest.fixture
def session(daemon, request):
    """A Session on a loaded model of this test's own (layouts belong to a model's generation)."""
    name = "engine-layouts-" + request.node.name.replace("_", "-")[5:40]
    folder = daemon.models / name
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", {"w": ("F32", (2,), bytes(8))})
    daemon.client.load(name, folder)
    return Session(Options(), str(folder), name, daemon.client, LOG)


def _layouts(session, key, all_buffers=True, identity=IDENTITY):
    return EngineLayouts("TestEngine", session, 0, dict(identity), key, LOG, all_buffers=all_buffers)


def test_layout_key_replaces_what_a_key_may_not_hold():
    assert layout_key("sglang", ["LlamaForCausalLM", "bfloat16", "tp1 pp1"]) == \
        "sglang/LlamaForCausalLM/bfloat16/tp1_pp1"


class _Scaled(nn.Module):
    """A weight, a tensor kept as a plain attribute (an engine's scale copy or MLA's w_kc) and an empty
    slot filled later (vLLM's attn.kv_cache)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 2, bias=False)
        self.inner.scale_cpu = torch.tensor(1.0)
        self.kv_cache = torch.tensor([])


class _LoaderParameter(nn.Parameter):
    """As the engines' ModelWeightParameter: a Parameter subclass for its weight loader only."""


def test_tensor_attributes_and_subclasses():
    model = _Scaled()
    assert list(tensor_attributes(model)) == ["inner.scale_cpu"]
    assert tensor_attributes(model)["inner.scale_cpu"] is model.inner.scale_cpu
    assert not_plain_tensor(model) is None
    model.inner.weight = _LoaderParameter(torch.zeros(2, 2))
    assert not own_dispatch(model.inner.weight) and not_plain_tensor(model) is None


def test_published_then_bound_into_a_meta_module_with_every_buffer(session, caplog):
    torch.manual_seed(0)
    source = _Rotary()
    with caplog.at_level(logging.INFO, logger=LOG.name):
        assert _layouts(session, "t/all").attach_weights() is None
        _layouts(session, "t/all").publish_model(source, None)
    assert caplog.messages == [
        f"weightd: no runtime layout 't/all' of model '{session.name}' yet: loading and post-processing",
        f"weightd: published runtime layout 't/all' of model '{session.name}' rank 0 (2 tensors, "
        f"{_host_bytes(session, 't/all')} bytes on the host)"]
    layouts = _layouts(session, "t/all")
    target = layouts.bind(_Rotary(device="meta"), layouts.attach_weights())
    assert torch.equal(target.proj.weight, source.proj.weight)
    assert torch.equal(target.cache, torch.arange(6.0).reshape(2, 3))
    assert "cache" not in target.state_dict()  # non-persistent again after the bind


def _host_bytes(session, key):
    (model,) = [m for m in session.client.list() if m.name == session.name]
    return [layout.host_bytes for layout in model.layouts if layout.key == key][0]


def test_without_all_buffers_a_non_persistent_buffer_stays_on_the_meta_device(session):
    _layouts(session, "t/params", all_buffers=False).publish_model(_Rotary(), None)
    layouts = _layouts(session, "t/params", all_buffers=False)
    target = layouts.bind(_Rotary(device="meta"), layouts.attach_weights())
    assert target.proj.weight.device.type == "cpu" and target.cache.device.type == "meta"


def test_a_reason_publishes_nothing_and_says_why(session, caplog):
    with caplog.at_level(logging.INFO, logger=LOG.name):
        _layouts(session, "t/packed").publish_model(_Rotary(), "the weights are packed")
    assert caplog.messages == ["weightd: runtime layout not published, the next start loads and post-processes "
                               "again: the weights are packed"]
    (model,) = [m for m in session.client.list() if m.name == session.name]
    assert model.layouts == ()


def test_another_identity_is_one_line_naming_the_engine(session):
    _layouts(session, "t/id").publish_model(_Rotary(), None)
    with pytest.raises(LoadFormatError) as e:
        _layouts(session, "t/id", identity={**IDENTITY, "engine": "testengine 2.0"}).attach_weights()
    message = str(e.value)
    assert message.startswith(f"weightd: runtime layout 't/id' of model '{session.name}' has another identity than "
                              "this TestEngine start (FAILED_PRECONDITION: ")
    assert "engine is 'testengine 2.0' here but 'testengine 1.0' in the published layout" in message
    assert message.endswith(f"): drop it (weightctl drop-layout {session.name} t/id) or start with the option "
                            "'layouts' false")
