"""Peers of weightd, each in its own process: load every tensor of a
checkpoint into CPU memory with the peer, then read every byte once (numpy
sum of 8-byte words, as weightd_bench's `restart --mode attach-read` does
through weightd). Prints one JSON line {"load_seconds", "seconds" (load +
read), "bytes", "tensors"}. safetensors' load_file and safe_open return
tensors over an mmap of the file, so their load is lazy and the read pays
the page faults; runai-model-streamer and fastsafetensors copy into their
own buffers. Run by tests/bench/bench.py with the bench venv's python.

usage: peers.py MODE CHECKPOINT_DIR
MODE: safetensors-load_file | safetensors-safe_open | runai | fastsafetensors
"""
import glob
import importlib
import resource
import json
import os
import sys
import time


def files_of(path):
    return sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else [path]


def load_file(files):
    from safetensors.torch import load_file
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


def safe_open_all(files):
    from safetensors import safe_open
    out = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def runai(files):
    from runai_model_streamer import SafetensorsStreamer
    out = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(files, device="cpu")
        for name, tensor in streamer.get_tensors():
            out[name] = tensor
    return out


def fastsafetensors(files):
    from fastsafetensors import SafeTensorsFileLoader
    loader = SafeTensorsFileLoader(None, "cpu", nogds=True)
    loader.add_filenames({0: files})
    buffers = loader.copy_files_to_device()
    out = {k: buffers.get_tensor(k) for k in loader.get_keys()}
    return out, (buffers, loader)


MODULES = {"safetensors-load_file": "safetensors.torch", "safetensors-safe_open": "safetensors",
           "runai": "runai_model_streamer", "fastsafetensors": "fastsafetensors"}


def main():
    mode, path = sys.argv[1], sys.argv[2]
    files = files_of(path)
    fn = {"safetensors-load_file": load_file, "safetensors-safe_open": safe_open_all, "runai": runai,
          "fastsafetensors": fastsafetensors}[mode]
    # Imports (torch alone takes seconds) happen before the clock starts.
    torch = importlib.import_module("torch")
    importlib.import_module(MODULES[mode])
    import numpy as np
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    result = fn(files)
    loaded = time.perf_counter()
    tensors = result[0] if isinstance(result, tuple) else result
    nbytes, checksum = 0, 0
    for t in tensors.values():
        raw = t.reshape(-1).view(torch.uint8).numpy()
        words = raw[: raw.size // 8 * 8].view(np.uint64)
        checksum += int(words.sum())
        nbytes += raw.size
    seconds = time.perf_counter() - start
    print(json.dumps({"mode": mode, "load_seconds": loaded - start, "seconds": seconds, "bytes": nbytes,
                      "tensors": len(tensors), "checksum": checksum % (1 << 64),
                      "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}))


if __name__ == "__main__":
    main()
