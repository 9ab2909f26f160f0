"""The Python client's attach latency, for tests/bench/bench.py: milliseconds
from client.attach() to a Model (its name index is built by the first lookup,
timed apart as first_lookup_ms), each run on a client whose channel is
already up. Run under the Python the package was
built for, with PYTHONPATH at the build's client/python. Prints one JSON line.

    py_attach.py --socket S --name N [--runs K] [--entries] [--prefault]
"""
import argparse
import json
import time

import weightd


def percentiles(xs):
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, max(0, int(round(q * len(xs) + 0.5)) - 1))]  # nearest rank
    return {"n": len(xs), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "min": xs[0], "max": xs[-1]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--entries", action="store_true", help="ask for TensorEntry messages (the old encoding)")
    ap.add_argument("--prefault", action="store_true")
    args = ap.parse_args()
    ms, lookup_ms, tensors = [], [], 0
    for _ in range(args.runs):
        client = weightd.connect(args.socket)
        client.list()  # the channel is up: attach is what gets timed
        start = time.perf_counter()
        model = client._attach(args.name, prefault=args.prefault, packed=not args.entries)
        ms.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        "-" in model  # the first lookup builds the name index
        lookup_ms.append((time.perf_counter() - start) * 1e3)
        tensors = len(model)
        model.close()
        client.close()
    print(json.dumps({"tensors": tensors, "ms": percentiles(ms), "first_lookup_ms": percentiles(lookup_ms)}))


if __name__ == "__main__":
    main()
