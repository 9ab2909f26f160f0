#!/usr/bin/env python3
"""Checks that each layer of common/ and server/ includes only the layers it links.

A layer is one CMake library (or executable) registered with weightd_layer in
CMakeLists.txt; the configure step writes each layer's folders (those of its
sources), the weightd libraries it links ("links") and those its users link
too ("public": PUBLIC and INTERFACE links) to build/layers.json. The rules:

  - every .h and .cc under common/ and server/ lies in exactly one layer's
    folder (a file in no layer's folder is an error: it would be checked
    against nothing);
  - a .cc file may include its own layer and the layers its layer links, and
    what those pass on publicly; a .h file, read by every user of its layer,
    only its own layer and what its layer links publicly, and so on;
  - every #include is checked, "quoted" or <angled>, spelt from the repository
    root or relative to the including file ("../registry/registry.h");
    an include that lands under common/ or server/ outside every layer's
    folder is an error;
  - the links form no cycle (CMake accepts cycles between static libraries).

Run by the build before any layer compiles (target weightd_check_layers), so
a broken rule fails the build with one line per include:
  server/model/model.h:12: includes "server/registry/registry.h" (layer server/registry), but
  weightd_server_model links only common/base, ...: a layer includes only its own headers and the layers it links (server/CMakeLists.txt)
Exit status: 0 when every rule holds, 1 otherwise, 2 on bad input.
"""
import argparse
import json
import os
import re
import sys

INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]+)[>"]', re.MULTILINE)
ROOTS = ("common", "server")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="the repository's top folder")
    ap.add_argument("--layers", required=True, help="layers.json written by the CMake configure step")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    try:
        with open(args.layers) as f:
            layers = json.load(f)
    except (OSError, ValueError) as e:
        print(f"check-layers: cannot read {args.layers}: {e}", file=sys.stderr)
        return 2
    by_target = {l["target"]: l for l in layers}
    owner = {}  # folder -> layer
    for l in layers:
        if not l["dirs"]:
            print(f"check-layers: {l['target']} has no source in the source tree", file=sys.stderr)
            return 2
        for d in l["dirs"]:
            if d in owner:
                print(f"check-layers: {l['target']} and {owner[d]['target']} both have sources in {d}", file=sys.stderr)
                return 2
            if not os.path.isdir(os.path.join(root, d)):
                print(f"check-layers: {l['target']}'s folder {d} does not exist", file=sys.stderr)
                return 2
            owner[d] = l

    def public_closure(target, seen):
        if target in seen or target not in by_target:
            return
        seen.add(target)
        for t in by_target[target]["public"]:
            public_closure(t, seen)

    def usable(l, header):
        """The layers a file of `l` may include: itself, and what it links as CMake propagates it."""
        seen = {l["target"]}
        for t in (l["public"] if header else l["links"]):
            public_closure(t, seen)
        return seen

    errors = []
    # Links that come back to their layer.
    for l in layers:
        seen, stack = set(), list(l["links"])
        while stack:
            t = stack.pop()
            if t in seen or t not in by_target:
                continue
            seen.add(t)
            stack.extend(by_target[t]["links"])
        if l["target"] in seen:
            errors.append(f"{l['target']}: its links lead back to it; layers link only the layers below them")

    files = 0
    for top in ROOTS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames.sort()
            for name in sorted(filenames):
                if not name.endswith((".h", ".cc")):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                l = owner.get(os.path.dirname(rel))
                if l is None:
                    errors.append(f"{rel}: in no layer's folder; add it to a layer's sources (CMakeLists.txt)")
                    continue
                files += 1
                header = name.endswith(".h")
                allowed = usable(l, header)
                with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                    text = f.read()
                for m in INCLUDE.finditer(text):
                    spelt = m.group(2).strip()
                    # As the compiler looks: beside the including file first
                    # for "quoted" includes, then from the root (every
                    # layer's include path).
                    candidates = []
                    if m.group(1) == '"':
                        candidates.append(os.path.normpath(os.path.join(os.path.dirname(rel), spelt)))
                    candidates.append(os.path.normpath(spelt))
                    included = next((c for c in candidates if os.path.isfile(os.path.join(root, c))), candidates[-1])
                    if included.split(os.sep)[0] not in ROOTS:
                        continue  # the standard library, a dependency, generated code
                    line = text.count("\n", 0, m.start()) + 1
                    target = owner.get(os.path.dirname(included))
                    if target is None:
                        errors.append(f'{rel}:{line}: includes "{spelt}" ({included}), which is in no layer\'s folder')
                        continue
                    if target["target"] in allowed:
                        continue
                    others = sorted(by_target[t]["dirs"][0] for t in allowed if t != l["target"])
                    below = f"only {', '.join(others)}" if others else "no other layer"
                    how = " publicly (a header is read by every user of its layer)" if header else ""
                    cmake = os.path.join(rel.split(os.sep)[0], "CMakeLists.txt")
                    errors.append(
                        f'{rel}:{line}: includes "{spelt}" (layer {target["dirs"][0]}), but {l["target"]} '
                        f"links {below}{how}: a layer includes only its own headers and the layers it links "
                        f"({cmake})")
    for e in errors:
        print(e, file=sys.stderr)
    if errors:
        print(f"check-layers: {len(errors)} problem(s) with the layering", file=sys.stderr)
        return 1
    print(f"check-layers: {len(layers)} layers, {files} files: every include is of a layer linked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
