#!/usr/bin/env bash
# Boots Debian in systemd-nspawn (a real systemd as the container's PID 1),
# installs weightd as docs/operations.md "Install on Debian 12" does, with the
# shipped unit deploy/systemd/weightd.service unchanged and no drop-in, and
# checks every row of the restart table in docs/operations.md "Restart,
# upgrade and crash" that one node can show: a crash (SIGSEGV, SIGKILL), a
# watchdog kill, `systemctl restart` (and how long it takes), `systemctl
# reload` (also to a replaced binary and to unrunnable ones), `kill -HUP`, a
# dropped model root, `systemctl stop` + `start`, and `kill -TERM`. Prints a
# Markdown table, one row per check, on stdout and the time of each phase on
# stderr; exits 1 when a check fails. Where nspawn cannot boot (not root, no
# cgroups, not Debian, no archive) it prints `test-systemd: SKIP: <reason>`
# and exits 0.
#
# Needs root and the binaries in $WEIGHTD_BUILD_DIR (default build/). The
# container's root, Debian minbase with systemd and the packages of the
# libraries the binaries link (dpkg -S), is cached in $WEIGHTD_NSPAWN_CACHE
# (default /var/cache/weightd-nspawn): the first run makes it with debootstrap
# (about 80 s), later runs copy it and boot the copy, so a run never changes
# the cache. The container has only loopback (--private-network).
# $WEIGHTD_NSPAWN_PRESET picks the demo preset of the second model (tiny,
# small (default), llama-1b); $WEIGHTD_NSPAWN_RESTARTS how many `systemctl
# restart` the restart time is the median of (default 5).
set -euo pipefail
cd "$(dirname "$0")/.."
umask 022

cache=${WEIGHTD_NSPAWN_CACHE:-/var/cache/weightd-nspawn}
build=${WEIGHTD_BUILD_DIR:-build}
preset=${WEIGHTD_NSPAWN_PRESET:-small}
restarts=${WEIGHTD_NSPAWN_RESTARTS:-5}
machine="weightd-test-$$"
work="" nspawn_pid="" leader="" root=""

say() { echo "test-systemd: $*" >&2; }
skip() { echo "test-systemd: SKIP: $*"; exit 0; }
die() { say "error: $*"; exit 1; }

now_ms() { echo $(($(date +%s%N) / 1000000)); }
started_ms=$(now_ms) phase_ms=$(now_ms)
secs() { if [ "$1" -lt 0 ]; then echo "not READY"; else printf '%d.%02d s' $(($1 / 1000)) $(($1 % 1000 / 10)); fi; }
phase() {  # phase NAME: how long since the last phase ended, on stderr
  local t; t=$(now_ms)
  say "time: $1: $(secs $((t - phase_ms)))"
  phase_ms=$t
}

cleanup() {
  if [ -n "$nspawn_pid" ] && kill -0 "$nspawn_pid" 2>/dev/null; then
    kill -TERM "$nspawn_pid"  # the container powers off
    for _ in $(seq 150); do kill -0 "$nspawn_pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$nspawn_pid" 2>/dev/null || true
    wait "$nspawn_pid" 2>/dev/null || true
    phase "power off"
  fi
  [ -z "$work" ] || { rm -rf "$work"; phase "remove $work"; }
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- the host: what nspawn needs, and where the container comes from ----

host_codename() {  # the host's Debian release: the binaries link its libraries
  # shellcheck disable=SC1091 # the host's file
  (. /etc/os-release && [ "${ID:-}" = debian ] && echo "${VERSION_CODENAME:-}") || true
}

apt_mirror() {  # the host's Debian archive, from its apt sources
  local uri
  uri=$(sed -n 's/^URIs:[[:space:]]*//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null |
        tr ' ' '\n' | grep -v -e security -e '^$' | head -n 1) || true
  [ -n "$uri" ] || uri=$(awk '$1 == "deb" && !/security/ {
        for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) { print $i; exit } }' /etc/apt/sources.list 2>/dev/null) || true
  echo "$uri"
}

binaries=(server/weightd server/weightd-peer-helper client/weightctl)

check_host() {
  [ "$(id -u)" -eq 0 ] || skip "not root (systemd-nspawn needs root)"
  [ -n "$(ls -A /sys/fs/cgroup 2>/dev/null)" ] || skip "no cgroups (/sys/fs/cgroup is empty)"
  codename=$(host_codename)
  [ -n "$codename" ] || skip "the host is not Debian (the container must match its libraries)"
  mirror=${WEIGHTD_NSPAWN_MIRROR:-$(apt_mirror)}
  [ -n "$mirror" ] || skip "no Debian archive in /etc/apt/sources.list{,.d/debian.sources}"
  if ! command -v systemd-nspawn >/dev/null || ! command -v debootstrap >/dev/null; then
    ./scripts/install-deps.sh systemd-container debootstrap || skip "cannot install systemd-container and debootstrap"
  fi
  local f
  for f in "${binaries[@]}"; do
    [ -x "$build/$f" ] || die "no $build/$f: build first (./scripts/build.sh)"
  done
}

