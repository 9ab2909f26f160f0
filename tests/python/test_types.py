"""The package's type information: _native.pyi states what the compiled
module exports, and the str enums of ModelInfo.state and WatchEvent.kind
hold the proto's names and still act as those strings."""
import ast
import inspect
import re
from pathlib import Path

import weightd
from weightd import _native
from weightd.v1 import weightd_pb2 as pb

_STUB = Path(weightd.__file__).with_name("_native.pyi")
# pybind11's spelling of a type in its docstrings -> the stub's
_PYBIND_TYPES = {"tuple": "Tuple", "dict": "Dict", "List[int]": "Sequence[int]", "capsule": "object",
                 "weightd._native.Segment": "Segment", "List[str]": "Sequence[str]",
                 "List[Tuple[str, int, int, int]]": "Sequence[Tuple[str, int, int, int]]"}


def _split(params):
    """Top-level comma split of a parameter list ("a: Dict[str, int], b: int")."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(params):
        depth += c in "[(" and 1 or c in "])" and -1 or 0
        if c == "," and depth == 0:
            parts.append(params[start:i].strip())
            start = i + 1
    return parts + [params[start:].strip()] if params.strip() else parts


def _runtime_signature(function):
    """[(name, type, default)] and return type from pybind11's first docstring line, `self` left out."""
    match = re.match(r"\w*\((.*)\) -> (.+)$", function.__doc__.splitlines()[0])
    params = []
    for p in _split(match.group(1)):
        m = re.fullmatch(r"(\w+): ([\w.\[\], ]+?)(?: = (.+))?", p)
        if m.group(1) not in ("self", "arg0"):
            params.append((m.group(1), _PYBIND_TYPES.get(m.group(2), m.group(2)), m.group(3)))
    return params, _PYBIND_TYPES.get(match.group(2), match.group(2))


def _stub_signature(node, method=True):
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
    args = node.args.args[1 if method and not static else 0:]
    defaults = [None] * (len(args) - len(node.args.defaults)) + [ast.unparse(d) for d in node.args.defaults]
    params = [(a.arg, ast.unparse(a.annotation), d) for a, d in zip(args, defaults)]
    returns = re.sub(r"^(Tuple|Dict)\[.*\]$", r"\1", ast.unparse(node.returns))
    return params, returns.replace("_TensorFields", "Tuple").replace("_PinFields", "Tuple")


def test_native_stub_states_every_export_with_pybind11s_names_types_and_defaults():
    stub = ast.parse(_STUB.read_text())
    classes = {n.name: n for n in stub.body if isinstance(n, ast.ClassDef)}
    functions = {n.name: n for n in stub.body if isinstance(n, ast.FunctionDef)}
    variables = {n.target.id for n in stub.body if isinstance(n, ast.AnnAssign)}
    public = {k for k in vars(_native) if not k.startswith("__")}
    assert public == set(classes) | set(functions) | variables
    checked = 0
    for name, cls in classes.items():
        runtime = getattr(_native, name)
        members = {k: v for k, v in vars(runtime).items() if not k.startswith("__") or k in ("__init__", "__len__")}
        stubbed = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
        assert set(members) == set(stubbed), name
        for member, value in members.items():
            function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            assert _stub_signature(stubbed[member]) == _runtime_signature(function), f"{name}.{member}"
            checked += 1
    for name, node in functions.items():
        assert _stub_signature(node, method=False) == _runtime_signature(getattr(_native, name)), name
        checked += 1
    assert checked == 23


def test_state_and_event_kind_enums_hold_the_protos_names():
    assert [s.value for s in weightd.ModelState] == list(pb.ModelState.keys())
    assert [k.value for k in weightd.WatchEventKind] == list(pb.ModelEvent.Kind.keys())


def test_enum_members_act_as_their_strings():
    ready = weightd.ModelInfo.from_proto(pb.ModelInfo(name="m", state=pb.READY)).state
    assert ready is weightd.ModelState.READY
    assert ready == "READY" and "READY" == ready and ready != "DRAINING"
    assert (str(ready), f"{ready}", f"{ready:>7}", "%s" % ready) == ("READY", "READY", "  READY", "READY")
    assert {"READY": 1}[ready] == 1
    kind = weightd.WatchEvent.from_proto(pb.ModelEvent(kind=pb.ModelEvent.PUBLISHED)).kind
    assert (kind, str(kind)) == (weightd.WatchEventKind.PUBLISHED, "PUBLISHED")


def test_attach_takes_no_private_keyword():
    assert list(inspect.signature(weightd.Client.attach).parameters) == ["self", "model", "rank", "private",
                                                                          "prefault", "numa_node", "pin",
                                                                          "pin_chunk_bytes", "layout", "identity"]


def test_layout_calls_take_their_documented_keywords():
    assert list(inspect.signature(weightd.Client.publish_layout).parameters) == [
        "self", "model", "key", "tensors", "rank", "identity", "device", "wait"]
    assert [k.value for k in weightd.WatchEventKind if k.value.startswith("LAYOUT_")] == [
        "LAYOUT_PUBLISHED", "LAYOUT_DROPPED", "LAYOUT_DRAINING"]
    assert issubclass(weightd.LayoutNotFound, weightd.WeightdError)
    assert issubclass(weightd.LayoutMismatch, weightd.WeightdError)
