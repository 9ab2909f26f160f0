"""The str enums of ModelInfo.state and WatchEvent.kind hold the proto's
names and still act as those strings."""
import weightd
from weightd.v1 import weightd_pb2 as pb


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