# runtime_packages BINARY...: the Debian packages of the libraries they link
# (one dpkg -S for all: each call reads the whole database).
runtime_packages() {
  local lib real p libs=() paths=()
  if ldd "$@" | grep -q 'not found'; then die "a library of $* is not found: $(ldd "$@" | grep 'not found' | head -n 1)"; fi
  mapfile -t libs < <(ldd "$@" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u)
  for lib in "${libs[@]}"; do
    real=$(readlink -f "$lib")
    # merged /usr: dpkg knows each file by one of these names
    for p in "$lib" "$real" "${lib#/usr}" "${real#/usr}" "/usr$lib" "/usr$real"; do paths+=("$p"); done
  done
  local owners
  owners=$(dpkg -S "${paths[@]}" 2>/dev/null) || true
  for lib in "${libs[@]}"; do
    real=$(readlink -f "$lib")
    grep -q -F -e ": $lib" -e ": $real" -e ": ${lib#/usr}" -e ": ${real#/usr}" -e ": /usr$lib" -e ": /usr$real" <<<"$owners" ||
      die "$lib belongs to no Debian package"
  done
  # "pkg:arch, pkg2: path" lines: every package named
  grep -v '^diversion ' <<<"$owners" | sed 's/: [^:]*$//' | tr ',' '\n' | sed 's/^ *//; s/:.*//' | grep . | sort -u
}

missing_packages() {  # missing_packages ROOT PACKAGE...: those not installed in ROOT
  local root=$1 p; shift
  for p in "$@"; do
    dpkg-query --admindir="$root/var/lib/dpkg" -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null | grep -q '^ii' || echo "$p"
  done
}

copy_apt_sources() {  # the host's Debian sources (updates, security): the host's library versions
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    cp /etc/apt/sources.list.d/debian.sources "$1/etc/apt/sources.list.d/"
    : >"$1/etc/apt/sources.list"
  elif [ -f /etc/apt/sources.list ]; then
    cp /etc/apt/sources.list "$1/etc/apt/sources.list"
  fi
}

# The cache holds $cache/root only once it is complete: it is made (or
# completed) as root.tmp and renamed, so a killed run leaves no half root.
prepare_cache() {
  local tmp=$cache/root.tmp missing
  mkdir -p "$cache"
  exec 8>"$cache/lock"
  flock 8
  if [ ! -d "$cache/root" ]; then
    rm -rf "$tmp"
    say "debootstrap $codename from $mirror into $tmp (once; cached)"
    debootstrap --variant=minbase --include=systemd,systemd-sysv,dbus "$codename" "$tmp" "$mirror" \
      >"$work/debootstrap.log" 2>&1 || skip "debootstrap of $codename from $mirror failed: $(tail -n 1 "$work/debootstrap.log")"
    copy_apt_sources "$tmp"
    mv "$tmp" "$cache/root"
  fi
  mapfile -t missing < <(missing_packages "$cache/root" "$@")
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]} into the cached root"
    rm -rf "$tmp"
    mv "$cache/root" "$tmp"
    systemd-nspawn -q -D "$tmp" --register=no --keep-unit --pipe -E DEBIAN_FRONTEND=noninteractive \
      sh -c 'apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@" && apt-get clean' sh "${missing[@]}" \
      >"$work/apt.log" 2>&1 </dev/null || skip "apt-get install in the container failed: $(tail -n 1 "$work/apt.log")"
    mv "$tmp" "$cache/root"
  fi
  flock -u 8
  exec 8>&-
}

# ---- the container: a copy of the cached root with weightd installed ----

install_weightd() {
  root=$work/root
  cp -a "$cache/root" "$root"
  # As docs/operations.md "Install on Debian 12" does.
  chroot "$root" useradd --system --user-group --no-create-home --shell /usr/sbin/nologin weightd
  install -m 0755 "$work/bin/weightd" "$work/bin/weightd-peer-helper" "$work/bin/weightctl" "$root/usr/local/bin/"
  install -D -m 0644 docs/operations.md "$root/usr/local/share/doc/weightd/operations.md"
  install -m 0644 deploy/systemd/weightd.service "$root/etc/systemd/system/"
  install -d -m 0755 "$root/etc/weightd" "$root/srv/models" "$root/srv/other"
  set_model_roots /srv/models /srv/other
  "$work/bin/weightctl" make-demo "$root/srv/models/demo" >/dev/null
  "$work/bin/weightctl" make-demo "$root/srv/models/$preset" --preset "$preset" >/dev/null
  "$work/bin/weightctl" make-demo "$root/srv/other/extra" >/dev/null
}

set_model_roots() {  # the shipped example config (preloads "demo"), with these model roots
  python3 -c 'import json, sys
config = json.load(open("deploy/config.example.json"))
config["model_root"] = sys.argv[1:]
json.dump(config, sys.stdout, indent=2)' "$@" >"$root/etc/weightd/config.json"
}

