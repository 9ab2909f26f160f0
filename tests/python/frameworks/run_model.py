"""One process of the framework tests: load a saved transformers model one way,
run it on fixed inputs, write the outputs' bytes and print one JSON line.

    run_model.py reference DIR CLASS OUT             from_pretrained (reads the files)
    run_model.py weightd DIR CLASS OUT SOCKET NAME   weightd.transformers.load_model (attach, zero-copy)
    run_model.py private DIR CLASS OUT SOCKET NAME   as weightd, attached private=True, then an in-place
                                                     post-processing pass; waits for a line on stdin
                                                     before exiting, so the caller can look meanwhile

Every mode waits for a line (or EOF) on stdin before exiting, so a caller
can hold the process (and its lease) while it looks.

JSON keys: seconds (loading only), param_bytes, outside (names of parameters
not inside a weightd mapping), tied (output embeddings are the input
embeddings' object, or null), and memory deltas in bytes from
/proc/self/smaps_rollup: pss_* and anon_* (Anonymous: memory this process
holds a private copy of) from before loading to after loading (*_load) and
to after the forward pass (*_forward); mapped_pss_load/_forward: the Pss of
the weightd mappings themselves; for private: pass_bytes (bytes the pass
wrote), pass_copied (growth of the mappings' Anonymous over the pass:
the pages copy-on-write copied) and pass_pages_spanned (bytes of the pages
the written tensors lie on).
"""
import json
import sys
import time

import torch
import transformers


def rollup():
    """{field: bytes} of /proc/self/smaps_rollup."""
    values = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                values[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return values


def mapped(weights, field):
    """`field` ("Pss", "Anonymous") summed over the weightd mappings of
    `weights` in /proc/self/smaps, in bytes."""
    starts, total, inside = {base for base, size in weights.mappings if size}, 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) in starts
            elif inside and head == field + ":":
                total += int(line.split()[1]) * 1024
    return total


def pages_spanned(weights, names, page=4096):
    """Bytes of the distinct pages holding the tensors `names`."""
    pages = set()
    for name in names:
        info = weights.tensor_info(name)
        pages.update((info.segment, p) for p in range(info.offset // page, (info.offset + info.nbytes - 1) // page + 1))
    return len(pages) * page


def warm_up(cls, directory):
    """Builds the model once with meta parameters, so that the imports and
    allocations any first build makes are not counted as loading."""
    import weightd.transformers
    with weightd.transformers.empty_parameters():
        cls(transformers.AutoConfig.from_pretrained(directory))


def inputs(config):
    """Fixed token ids (and mask) within the vocabulary: 2 sequences of 16."""
    ids = (torch.arange(32).reshape(2, 16) * 7919) % config.vocab_size
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def outputs(model, config):
    with torch.no_grad():
        out = model(**inputs(config))
    names = [k for k in ("last_hidden_state", "pooler_output", "logits") if getattr(out, k, None) is not None]
    return b"".join(getattr(out, k).contiguous().numpy().tobytes() for k in names)


def post_process(model):
    """An engine-style pass after loading, in place: LayerNorm weights scaled
    (as when folding a scale) and the square attention output projections
    transposed (a re-layout). Returns (names written, bytes written)."""
    names, written = [], 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name and name.endswith(".weight"):
                p.mul_(2)
            elif name.endswith("attn.c_proj.weight") and p.shape[0] == p.shape[1]:
                p.copy_(p.t().clone())
            else:
                continue
            names.append(name)
            written += p.numel() * p.element_size()
    return names, written


def main(mode, directory, class_name, out_path, socket=None, name=None):
    torch.set_num_threads(1)  # the same reduction order in every process
    cls = getattr(transformers, class_name)
    warm_up(cls, directory)
    before = rollup()
    start = time.monotonic()
    weights = None
    if mode == "reference":
        model = cls.from_pretrained(directory)
    else:
        import weightd
        import weightd.transformers
        weights = weightd.connect(socket).attach(name, private=(mode == "private"))
        model = weightd.transformers.load_model(weights, directory, model_class=cls)
    seconds = time.monotonic() - start
    loaded = rollup()
    output_embeddings = model.get_output_embeddings()
    report = {"seconds": seconds, "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
              "pss_load": loaded["Pss"] - before["Pss"], "anon_load": loaded["Anonymous"] - before["Anonymous"],
              "tied": None if output_embeddings is None else
              output_embeddings.weight is model.get_input_embeddings().weight}
    if weights is not None:
        report["outside"] = [n for n, p in model.named_parameters() if not weights.owns(p.data_ptr())]
        report["mapped_pss_load"] = mapped(weights, "Pss")
    if mode == "private":
        # Anonymous: pages a write copied. Private_Dirty would also count shmem
        # pages only this process maps at the moment (tests/python/test_torch_load.py).
        copied = mapped(weights, "Anonymous")
        names, report["pass_bytes"] = post_process(model)
        report["pass_copied"] = mapped(weights, "Anonymous") - copied
        report["pass_pages_spanned"] = pages_spanned(weights, names)
    config = model.config
    with open(out_path, "wb") as f:
        f.write(outputs(model, config))
    after = rollup()
    report.update(pss_forward=after["Pss"] - before["Pss"], anon_forward=after["Anonymous"] - before["Anonymous"])
    if weights is not None:
        report["mapped_pss_forward"] = mapped(weights, "Pss")
    print(json.dumps(report), flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main(*sys.argv[1:])
