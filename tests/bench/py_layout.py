"""Runtime layouts, for tests/bench/bench.py (issue 25's benchmark row): a
second process getting a post-processed model ready by attaching the
published layout and binding it into modules, against attaching the
checkpoint and running the post-processing itself. The pass does real
work over a Llama-shaped checkpoint (weightctl make-demo): q/k/v fused into
one tensor per layer, and every linear weight (lm_head included) quantized
to int8 with fp32 per-output-channel scales; norms and the embedding stay
as they are. Run under the Python the package was built for, with
PYTHONPATH at the build's client/python. Prints one JSON line.

    py_layout.py publish --socket S --name N --key K   post-process once and publish (the first process)
    py_layout.py layout  --socket S --name N --key K   attach the layout, load_into a meta module
    py_layout.py process --socket S --name N           attach the checkpoint, post-process into the module
"""
import argparse
import json
import re
import time

import torch

import weightd
import weightd.torch

IDENTITY = {"engine": "weightd-bench", "layout_abi": "1", "quantization": "int8-per-output-channel",
            "fusion": "qkv", "tp_size": "1"}
_QKV = re.compile(r"^(.*)\.self_attn\.q_proj\.weight$")
_LINEAR = re.compile(r"\.(o_proj|gate_proj|up_proj|down_proj)\.weight$|^lm_head\.weight$")


def plan(manifest):
    """{post-processed name: (torch dtype, shape, [(checkpoint names fused in order)] or None)} from
    the checkpoint's names and shapes: what an engine knows from its config."""
    shapes = {t.name: t.shape for t in manifest.tensors}
    out = {}
    for name, shape in shapes.items():
        fused = _QKV.match(name)
        if fused:
            base = fused.group(1) + ".self_attn."
            parts = [base + p + "_proj.weight" for p in ("q", "k", "v")]
            rows = sum(shapes[p][0] for p in parts)
            out[base + "qkv.qweight"] = (torch.int8, (rows, shape[1]), parts)
            out[base + "qkv.scale"] = (torch.float32, (rows,), None)
        elif re.search(r"\.(k_proj|v_proj)\.weight$", name):
            continue
        elif _LINEAR.search(name):
            stem = name[:-len(".weight")]
            out[stem + ".qweight"] = (torch.int8, tuple(shape), [name])
            out[stem + ".scale"] = (torch.float32, (shape[0],), None)
        else:
            out[name] = (torch.bfloat16, tuple(shape), None)
    return out


def meta_module(layout_plan):
    """An nn.Module tree holding every planned tensor as a meta parameter, under its dotted name."""
    root = torch.nn.Module()
    for name, (dtype, shape, _) in layout_plan.items():
        owner = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"),
                                                          requires_grad=False))
    return root


def quantize(weight):
    scale = weight.abs().amax(dim=1) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def post_process(checkpoint, layout_plan):
    """{name: tensor} of the post-processed model, computed from the attached checkpoint."""
    out = {}
    for name, (_, _, sources) in layout_plan.items():
        if name.endswith(".scale"):
            continue
        if sources is None:
            out[name] = checkpoint[name].to_torch()
            continue
        weight = torch.cat([checkpoint[s].to_torch().float() for s in sources])
        out[name], out[name[:-len("qweight")] + "scale"] = quantize(weight)
    return out


def bind(module, tensors):
    """Makes each tensor the module's parameter of that name (no copy)."""
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        owner = module
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, leaf, torch.nn.Parameter(tensor, requires_grad=False))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["publish", "layout", "process"])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--key", default="bench/int8-qkv")
    args = ap.parse_args()
    torch.set_num_threads(2)
    client = weightd.connect(args.socket)
    layout_plan = plan(client.manifest(args.name))  # the engine's config: names and shapes only
    start = time.perf_counter()
    if args.mode == "layout":
        layout = client.attach(args.name, layout=args.key, identity=IDENTITY)
        module = meta_module(layout_plan)
        weightd.torch.load_into(module, layout)
        inside = all(layout.owns(p.data_ptr()) for p in module.parameters())
    else:
        checkpoint = client.attach(args.name)
        module = meta_module(layout_plan)
        bind(module, post_process(checkpoint, layout_plan))
        inside = None
    seconds = time.perf_counter() - start
    report = {"mode": args.mode, "seconds": seconds, "inside_mappings": inside,
              "tensors": sum(1 for _ in module.parameters()),
              "bytes": sum(p.numel() * p.element_size() for p in module.parameters())}
    if args.mode == "publish":
        start = time.perf_counter()
        info = weightd.torch.publish_module(client, args.name, args.key, module, identity=IDENTITY)
        report.update(publish_seconds=time.perf_counter() - start, layout_host_bytes=info.host_bytes,
                      daemon_publish_seconds=info.publish_seconds)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
