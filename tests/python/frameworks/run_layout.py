"""One process of the runtime-layout framework test (test_layouts_frameworks.py).

    run_layout.py publish DIR CLASS OUT SOCKET NAME KEY
        process A: attaches the checkpoint (weightd.transformers.load_model),
        runs post_process.post_process, runs the forward pass into OUT, and
        publishes the post-processed module (weightd.torch.publish_module)
    run_layout.py attach DIR CLASS OUT SOCKET NAME KEY
        process B: attaches the layout, builds the post-processed structure on
        the meta device (config.json only), weightd.torch.load_into, and runs
        the forward pass into OUT

Both print one JSON line, then wait for a line (or EOF) on stdin. Keys:
params ({name: [dtype, shape, strides]} of named_parameters), layout_bytes
(publish: the LayoutInfo's host bytes), outside (attach: parameters not in a
weightd mapping), pss_load (attach: growth of /proc/self/smaps_rollup's Pss
from before the attach to after load_into).
"""
import json
import sys

import torch
import transformers

import weightd
import weightd.torch
import weightd.transformers
from post_process import post_process
from run_model import inputs, outputs, rollup

IDENTITY = {"engine": "weightd-frameworks-test", "engine_version": transformers.__version__, "layout_abi": "1",
            "quantization": "int8-per-output-channel", "tp_size": "1"}


def describe(model):
    return {n: [str(p.dtype), list(p.shape), list(p.stride())] for n, p in model.named_parameters()}


def meta_model(cls, directory):
    """The post-processed structure with every parameter on the meta device (reads config.json only)."""
    with weightd.transformers.empty_parameters():
        model = cls(transformers.AutoConfig.from_pretrained(directory))
    return post_process(model)


def publish(cls, directory, client, name, key):
    with client.attach(name) as checkpoint:
        model = weightd.transformers.load_model(checkpoint, directory, model_class=cls)
        post_process(model)
    model.eval()
    info = weightd.torch.publish_module(client, name, key, model, identity=IDENTITY)
    return model, {"layout_bytes": info.host_bytes, "tensor_count": info.tensor_count}


def attach(cls, directory, client, name, key):
    meta_model(cls, directory)  # imports and first-build allocations are not counted as loading
    client.list()
    before = rollup()
    layout = client.attach(name, layout=key, identity=IDENTITY)
    model = meta_model(cls, directory)
    weightd.torch.load_into(model, layout)
    model.eval()
    report = {"pss_load": rollup()["Pss"] - before["Pss"],
              "outside": [n for n, p in model.named_parameters() if not layout.owns(p.data_ptr())],
              "on_meta": [n for n, p in model.named_parameters() if p.is_meta]}
    return model, report


def main(mode, directory, class_name, out_path, socket, name, key):
    torch.set_num_threads(1)  # the same reduction order in every process
    cls = getattr(transformers, class_name)
    client = weightd.connect(socket)
    model, report = (publish if mode == "publish" else attach)(cls, directory, client, name, key)
    with open(out_path, "wb") as f:
        f.write(outputs(model, model.config))
    report["params"] = describe(model)
    print(json.dumps(report), flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main(*sys.argv[1:])