# --capability=CAP_IPC_LOCK: nspawn's own seccomp filter refuses mlock(2)
# with EPERM to everything in a container without it, which a node does not.
boot() {
  systemd-nspawn -q -D "$root" --keep-unit --register=no -M "$machine" --private-network \
    --capability=CAP_IPC_LOCK -b \
    </dev/null >"$work/boot.log" 2>&1 &
  nspawn_pid=$!
  # The container's PID 1 is nspawn's child once that child runs systemd.
  for _ in $(seq 100); do
    leader=$(pgrep -P "$nspawn_pid" | head -n 1) || true
    [ -z "$leader" ] || [ "$(cat "/proc/$leader/comm" 2>/dev/null)" != systemd ] || break
    kill -0 "$nspawn_pid" 2>/dev/null || skip "systemd-nspawn cannot boot here: $(tail -n 1 "$work/boot.log")"
    leader=""
    sleep 0.1
  done
  [ -n "$leader" ] || skip "systemd-nspawn started no systemd in 10 s: $(tail -n 1 "$work/boot.log")"
  local state=""
  for _ in $(seq 90); do
    state=$(in_ct timeout 5 systemctl is-system-running --wait 2>/dev/null) || true
    case $state in running|degraded) break ;; esac
    sleep 1
  done
  case $state in
    running|degraded) ;;
    *) skip "the container did not boot in 90 s (state '${state:-none}'): $(tail -n 1 "$work/boot.log")" ;;
  esac
}

in_ct() { nsenter -t "$leader" -a -- env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"; }

# in_ct_fn FUNCTION ARG...: runs one of this script's functions in the container.
in_ct_fn() { local fn=$1; shift; in_ct bash -c "$(declare -f "$fn"); $fn \"\$@\"" "$fn" "$@"; }

# ---- what the daemon shows ----

prop() { in_ct systemctl show -p "$1" --value weightd; }
ls_json() { in_ct weightctl ls --json 2>/dev/null || echo '{"models": [], "daemon_instance": "none"}'; }
# "name generation state fingerprint" of every model, sorted; "no answer" when weightctl gets none.
models() {
  ls_json | python3 -c 'import json, sys
doc = json.load(sys.stdin)
if doc["daemon_instance"] == "none": print("no answer")
for m in sorted(doc["models"], key=lambda m: m["name"]):
    print(m["name"], m["generation"], m["state"], m["fingerprint"])'
}
# models_from SOURCE: "yes" when every model came from SOURCE ("fd store", "storage"), else what they came from.
models_from() {
  ls_json | python3 -c 'import json, sys
models = json.load(sys.stdin)["models"]
bad = ["%s from %s" % (m["name"], m["source"] or "-") for m in models if m["source"] != sys.argv[1]]
print("yes" if models and not bad else ", ".join(bad) or "no models")' "$1"
}
names() { models | awk '{ print $1 }' | tr '\n' ' ' | sed 's/ $//'; }
host_bytes() {  # host_bytes NAME
  ls_json | python3 -c 'import json, sys
print(sum(m["host_bytes"] for m in json.load(sys.stdin)["models"] if m["name"] == sys.argv[1]))' "$1"
}
cursor() { in_ct journalctl -q -n 1 --show-cursor -o cat | sed -n 's/^-- cursor: //p'; }
log_since() { in_ct journalctl -q -u weightd --after-cursor="$1" -o cat; }
# log_waits CURSOR PATTERN: the unit's log since CURSOR, once it has a line matching PATTERN (at most 10 s).
log_waits() {
  local log
  for _ in $(seq 50); do
    log=$(log_since "$1")
    if grep -q -- "$2" <<<"$log"; then echo "$log"; return 0; fi
    sleep 0.2
  done
  echo "$log"
  return 1
}
instance() { in_ct weightctl ls --json 2>/dev/null | sed -n 's/^ *"daemon_instance": *"\([^"]*\)".*/\1/p'; }

# Runs in the container: ready_after WANT OLD_INSTANCE LIMIT_S CMD... runs
# CMD and prints "MS RC": the milliseconds until `weightctl ls` answers from
# a daemon instance other than OLD_INSTANCE ("-": any) with WANT models
# READY, and CMD's exit status; "-1 RC" when that took more than LIMIT_S
# seconds or the unit went inactive or failed instead.
ready_after() {
  local want=$1 old=$2 limit=$3 rc=0 t0 out; shift 3
  t0=$(date +%s%N)
  "$@" >&2 || rc=$?
  while :; do
    out=$(weightctl ls --json 2>/dev/null) || out=""
    if [ -n "$out" ] && { [ "$old" = - ] || ! grep -q "\"daemon_instance\": \"$old\"" <<<"$out"; }; then
      [ "$(grep -c '"state": "READY"' <<<"$out")" -lt "$want" ] || break
    fi
    case $(systemctl show -p ActiveState --value weightd) in inactive|failed) echo "-1 $rc"; return ;; esac
    [ $(($(date +%s%N) - t0)) -lt $((limit * 1000000000)) ] || { echo "-1 $rc"; return; }
    sleep 0.01
  done
  echo "$((($(date +%s%N) - t0) / 1000000)) $rc"
}

