#!/usr/bin/env bash
# Runs every weightd benchmark and prints one Markdown table.
#
#   tests/bench/run.sh [--quick|--full] [--hugepages] [--only SECTION,...]
#
# --quick (default) takes under 3 minutes on 2 cores once the build, the
# demo checkpoint and the peers' venv exist; --full repeats each measurement
# more. --hugepages (root) also loads into a huge page pool it reserves and
# then releases. --only runs some sections: catalog, load, attach (memory,
# restart, attach, concurrency, and attach-scale), attach-scale (packed
# manifest vs TensorEntry messages, Python vs C++, 64 concurrent, prefault
# vs lazy page touching, on a hugetlb pool too when root), fill (issue 14:
# 4 KiB, THP and hugetlb loads vs cat and vs a bare fill; peak memory),
# writer (a writer's publish, partial updates, publish-to-reattach, partial
# reload), daemon-restart (SIGKILL and restart through the fd store vs a
# full load), layout (a second process attaching a post-processed runtime
# layout vs post-processing the checkpoint itself), peers, peer-seed (a second daemon
# seeded over UCX on loopback TCP vs a TCP stream and cold storage). Builds into
# $WEIGHTD_BENCH_BUILD (default build-bench/), writes checkpoints under it,
# and installs the peers (safetensors, runai-model-streamer, fastsafetensors,
# with torch) into a venv there from PyPI on the first run; WEIGHTD_BENCH_NO_PEERS=1 skips that. Raw numbers:
# $WEIGHTD_BENCH_BUILD/bench-results.json.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${WEIGHTD_BENCH_BUILD:-$root/build-bench}
args=()
only=
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) ;;
    --full|--hugepages) args+=("$1") ;;
    --only) only=${2:-}; [ -n "$only" ] || { echo "$0: --only needs a list" >&2; exit 2; }
            args+=(--only "$only"); shift ;;
    *) echo "usage: $0 [--quick|--full] [--hugepages] [--only catalog,load,fill,attach,attach-scale,writer,daemon-restart,layout,peers,peer-seed]" >&2; exit 2 ;;
  esac
  shift
done

say() { echo "[run.sh] $*" >&2; }

if [ ! -f "$build/build.ninja" ]; then
  say "configuring $build"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >&2
fi
say "building"
targets=(weightd weightctl weightd_bench)
# The Python client's attach rows need its package (skipped, with the reason, without pybind11).
if ninja -C "$build" -t targets all 2>/dev/null | grep -q '^weightd_python:'; then targets+=(weightd_python); fi
ninja -C "$build" "${targets[@]}" >&2

# The peers: one venv under the build dir; a peer that does not install or
# import gets its reason printed in its row.
venv=$build/bench-venv
status='{}'
if [ -n "$only" ] && [[ ",$only," != *,peers,* ]]; then
  :  # the peers' rows are not run
elif [ "${WEIGHTD_BENCH_NO_PEERS:-0}" = 1 ]; then
  status='{"venv": "skipped (WEIGHTD_BENCH_NO_PEERS=1)"}'
else
  if [ ! -x "$venv/bin/python" ]; then
    say "creating $venv"
    python3 -m venv "$venv" >&2 || true
  fi
  if [ ! -x "$venv/bin/python" ]; then
    status='{"venv": "python3 -m venv failed"}'
  else
    declare -A module=([safetensors]=safetensors [runai-model-streamer]=runai_model_streamer
                       [fastsafetensors]=fastsafetensors)
    declare -A mode=([safetensors]="safetensors-load_file safetensors-safe_open" [runai-model-streamer]=runai
                     [fastsafetensors]=fastsafetensors)
    entries=()
    for pkg in safetensors runai-model-streamer fastsafetensors; do
      if ! "$venv/bin/python" -c "import torch, numpy, ${module[$pkg]}" 2>/dev/null; then
        say "pip install $pkg (with torch and numpy; the first time downloads a few GB)"
        if ! log=$("$venv/bin/pip" install -q torch numpy "$pkg" 2>&1); then
          reason="pip install $pkg failed: $(echo "$log" | tail -1 | tr -d '"\\' | cut -c1-120)"
          for m in ${mode[$pkg]}; do entries+=("\"$m\": \"$reason\""); done
          continue
        fi
      fi
      if ! err=$("$venv/bin/python" -c "import torch, numpy, ${module[$pkg]}" 2>&1); then
        reason="import ${module[$pkg]} failed: $(echo "$err" | tail -1 | tr -d '"\\' | cut -c1-120)"
        for m in ${mode[$pkg]}; do entries+=("\"$m\": \"$reason\""); done
      fi
    done
    status="{$(IFS=,; echo "${entries[*]:-}")}"
  fi
fi

exec python3 "$root/tests/bench/bench.py" --build "$build" --peers-status "$status" "${args[@]}"
