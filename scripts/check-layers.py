#!/usr/bin/env python3
"""Checks that each layer of common/ and server/ includes only the layers it links.

A layer is one CMake library whose sources lie in one folder (weightd_layer in
CMakeLists.txt registers it; the build writes each layer's folder and the
weightd libraries it links to build/layers.json). A file belongs to the layer
whose folder is the longest prefix of its path. A layer may include, with
#include "common/..." or #include "server/...", its own headers and those of
the layers it links, directly or through the layers they link; any other
include is an upward (or sideways) dependency the link graph does not have.

Run by the build before any layer compiles (target weightd_check_layers), so
such an include fails the build with one line per include:
  server/model/model.h:12: includes "server/registry/registry.h" (layer server/registry), but
  weightd_server_model links only common/base, ...: a layer includes only the layers it links (server/CMakeLists.txt)
Exit status: 0 when every include keeps to the rule, 1 otherwise, 2 on bad input.
"""
import argparse
import json
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"((?:common|server)/[^"]+)"', re.MULTILINE)


def layer_of(path, layers_by_dir):
    """The layer whose folder is the longest prefix of `path` (a repo-relative file), or None."""
    d = os.path.dirname(path)
    while d:
        if d in layers_by_dir:
            return layers_by_dir[d]
        d = os.path.dirname(d)
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="the repository's top folder")
    ap.add_argument("--layers", required=True, help="layers.json written by the CMake configure step")
    args = ap.parse_args()
    try:
        with open(args.layers) as f:
            layers = json.load(f)
    except (OSError, ValueError) as e:
        print(f"check-layers: cannot read {args.layers}: {e}", file=sys.stderr)
        return 2
    by_target = {l["target"]: l for l in layers}
    by_dir = {}
    for l in layers:
        if l["dir"] in by_dir:
            print(f"check-layers: {l['target']} and {by_dir[l['dir']]['target']} share the folder {l['dir']}",
                  file=sys.stderr)
            return 2
        by_dir[l["dir"]] = l

    def reachable(target):
        seen, stack = set(), [target]
        while stack:
            t = stack.pop()
            if t in seen or t not in by_target:
                continue
            seen.add(t)
            stack.extend(by_target[t]["links"])
        return seen

    errors = []
    files = 0
    for l in sorted(layers, key=lambda l: l["dir"]):
        allowed = {by_target[t]["dir"] for t in reachable(l["target"])}
        top = os.path.join(args.root, l["dir"])
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            for name in sorted(filenames):
                if not name.endswith((".h", ".cc")):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), args.root)
                if layer_of(rel, by_dir) is not l:
                    continue  # a file of a layer in a sub-folder
                files += 1
                with open(os.path.join(args.root, rel), encoding="utf-8", errors="replace") as f:
                    text = f.read()
                for m in INCLUDE.finditer(text):
                    included = m.group(1)
                    owner = layer_of(included, by_dir)
                    if owner is None or owner["dir"] in allowed:
                        continue
                    line = text.count("\n", 0, m.start()) + 1
                    others = sorted(allowed - {l["dir"]})
                    below = f"only {', '.join(others)}" if others else "no other layer"
                    cmake = os.path.join(l["dir"].split("/")[0], "CMakeLists.txt")
                    errors.append(
                        f'{rel}:{line}: includes "{included}" (layer {owner["dir"]}), but {l["target"]} '
                        f"links {below}: a layer includes only its own headers and the layers it links "
                        f"({cmake})")
    for e in errors:
        print(e, file=sys.stderr)
    if errors:
        print(f"check-layers: {len(errors)} include(s) break the layering", file=sys.stderr)
        return 1
    print(f"check-layers: {len(layers)} layers, {files} files: every include is of a layer linked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