# ---- results ----

problems=() rows=() failed=0
need() { local what=$1; shift; "$@" || problems+=("$what"); }
row() {  # row CHECK DOCUMENTED MEASURED: PASS unless a need failed since the last row
  local result=PASS
  if [ ${#problems[@]} -gt 0 ]; then
    result="FAIL: $(IFS=';'; echo "${problems[*]}")"
    failed=$((failed + 1))
  fi
  rows+=("| $1 | $2 | $result | $3 |")
  say "$result: $1 ($3)"
  problems=()
}
median() { if [ $# -eq 0 ]; then echo "?"; else printf '%s\n' "$@" | sort -n | sed -n "$((($# + 1) / 2))p"; fi; }
has() { grep -q -- "$2" <<<"$1"; }
has_not() { ! grep -q -- "$2" <<<"$1"; }
count() { grep -c -- "$2" <<<"$1" || true; }
eq() { [ "$1" = "$2" ]; }
ne() { [ "$1" != "$2" ]; }
signum() { kill -l "$1"; }

# restored_all LOG MODELS: every model of MODELS (as `models` prints them)
# restored from the fd store without reading the checkpoint, its record
# authenticated (no host tensor hashed again).
restored_all() {
  local name gen _
  [ -n "$2" ] || return 1
  while read -r name gen _; do
    grep -q "restored '$name' generation $gen from the fd store in [0-9.]* ms without reading the checkpoint (record authenticated by its HMAC)" <<<"$1" || return 1
  done <<<"$2"
}
# the checkpoints of the models not preloaded (the preload of "demo" reads
# its headers again after each start, finds it unchanged and keeps it)
checkpoints() { find "$root/srv/models/$preset" "$root/srv/other" -type f; }
unreadable() { checkpoints | xargs chmod "$1"; }

# ---- the checks ----

expected=""  # the names the checks expect READY, sorted
load_models() {  # loads those of $expected that are not READY (demo is preloaded)
  local name
  for name in $expected; do
    [ "$name" != demo ] || continue
    models | grep -q "^$name [0-9]* READY " && continue
    case $name in
      extra) in_ct weightctl load extra /srv/other/extra >/dev/null ;;
      *) in_ct weightctl load "$name" "/srv/models/$name" >/dev/null ;;
    esac
  done
  in_ct_fn ready_after "$(wc -w <<<"$expected")" - 60 true >/dev/null
}

# check FUNCTION ARG...: runs one check on a daemon serving $expected,
# started again first when an earlier check left it down.
check() {
  if [ "$(prop ActiveState)" != active ]; then
    say "starting weightd again for $*"
    in_ct systemctl reset-failed weightd
    in_ct systemctl start weightd || die "weightd does not start"
  fi
  [ "$(models | grep -c ' READY ')" = "$(wc -w <<<"$expected")" ] || load_models
  need "before the check: models $(names), not $expected" eq "$(models | awk '$3 == "READY" { print $1 }' | tr '\n' ' ' | sed 's/ $//')" "$expected"
  "$@"
  phase "$*"
}

check_crash() {  # check_crash SIGNAL: the daemon dies of SIGNAL, systemd restarts it
  local before pid c n out log want
  before=$(models) pid=$(prop MainPID) c=$(cursor) n=$(prop NRestarts) want=$(wc -w <<<"$expected")
  unreadable 000
  out=$(in_ct_fn ready_after "$want" "$(instance)" 30 kill -"$1" "$pid")
  log=$(log_waits "$c" 'fd store: .* models restored') || true
  unreadable 0644
  need "no 'status=$(signum "$1")/$1' from systemd" has "$log" "Main process exited, code=[a-z]*, status=$(signum "$1")/$1"
  need "not restarted by systemd (NRestarts $n, then $(prop NRestarts))" eq "$(prop NRestarts)" $((n + 1))
  need "main PID still $pid" ne "$(prop MainPID)" "$pid"
  need "models now: $(models | tr '\n' ,)" eq "$(models)" "$before"
  need "not every model from the fd store: $(models_from 'fd store')" eq "$(models_from 'fd store')" yes
  need "no 'restored ... without reading the checkpoint (record authenticated ...)' for every model" restored_all "$log" "$before"
  need "no '$want models restored, 0 records dropped'" has "$log" "fd store: [0-9]* fds passed, $want models restored, 0 records dropped"
  row "kill -$1 of the main PID (a crash)" "restarted (\`Restart=on-failure\`) with every READY model" \
    "$(secs "${out% *}") to READY, \`RestartSec=2s\` included; the checkpoints of $preset and extra unreadable meanwhile"
}

check_watchdog() {  # SIGSTOP: the daemon stops answering and sending WATCHDOG=1
  local before pid c n out log want
  before=$(models) pid=$(prop MainPID) c=$(cursor) n=$(prop NRestarts) want=$(wc -w <<<"$expected")
  out=$(in_ct_fn ready_after "$want" "$(instance)" 75 kill -STOP "$pid")
  log=$(log_waits "$c" 'fd store: .* models restored') || true
  need "no 'Watchdog timeout' from systemd" has "$log" "Watchdog timeout (limit $(prop WatchdogUSec))"
  need "no 'status=6/ABRT' from systemd" has "$log" 'Main process exited, code=[a-z]*, status=6/ABRT'
  need "not restarted by systemd (NRestarts $n, then $(prop NRestarts))" eq "$(prop NRestarts)" $((n + 1))
  need "main PID still $pid" ne "$(prop MainPID)" "$pid"
  need "models now: $(models | tr '\n' ,)" eq "$(models)" "$before"
  need "not every model from the fd store: $(models_from 'fd store')" eq "$(models_from 'fd store')" yes
  need "no 'restored ... (record authenticated ...)' for every model" restored_all "$log" "$before"
  need "no '$want models restored, 0 records dropped'" has "$log" "$want models restored, 0 records dropped"
  row "kill -STOP of the main PID (watchdog, \`WatchdogSec=$(prop WatchdogUSec)\`)" \
    "the watchdog kills it (SIGABRT); restarted with every READY model" "$(secs "${out% *}") from SIGSTOP to READY"
}

check_restart() {  # $restarts times, timed
  local before c out log want pid times=() restore=() m r locked
  before=$(models) c=$(cursor) want=$(wc -w <<<"$expected")
  for _ in $(seq "$restarts"); do
    # Restarts in a row would hit systemd's start limit (StartLimitBurst=5
    # per StartLimitIntervalSec=10s), which a reset-failed resets.
    in_ct systemctl reset-failed weightd
    pid=$(prop MainPID) locked=$(wait_pinned)
    out=$(in_ct_fn ready_after "$want" "$(instance)" 30 systemctl restart weightd)
    need "systemctl restart exited ${out#* }" eq "${out#* }" 0
    need "main PID still $pid" ne "$(prop MainPID)" "$pid"
    times+=("${out% *}")
  done
  log=$(log_since "$c")
  need "models now: $(models | tr '\n' ,)" eq "$(models)" "$before"
  need "not every model from the fd store: $(models_from 'fd store')" eq "$(models_from 'fd store')" yes
  need "not $restarts x '$want models restored, 0 records dropped'" \
    eq "$(count "$log" "fd store: [0-9]* fds passed, $want models restored, 0 records dropped")" "$restarts"
  need "not $restarts x $want records authenticated" \
    eq "$(count "$log" "from the fd store in [0-9.]* ms without reading the checkpoint (record authenticated by its HMAC)")" \
    $((restarts * want))
  # The daemon's own time: "fd store: N fds passed, M models restored, 0 records dropped, in X ms".
  mapfile -t restore < <(sed -n 's/.* fd store: .* records dropped, in \([0-9.]*\) ms$/\1/p' <<<"$log")
  need "not $restarts x 'fd store: ... in X ms'" eq "${#restore[@]}" "$restarts"
  m=$(median "${times[@]}")
  r=$(median "${restore[@]}")
  restart_summary="median $(secs "$m") from \`systemctl restart\` until \`weightctl ls\` shows $want READY ($(printf '%s\n' "${times[@]}" | sort -n | tr '\n' ' ' | sed 's/ $//') ms); the daemon logged restoring them in median $r ms"
  row "\`systemctl restart weightd\` ($restarts times, $want models, $(host_mib) MiB, $locked MiB mlock()ed before each)" \
    "every READY model kept (the store lives while a job is queued for the unit)" "$restart_summary"
}
host_mib() { local b=0 n; for n in $expected; do b=$((b + $(host_bytes "$n"))); done; echo $((b / 1048576)); }
# wait_pinned: until the running image (the main PID's log since its last
# `listening on`) has pinned each model of $expected or said why it could
# not ("only N of M host bytes ... are mlock()ed": RLIMIT_MEMLOCK), at most
# 60 s, as on a node between restarts; prints the MiB locked.
wait_pinned() {
  local log name done_all
  for _ in $(seq 300); do
    # shellcheck disable=SC2016 # sed's own $ (the last line)
    log=$(in_ct journalctl -q _PID="$(prop MainPID)" -o cat |
          sed -n '/listening on unix:/h; /listening on unix:/!H; ${x;p}') done_all=1
    for name in $expected; do
      grep -q -e "pinned '$name' generation" -e "of '$name' generation [0-9]* are mlock()ed" <<<"$log" || done_all=0
    done
    [ "$done_all" = 0 ] || break
    sleep 0.2
  done
  [ "$done_all" = 1 ] || say "warning: not every model pinned (or refused) within 60 s"
  ls_json | python3 -c 'import json, sys
print(sum(m["locked_bytes"] for m in json.load(sys.stdin)["models"]) // 1048576)'
}

check_reload() {  # three times
  local before pid c out log want times=()
  before=$(models) pid=$(prop MainPID) c=$(cursor) want=$(wc -w <<<"$expected")
  for _ in 1 2 3; do
    wait_pinned >/dev/null
    out=$(in_ct_fn ready_after "$want" - 60 systemctl reload weightd)
    need "systemctl reload exited ${out#* }" eq "${out#* }" 0
    times+=("${out% *}")
  done
  log=$(log_since "$c")
  need "main PID now $(prop MainPID), not $pid" eq "$(prop MainPID)" "$pid"
  need "unit $(prop ActiveState)" eq "$(prop ActiveState)" active
  need "models now: $(models | tr '\n' ,)" eq "$(models)" "$before"
  need "not 3 x 'upgraded in place ...: $want of $want READY models kept'" \
    eq "$(count "$log" "upgraded in place to /usr/local/bin/weightd in [0-9.]* s: $want of $want READY models kept")" 3
  need "not 3 x '$want models restored, 0 records dropped'" \
    eq "$(count "$log" "fd store: [0-9]* fds passed, $want models restored, 0 records dropped")" 3
  row "\`systemctl reload weightd\` (3 times)" "every READY model kept, same pid" \
    "median $(secs "$(median "${times[@]}")") ($(printf '%s\n' "${times[@]}" | sort -n | tr '\n' ' ' | sed 's/ $//') ms)"
}

check_hup() {
  local before pid c out log want
  before=$(models) pid=$(prop MainPID) c=$(cursor) want=$(wc -w <<<"$expected")
  out=$(in_ct_fn ready_after "$want" "$(instance)" 60 kill -HUP "$pid")
  log=$(log_waits "$c" 'fd store: .* models restored') || true
  need "main PID now $(prop MainPID), not $pid" eq "$(prop MainPID)" "$pid"
  need "unit $(prop ActiveState)" eq "$(prop ActiveState)" active
  need "no 'SIGHUP: upgrading in place'" has "$log" 'SIGHUP: upgrading in place: stopping, then executing /usr/local/bin/weightd'
  need "models now: $(models | tr '\n' ,)" eq "$(models)" "$before"
  need "no '$want models restored, 0 records dropped'" has "$log" "$want models restored, 0 records dropped"
  row "\`kill -HUP\` of the main PID" "every READY model kept, same pid" "$(secs "${out% *}") to READY"
}

# replace_binary FILE: renames FILE over the unit's binary, as a package manager does.
replace_binary() { mv -f "$1" "$root/usr/local/bin/weightd"; }
exe_inode() { in_ct stat -L -c %i "/proc/$(prop MainPID)/exe"; }

check_reload_replaced() {
  local before pid out inode c want
  before=$(models) pid=$(prop MainPID) c=$(cursor) want=$(wc -w <<<"$expected")
  cp "$work/bin/weightd" "$root/usr/local/bin/.weightd.new"
  replace_binary "$root/usr/local/bin/.weightd.new"
  inode=$(stat -c %i "$root/usr/local/bin/weightd")
  need "the daemon runs the new file before the reload" ne "$(exe_inode)" "$inode"
  out=$(in_ct_fn ready_after "$want" - 60 systemctl reload weightd)
  need "systemctl reload exited ${out#* }" eq "${out#* }" 0
  need "main PID now $(prop MainPID), not $pid" eq "$(prop MainPID)" "$pid"
  need "the daemon runs inode $(exe_inode), not the new file's $inode" eq "$(exe_inode)" "$inode"
  need "models now: $(models | tr '\n' ,)" eq "$(models)" "$before"
  need "no 'upgraded in place ...: $want of $want READY models kept'" \
    has "$(log_since "$c")" "upgraded in place to /usr/local/bin/weightd in [0-9.]* s: $want of $want READY models kept"
  row "\`systemctl reload\` to a replaced binary (a new file renamed over it)" \
    "every READY model kept, same pid; the new binary runs" "$(secs "${out% *}")"
}

# check_reload_unrunnable WHAT STATUS EXPECTED_LOG: the binary at the unit's
# path is unrunnable (or held open for writing); `systemctl reload` must
# fail, weightctl upgrade (ExecReload=) with STATUS, and the daemon serve on.
check_reload_unrunnable() {
  local before pid inode c out log want
  before=$(models) pid=$(prop MainPID) inode=$(exe_inode) c=$(cursor) want=$(wc -w <<<"$expected")
  out=$(in_ct_fn ready_after "$want" - 60 systemctl reload weightd 2>/dev/null)
  log=$(log_waits "$c" "Reload failed") || true
  need "systemctl reload exited ${out#* }" ne "${out#* }" 0
  need "no 'Control process exited, code=exited, status=$2/' (weightctl upgrade)" \
    has "$log" "Control process exited, code=exited, status=$2/"
  need "no '$3' in the log" has "$log" "$3"
  need "main PID now $(prop MainPID), not $pid" eq "$(prop MainPID)" "$pid"
  need "the daemon runs inode $(exe_inode), not $inode" eq "$(exe_inode)" "$inode"
  need "unit $(prop ActiveState)" eq "$(prop ActiveState)" active
  need "not READY within 60 s" ne "${out% *}" -1
  need "models now: $(models | tr '\n' ,)" eq "$(models)" "$before"
  row "\`systemctl reload\` to $1" "fails; every READY model kept on the running binary" \
    "$(secs "${out% *}") to fail; weightctl upgrade exited $2"
}

check_unrunnable() {
  local bin=$root/usr/local/bin
  printf '#!/bin/sh\nexit 0\n' >"$bin/.weightd.new"
  chmod 0755 "$bin/.weightd.new"
  replace_binary "$bin/.weightd.new"
  check_reload_unrunnable "a shell script" 2 \
    'cannot upgrade in place: /usr/local/bin/weightd is not an ELF executable (execve(2) would fail with ENOEXEC)'
  # 64 KiB ends inside the first loaded segment.
  head -c 65536 "$work/bin/weightd" >"$bin/.weightd.new"
  chmod 0755 "$bin/.weightd.new"
  replace_binary "$bin/.weightd.new"
  check_reload_unrunnable "an ELF truncated to 64 KiB" 2 \
    'cannot upgrade in place: /usr/local/bin/weightd is truncated: a segment ends at byte'
  # A good binary that a writer still holds open: execve fails with ETXTBSY
  # after the checks passed, so the daemon executes its running image again.
  cp "$work/bin/weightd" "$bin/.weightd.new"
  replace_binary "$bin/.weightd.new"
  exec 9>>"$bin/weightd"
  check_reload_unrunnable "a binary held open for writing (ETXTBSY)" 1 \
    'started again on the running binary: the in-place upgrade failed: execve /usr/local/bin/weightd: .*busy'
  exec 9>&-
  local out pid c want
  pid=$(prop MainPID) c=$(cursor) want=$(wc -w <<<"$expected")
  out=$(in_ct_fn ready_after "$want" - 60 systemctl reload weightd)
  need "systemctl reload exited ${out#* }" eq "${out#* }" 0
  need "main PID now $(prop MainPID), not $pid" eq "$(prop MainPID)" "$pid"
  need "the daemon runs inode $(exe_inode), not the good binary's" eq "$(exe_inode)" "$(stat -c %i "$bin/weightd")"
  need "no 'upgraded in place ...: $want of $want READY models kept'" \
    has "$(log_since "$c")" "upgraded in place to /usr/local/bin/weightd in [0-9.]* s: $want of $want READY models kept"
  row "\`systemctl reload\` once the writer closed it" "every READY model kept; the new binary runs" "$(secs "${out% *}")"
}

check_dropped_root() {
  local before c out log fds
  before=$(models | grep -v '^extra ') c=$(cursor) fds=$(prop NFileDescriptorStore)
  set_model_roots /srv/models
  out=$(in_ct_fn ready_after 2 "$(instance)" 30 systemctl restart weightd)
  log=$(log_waits "$c" 'fd store: .* models restored') || true
  need "no 'dropped record ... of 'extra' (outside_model_roots)'" \
    has "$log" "fd store: dropped record wd-rec-[0-9]* of 'extra' (outside_model_roots): /srv/other/extra is under no --model-root"
  need "not '2 models restored, 1 records dropped'" has "$log" 'fd store: [0-9]* fds passed, 2 models restored, 1 records dropped'
  need "models now: $(models | tr '\n' ,)" eq "$(models)" "$before"
  need "the store holds $(prop NFileDescriptorStore) fds, not fewer than $fds" [ "$(prop NFileDescriptorStore)" -lt "$fds" ]
  c=$(cursor)
  in_ct systemctl restart weightd
  log=$(log_waits "$c" 'fd store: .* models restored') || true
  need "the dropped record's fds stayed in the store" has "$log" '2 models restored, 0 records dropped'
  row "restart after the config dropped the model root of 'extra'" \
    "'extra' dropped at start (\`outside_model_roots\`), the rest kept; its fds leave the store" \
    "$(secs "${out% *}") to READY; store $fds fds, then $(prop NFileDescriptorStore)"
}

# started_empty ROW DOCUMENTED CURSOR MEASURED: the daemon started since
# CURSOR restored nothing and loaded "demo" (its preload) from the checkpoint.
started_empty() {
  local log
  log=$(log_waits "$3" "loaded 'demo' generation 1") || true
  need "it restored something" has_not "$log" 'from the fd store'
  need "no 'loaded 'demo' generation 1' (its preload)" has "$log" "loaded 'demo' generation 1"
  need "models now: $(models | cut -d' ' -f1-3 | tr '\n' ,)" eq "$(models | cut -d' ' -f1-3)" "demo 1 READY"
  need "not from storage: $(models_from storage)" eq "$(models_from storage)" yes
  row "$1" "$2" "$4"
}

check_stop_start() {
  local c fds before
  c=$(cursor) before=$(prop NFileDescriptorStore)
  need "only $before fds in the store before stop" [ "$before" -gt 0 ]
  in_ct systemctl stop weightd
  fds=$(prop NFileDescriptorStore)
  need "$fds fds in the store after stop" eq "$fds" 0
  need "/run/weightd (the record key) is still there after stop" in_ct test ! -e /run/weightd
  in_ct systemctl start weightd
  started_empty "\`systemctl stop\`, then \`start\`" "nothing kept: systemd empties the store when the unit goes inactive" \
    "$c" "store $before fds, $fds after stop; 'demo' loaded again"
}

check_term() {
  local pid c state="" log
  pid=$(prop MainPID) c=$(cursor)
  # shellcheck disable=SC2016 # expanded by the bash in the container
  in_ct bash -c 'kill -TERM "$1"' kill "$pid"  # minbase has no /bin/kill
  for _ in $(seq 150); do
    state=$(prop ActiveState)
    case $state in inactive|failed) break ;; esac
    sleep 0.2
  done
  sleep 3  # RestartSec=2s: a restart would have come by now
  # An inactive unit may be unloaded at once (its ExecMainStatus and
  # NRestarts with it): what systemd did is read from its log.
  log=$(log_since "$c")
  need "unit $(prop ActiveState), not inactive" eq "$state/$(prop ActiveState)" inactive/inactive
  need "no 'SIGTERM: shutting down'" has "$log" 'SIGTERM: shutting down'
  need "not 'Deactivated successfully' (exit status 0)" has "$log" 'weightd.service: Deactivated successfully'
  need "'$(grep -m1 'Main process exited' <<<"$log")'" has_not "$log" 'Main process exited'
  need "restarted by systemd" has_not "$log" 'Scheduled restart job'
  need "$(prop NFileDescriptorStore) fds in the store" eq "$(prop NFileDescriptorStore)" 0
  in_ct systemctl start weightd
  started_empty "\`kill -TERM\` of the main PID, then \`systemctl start\`" \
    "exits 0, not restarted, unit inactive, store emptied: nothing kept" "$c" \
    "unit $state, 'Deactivated successfully' (status 0), no restart; 'demo' loaded again"
}

main() {
  check_host
  work=$(mktemp -d "${TMPDIR:-/var/tmp}/weightd-nspawn.XXXXXX")
  mkdir "$work/bin"
  local f
  for f in "${binaries[@]}"; do cp "$build/$f" "$work/bin/"; done
  local packages
  packages=$(runtime_packages "$work"/bin/*)
  # shellcheck disable=SC2086 # one package a word
  prepare_cache $packages
  phase "cache ($cache/root)"
  install_weightd
  phase "install weightd and write the demo checkpoints"
  boot
  phase "boot"
  say "$(in_ct systemctl --version | head -n 1); $(nproc) cores; models demo, $preset, extra"
  in_ct systemctl daemon-reload
  [ -z "$(prop DropInPaths)" ] || die "the unit has drop-ins: $(prop DropInPaths)"
  cmp -s deploy/systemd/weightd.service "$root$(prop FragmentPath)" || die "the unit is not deploy/systemd/weightd.service"
  in_ct systemctl start weightd || { in_ct journalctl -u weightd -n 40 --no-pager >&2; die "weightd did not start"; }
  # The unit asks LimitMEMLOCK=infinity and LimitNOFILE=65536; where the
  # host's own hard limits are lower (no CAP_SYS_RESOURCE), systemd applies those.
  say "weightd runs with $(in_ct cat "/proc/$(prop MainPID)/limits" | awk '/^Max locked memory/ { l = $4 } /^Max open files/ { n = $4 }
    END { print "RLIMIT_MEMLOCK " l ", RLIMIT_NOFILE " n }')"
  expected=$(printf '%s\n' demo extra "$preset" | sort -u | tr '\n' ' ' | sed 's/ $//')
  load_models
  phase "start weightd, load $expected"

  check check_crash SEGV
  check check_crash KILL
  check check_watchdog
  check check_restart
  check check_reload
  check check_hup
  check check_reload_replaced
  check check_unrunnable
  check check_dropped_root
  expected=$(printf '%s\n' demo "$preset" | sort -u | tr '\n' ' ' | sed 's/ $//')
  check check_stop_start
  check check_term

  echo "| check | docs/operations.md says | result | measured |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  local total; total=$(secs $(($(now_ms) - started_ms)))
  if [ "$failed" -gt 0 ]; then
    in_ct journalctl -u weightd -n 80 --no-pager >&2 || true
    say "$failed of ${#rows[@]} checks failed, in $total"
    exit 1
  fi
  say "all ${#rows[@]} checks passed, in $total"
}

main "$@"
