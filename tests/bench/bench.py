#!/usr/bin/env python3
"""weightd benchmarks: every row measures weightd and its baseline in the same
run and prints one Markdown table (benchmark | weightd | baseline | ratio |
goal | met?). Driven by tests/bench/run.sh, which builds first.

Absolute numbers on shared 2-core machines move from run to run; the ratios
are what the goals are about. Progress goes to stderr, the table to stdout,
and every raw measurement to BUILD/bench-results.json.
"""
import argparse
import glob
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # daemon_restart.py

GIB = 1 << 30
MIB = 1 << 20
RING_BYTES_PER_THREAD = 16 * MIB  # one kReadBlockBytes bounce buffer per load thread (server/load/loader.h)


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_json(argv, timeout=900, **kw):
    """Runs a command that prints one JSON document last on stdout."""
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])}... exited {p.returncode}: {p.stderr.strip()[-400:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def wall(argv, **kw):
    start = time.perf_counter()
    subprocess.run(argv, check=True, **kw)
    return time.perf_counter() - start


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def drop_cache(files):
    """Evicts the files' clean pages from the page cache (no root needed)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def proc_status(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if v.strip().endswith("kB"):
                out[k] = int(v.split()[0]) * 1024
    return out


def meminfo(key):
    """A /proc/meminfo value: bytes for kB fields, a count for the others."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                fields = line.split()
                return int(fields[1]) * (1024 if fields[-1] == "kB" else 1)
    return 0


def memfd_mapping_kb(pid):
    """Pss and private bytes of a process's mappings of weightd memfds."""
    pss = private = 0
    current = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                current = line
            elif "memfd:weightd:" in current:
                if line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
                elif line.startswith(("Private_Clean:", "Private_Dirty:")):
                    private += int(line.split()[1]) * 1024
    return pss, private


def rounds(ratios, digits=2):
    """"LOW-HIGH" of the ratios measured round by round."""
    return f"{min(ratios):.{digits}f}-{max(ratios):.{digits}f}"


def rewrite(path, seed):
    """Rewrites a .safetensors file with the first 4 KiB of its data changed: a new file written
    beside it, synced (so no writeback runs during the measurement) and renamed over it. Returns
    the file's tensor bytes (its size less the header)."""
    tmp = path + ".tmp"
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        header = int.from_bytes(src.read(8), "little")
        src.seek(0)
        while chunk := src.read(16 * MIB):
            dst.write(chunk)
        dst.seek(8 + header)
        dst.write(bytes((seed * 7 + 1 + k) % 256 for k in range(4096)))
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)
    return os.path.getsize(path) - 8 - header


class Daemon:
    """A weightd on a socket of its own, stopped with SIGTERM."""

    def __init__(self, ctx, name, *flags):
        self.socket = os.path.join(ctx.run_dir, f"{name}.sock")
        log_path = os.path.join(ctx.run_dir, f"{name}.log")
        argv = [ctx.weightd, "--socket", self.socket, "--model-root", ctx.data_dir, "--metrics-address", "",
                "--device-backend", "none", *flags]
        self.proc = subprocess.Popen(argv, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
        self.ctx = ctx
        for _ in range(200):
            if os.path.exists(self.socket) and subprocess.run(
                    [ctx.weightctl, "--socket", self.socket, "ls"], capture_output=True).returncode == 0:
                return
            time.sleep(0.05)
        raise RuntimeError(f"weightd {name} did not start: see {log_path}")

    @property
    def pid(self):
        return self.proc.pid

    def bench(self, *args, **kw):
        return run_json([self.ctx.bench, args[0], "--socket", self.socket, *args[1:]], **kw)

    def load(self, name, path, keep=False, runs=1):
        return self.bench("load", "--name", name, "--path", path, "--runs", str(runs),
                          "--keep", "true" if keep else "false")["runs"]

    def unload(self, name):
        subprocess.run([self.ctx.weightctl, "--socket", self.socket, "unload", name, "--force"],
                       capture_output=True)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class hugetlb_pool:
    """Adds `pages` 2 MiB pages to the kernel's hugetlb pool (vm.nr_hugepages) for a block, and
    takes them back on every way out: normal exit, exception, SIGTERM/SIGHUP/SIGINT (turned into
    SystemExit so that __exit__ runs). Adding and taking back (rather than writing an absolute
    value) leaves pages that another user reserved meanwhile in place. Root only: raises OSError
    otherwise, and RuntimeError when the kernel cannot find the pages."""

    PATH = "/proc/sys/vm/nr_hugepages"

    def __init__(self, pages):
        self.pages = pages
        self.added = 0
        self.handlers = {}

    def _write(self, value):
        with open(self.PATH, "w") as f:
            f.write(str(value))

    def __enter__(self):
        if os.geteuid() != 0:
            raise OSError("not root: the hugetlb pool (vm.nr_hugepages) cannot be reserved")
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            self.handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            before = int(open(self.PATH).read())
            self._write(before + self.pages)
            self.added = int(open(self.PATH).read()) - before
            log(f"hugetlb pool: +{self.added} pages (was {before})")
            if self.added < self.pages or meminfo("HugePages_Free") < self.pages:
                raise RuntimeError(f"the kernel found {self.added} of {self.pages} huge pages")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _on_signal(self, signum, frame):
        raise SystemExit(128 + signum)

    def __exit__(self, *exc):
        try:
            if self.added:
                now = int(open(self.PATH).read())
                self._write(max(0, now - self.added))
                log(f"hugetlb pool: -{self.added} pages (now {open(self.PATH).read().strip()})")
                self.added = 0
        finally:
            for sig, handler in self.handlers.items():
                signal.signal(sig, handler)
            self.handlers = {}
        return False


class Table:
    def __init__(self):
        self.rows = []

    def add(self, name, weightd, baseline, ratio, goal, met):
        self.rows.append((name, weightd, baseline, ratio, goal, met))
        log(f"row: {name}: {weightd} | {baseline} | {ratio} | {goal} | {met}")

    def markdown(self):
        lines = ["| benchmark | weightd | baseline | ratio | goal | met? |", "|---|---|---|---|---|---|"]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in self.rows]
        return "\n".join(lines)


def at_least(value, goal, because):
    if value >= goal:
        return "met"
    return f"not met: by {100 * (goal - value) / goal:.0f}%, because {because}"


def at_most(value, goal, because):
    if value <= goal:
        return "met"
    return f"not met: by {100 * (value - goal) / goal:.0f}%, because {because}"


def gbps(bytes_, seconds):
    return bytes_ / seconds / 1e9


class Bench:
    def __init__(self, args):
        self.args = args
        self.quick = not args.full
        b = os.path.abspath(args.build)
        self.build = b
        self.bench = os.path.join(b, "tests/bench/weightd_bench")
        self.weightd = os.path.join(b, "server/weightd")
        self.weightctl = os.path.join(b, "client/weightctl")
        self.data_dir = os.path.join(b, "bench-data")
        os.makedirs(self.data_dir, exist_ok=True)
        self.run_dir = tempfile.mkdtemp(prefix="run-", dir=self.data_dir)  # sockets, logs
        self.table = Table()
        self.raw = {"mode": "quick" if self.quick else "full"}
        self.reps = 3 if self.quick else 7
        self.preset = args.preset
        self.ckpt = os.path.join(self.data_dir, self.preset)
        self.files = []

    def wants(self, section):
        return not self.args.only or section in self.args.only

    # ---------------------------------------------------------------- data
    def prepare(self):
        if not glob.glob(os.path.join(self.ckpt, "*.safetensors")):
            log(f"writing the {self.preset} demo checkpoint (once)")
            subprocess.run([self.weightctl, "make-demo", self.ckpt, "--preset", self.preset], check=True,
                           stdout=subprocess.DEVNULL)
        self.files = sorted(glob.glob(os.path.join(self.ckpt, "*.safetensors")))
        self.ckpt_bytes = sum(os.path.getsize(f) for f in self.files)
        self.attach_models = [(100, 16 * MIB), (1000, 16 * MIB), (10000, 16 * MIB), (100000, 16 * MIB),
                              (1000, 2 * GIB)]
        for n, size in (self.attach_models + [(200000, 200000 * 4)]
                        if self.wants("catalog") or self.wants("attach") or self.wants("attach-scale") else []):
            path = self.synthetic(n, size)
            if not os.path.exists(path):
                run_json([self.bench, "make-checkpoint", "--out", path, "--tensors", str(n), "--bytes", str(size)])

    def synthetic(self, tensors, size):
        return os.path.join(self.data_dir, f"synthetic-{tensors}t-{size // MIB}MiB.safetensors"
                            if size >= MIB else f"synthetic-{tensors}t-{size}B.safetensors")

    # ---------------------------------------------------------------- rows
    def daemon_restart(self):
        """Issue 15: SIGKILL, restart through the fd store, READY again, vs a full load."""
        log("daemon restart through the fd store")
        import daemon_restart
        r = daemon_restart.measure(self, 1 if self.quick else 3)
        self.raw["daemon_restart"] = r
        ratio = r["load_p50"] / r["ready_p50"]
        label = f"{self.preset}, {self.ckpt_bytes / GIB:.2f} GiB"
        self.table.add(f"daemon SIGKILLed and restarted through the fd store, exec to READY=1 ({label}) vs a full load",
                       f"{r['ready_p50'] * 1e3:.0f} ms (restore step {r['restore_ms_p50']:.1f} ms; first `weightctl ls` "
                       f"answered READY at {r['restart_p50'] * 1e3:.0f} ms)",
                       f"{r['load_p50']:.2f} s", f"{ratio:.0f}x", ">= 100x",
                       at_least(ratio, 100, f"starting the binary alone (`weightd --version`) takes "
                                 f"{r['exec_p50'] * 1e3:.0f} ms and gRPC server set-up most of the rest; the restore "
                                 f"itself takes {r['restore_ms_p50']:.1f} ms"))

        log("down time of an upgrade and a restart, metrics on; first attach after a load")
        t = daemon_restart.measure_downtime(self, 3 if self.quick else 5)
        self.raw["downtime"] = t
        n = len(t["upgrade_s"])
        why = ("see the log of each start in the run folder: 'dropped the page tables' is spent still answering, "
               "from 'stopped' to 'listening' not")
        self.table.add(f"`weightctl upgrade` (systemctl reload) with a model loaded, metrics on ({label}): longest "
                       f"interval without an answer, for a client asking every ~1 ms (median of {n}; command to "
                       f"READY {t['upgrade_p50'] * 1e3:.0f} ms) vs the restore step",
                       f"{t['upgrade_down_p50'] * 1e3:.0f} ms", f"{t['restore_ms_p50']:.1f} ms", "-", "<= 300 ms",
                       at_most(t["upgrade_down_p50"], 0.3, why))
        self.table.add(f"SIGTERM, then a start with the stored fds (systemctl restart), metrics on ({label}): longest "
                       f"interval without an answer (median of {n}; signal to READY {t['restart_p50'] * 1e3:.0f} ms) "
                       f"vs the restore step",
                       f"{t['restart_down_p50'] * 1e3:.0f} ms", f"{t['restore_ms_p50']:.1f} ms", "-", "<= 300 ms",
                       at_most(t["restart_down_p50"], 0.3, why))
        ratio = t["first_attach_p50"] / t["later_attach_p50"]
        self.table.add(f"first attach right after a load (pinning under way) vs one after pinning ({label}, "
                       f"fresh process, median of {n})",
                       f"{t['first_attach_p50'] * 1e3:.1f} ms", f"{t['later_attach_p50'] * 1e3:.1f} ms",
                       f"{ratio:.2f}x", "<= 2x", at_most(ratio, 2, "the first attach waits on the pinning thread"))

    def catalog(self):
        path = self.synthetic(200000, 200000 * 4)
        runs = self.reps
        ours = run_json([self.bench, "catalog", "--path", path, "--runs", str(runs)])
        py = ("import json,sys,time\nb=open(sys.argv[1],'rb').read()\nn=int.from_bytes(b[:8],'little')\n"
              "h=b[8:8+n]\nts=[]\nfor _ in range(int(sys.argv[2])):\n t=time.perf_counter();json.loads(h)\n"
              " ts.append(time.perf_counter()-t)\nts.sort();print(ts[len(ts)//2])")
        py_s = float(subprocess.run([sys.executable, "-c", py, path, str(runs)], capture_output=True, text=True,
                                    check=True).stdout)
        s = ours["seconds"]["p50"]
        self.raw["catalog"] = {"weightd": ours, "json_loads_s": py_s, "header_bytes": os.path.getsize(path)}
        self.table.add("catalog: 200,000-tensor header (p50)", f"{s:.3f} s", f"{py_s:.3f} s (Python json.loads)",
                       f"{py_s / s:.2f}x", "< 0.5 s",
                       at_most(s, 0.5, "parsing and validating every entry of the header dominates"))

    def load_warm(self):
        log("load, page cache warm")
        with Daemon(self, "warm") as d:
            ours, cat, mall, fill = [], [], [], []
            for i in range(self.reps):
                subprocess.run(["cat", *self.files], stdout=subprocess.DEVNULL, check=True)  # warm
                ours += d.load(f"warm{i}", self.ckpt)
                with open(os.devnull, "w") as null:
                    cat.append(gbps(self.ckpt_bytes, wall(["cat", *self.files], stdout=null)))
                mall.append(run_json([self.bench, "read-malloc", *self.files])["gbps"])
                fill.append(run_json([self.bench, "memfd-fill", "--bytes", str(self.ckpt_bytes),
                                      "--threads", str(os.cpu_count())])["gbps"])
        w = median([r["gbps"] for r in ours])
        read_s = median([r["phase_start"]["SEAL"] - r["phase_start"]["READ"] for r in ours])
        seal_s = median([r["phase_start"]["DONE"] - r["phase_start"]["SEAL"] for r in ours])
        c, m, f = median(cat), median(mall), median(fill)
        self.raw["load_warm"] = {"weightd": ours, "cat_gbps": cat, "read_malloc_gbps": mall, "memfd_fill_gbps": fill}
        self.warm_gbps = w
        phases = (f"read phase {read_s:.2f} s = {gbps(self.ckpt_bytes, read_s):.2f} GB/s, seal {seal_s:.2f} s; "
                  f"filling fresh memfd pages alone (memfd-fill, no file) runs at {f:.2f} GB/s here")
        label = f"{self.preset}, {self.ckpt_bytes / GIB:.2f} GiB"
        self.table.add(f"load, page cache warm ({label}) vs one thread read() into fresh memory",
                       f"{w:.2f} GB/s", f"{m:.2f} GB/s", f"{w / m:.2f}", ">= 1.0",
                       at_least(w / m, 1.0, f"the load is bound by creating fresh shared pages: {phases}"))
        self.table.add(f"load, page cache warm ({label}) vs cat > /dev/null", f"{w:.2f} GB/s", f"{c:.2f} GB/s",
                       f"{w / c:.2f}", ">= 0.7",
                       at_least(w / c, 0.7, f"cat reuses one 128 KiB buffer and creates no pages; {phases}"))

    def load_cold(self):
        log("load, page cache cold")
        reps = 1 if self.quick else 3
        results = {"on": [], "auto": [], "off": [], "dd": []}
        daemons = {m: Daemon(self, f"cold-{m}", "--direct-io", m) for m in ("on", "auto", "off")}
        try:
            def dd():
                drop_cache(self.files)
                seconds = sum(wall(["dd", f"if={f}", "of=/dev/null", "iflag=direct", "bs=16M", "status=none"])
                              for f in self.files)
                results["dd"].append(gbps(self.ckpt_bytes, seconds))

            for i in range(reps):  # dd before and after: this virtual disk drifts
                dd()
                for mode, d in daemons.items():
                    drop_cache(self.files)
                    results[mode] += d.load(f"cold{i}", self.ckpt)
                dd()
        finally:
            for d in daemons.values():
                d.stop()
        on, auto, off = (median([r["gbps"] for r in results[m]]) for m in ("on", "auto", "off"))
        dd = median(results["dd"])
        self.raw["load_cold"] = results
        read_s = median([r["phase_start"]["SEAL"] - r["phase_start"]["READ"] for r in results["on"]])
        spread = f"dd iflag=direct ran at {min(results['dd']):.2f}-{max(results['dd']):.2f} GB/s within this run"
        self.table.add("load, cold, --direct-io on vs dd iflag=direct bs=16M", f"{on:.2f} GB/s", f"{dd:.2f} GB/s",
                       f"{on / dd:.2f}", ">= 0.9",
                       at_least(on / dd, 0.9, f"the virtual disk: {spread}; each load thread waits for its "
                                f"16 MiB read before hashing and writing it (read phase "
                                f"{gbps(self.ckpt_bytes, read_s):.2f} GB/s), dd only reads"))
        self.table.add("load, cold, --direct-io auto vs off (buffered)", f"{auto:.2f} GB/s", f"{off:.2f} GB/s",
                       f"{auto / off:.2f}", ">= 1.0 (auto must not lose)",
                       at_least(auto / off, 1.0, f"buffered reads keep readahead in flight while threads hash "
                                f"and write, O_DIRECT reads are synchronous per thread; {spread}"))

    def memory_and_pss(self, d):
        log("memory: peak during load, PSS of 8 clients")
        before = proc_status(d.pid)
        shmem0 = meminfo("Shmem")
        samples, stop = [], threading.Event()

        def sample():
            while not stop.is_set():
                try:
                    st = proc_status(d.pid)
                    samples.append(st["VmRSS"] - st.get("RssShmem", 0) + meminfo("Shmem") - shmem0)
                except OSError:
                    pass
                time.sleep(0.01)

        t = threading.Thread(target=sample)
        t.start()
        run = d.load("model", self.ckpt, keep=True)[0]
        stop.set()
        t.join()
        after = proc_status(d.pid)
        kept = run["host_bytes"]
        base = before["VmRSS"] - before.get("RssShmem", 0)
        peak_hwm = after["VmHWM"] - before["VmRSS"]
        peak_footprint = max(samples + [0]) - base
        peak = max(peak_hwm, peak_footprint)
        ring = os.cpu_count() * RING_BYTES_PER_THREAD
        limit = 1.05 + ring / kept
        self.raw["memory"] = {"before": before, "after": after, "kept": kept, "peak_hwm": peak_hwm,
                              "peak_footprint": peak_footprint, "ring": ring}
        self.table.add("memory: daemon peak during load / bytes kept resident", f"{peak / MIB:.0f} MiB",
                       f"{kept / MIB:.0f} MiB", f"{peak / kept:.3f}",
                       f"<= 1.05 + ring ({ring // MIB} MiB) = {limit:.3f}",
                       at_most(peak / kept, limit, "the daemon holds more than the segment and its bounce buffers"))
        # 8 clients attach and touch every page; PSS splits each shared page among its mappers,
        # so the sum over daemon + clients is what all of them cost together.
        pss0, _ = memfd_mapping_kb(d.pid)
        holds = [subprocess.Popen([self.bench, "hold", "--socket", d.socket, "--name", "model-0"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(8)]
        try:
            ready = [json.loads(h.stdout.readline()) for h in holds]
            pids = [r["pid"] for r in ready]
            total = pss0_after = memfd_mapping_kb(d.pid)[0]
            private = pte = 0
            for pid in pids:
                pss, priv = memfd_mapping_kb(pid)
                total += pss
                private += priv
                pte += proc_status(pid).get("VmPTE", 0)
        finally:
            for h in holds:
                h.stdin.close()
                h.wait()
        added = total - pss0
        self.raw["pss"] = {"daemon_before": pss0, "daemon_after": pss0_after, "all_after": total,
                           "clients_private": private, "clients_page_tables": pte, "model_bytes": kept}
        self.table.add("memory: PSS added by 8 attached clients (all pages touched) / model bytes",
                       f"{added / 1024:.0f} KiB (clients' private memfd bytes {private // 1024} KiB; "
                       f"their page tables {pte / MIB:.0f} MiB, not in PSS)",
                       f"{kept / MIB:.0f} MiB", f"{100 * added / kept:.3f}%", "< 1%",
                       at_most(added / kept, 0.01, "clients hold private copies"))

    def restart(self, d):
        log("restart: attach vs reading the checkpoint")
        modes = ["attach", "attach-read", "mmap-copy", "pread-malloc"]
        results = {m: [] for m in modes}
        faults = {m: [] for m in modes}
        for _ in range(self.reps):
            for m in modes:
                src = ["--socket", d.socket, "--name", "model-0"] if m.startswith("attach") else ["--path", self.ckpt]
                r = run_json([self.bench, "restart", "--mode", m, *src])
                results[m].append(r["seconds"])
                faults[m].append(r["minor_faults"])
        a, ar, mc, pm = (median(results[m]) for m in modes)
        self.raw["restart"] = {"seconds": results, "minor_faults": faults}
        self.attach_read_s = ar
        self.attach_read_faults = median(faults["attach-read"])
        why = (f"attach includes the gRPC connection and manifest of a fresh client ({a * 1e3:.1f} ms)")
        self.table.add("restart: fresh process, attach (all views ready) vs safetensors-style mmap + copy",
                       f"{a * 1e3:.2f} ms", f"{mc * 1e3:.0f} ms", f"{mc / a:.0f}x", ">= 100x",
                       at_least(mc / a, 100, why))
        self.table.add("restart: fresh process, attach vs pread into malloc", f"{a * 1e3:.2f} ms",
                       f"{pm * 1e3:.0f} ms", f"{pm / a:.0f}x", ">= 100x", at_least(pm / a, 100, why))
        self.table.add("restart: attach + read every byte once vs safetensors-style mmap + copy",
                       f"{ar * 1e3:.0f} ms", f"{mc * 1e3:.0f} ms", f"{mc / ar:.2f}x", ">= 1.0x",
                       at_least(mc / ar, 1.0, "reading every byte faults in every page of the shared mapping"))

    def peers(self):
        log("peers")
        python = os.path.join(self.build, "bench-venv/bin/python")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers.py")
        names = {"safetensors-load_file": "safetensors load_file", "safetensors-safe_open": "safetensors safe_open",
                 "runai": "runai-model-streamer (CPU)", "fastsafetensors": "fastsafetensors (CPU, nogds)"}
        status = self.args.peers_status
        self.raw["peers"] = {}
        for mode, label in names.items():
            row = f"peer: {label}, load + read every byte vs weightd attach + read every byte"
            reason = status.get(mode) or status.get("venv")
            if reason or not os.path.exists(python):
                self.table.add(row, f"{self.attach_read_s:.2f} s", f"n/a: {reason or 'no bench venv'}", "-",
                               ">= 1.0x", "not measured")
                continue
            runs = []
            try:
                for _ in range(1 if self.quick else 3):
                    runs.append(run_json([python, script, mode, self.ckpt], timeout=600))
            except Exception as e:  # a peer that fails to run gets its reason printed
                self.table.add(row, f"{self.attach_read_s:.2f} s", f"n/a: {str(e)[-160:]}", "-", ">= 1.0x",
                               "not measured")
                continue
            s, load = median([r["seconds"] for r in runs]), median([r["load_seconds"] for r in runs])
            self.raw["peers"][mode] = runs
            because = (f"{label} maps the page cache lazily and reads it through {median([r['minor_faults'] for r in runs]):.0f} "
                       f"page faults (the file's page cache uses large folios here), where reading weightd's memfd "
                       f"(4 KiB shmem pages) took {self.attach_read_faults:.0f}"
                       if mode.startswith("safetensors") else "the peer was faster in this run")
            self.table.add(row, f"{self.attach_read_s:.2f} s", f"{s:.2f} s (load {load:.2f} s)",
                           f"{s / self.attach_read_s:.2f}x", ">= 1.0x",
                           at_least(s / self.attach_read_s, 1.0, because))

    def attach(self, d):
        log("attach latency by tensor count and model bytes")
        runs = 30 if self.quick else 200
        p50 = {}
        self.raw["attach"] = {}
        for n, size in self.attach_models:
            path = self.synthetic(n, size)
            name = f"attach-{n}-{size // MIB}"
            d.load(name, path, keep=True)
            k = max(5, runs // 4) if n >= 100000 else runs
            ours = d.bench("attach", "--name", f"{name}-0", "--runs", str(k))
            base = run_json([self.bench, "self-map", "--path", path, "--runs", str(k)])
            if (n, size) == (1000, 16 * MIB):
                concurrent = d.bench("concurrent", "--name", f"{name}-0", "--clients", "64")
                single = ours
            d.unload(f"{name}-0")
            o, b = ours["ms"], base["ms"]
            p50[(n, size)] = o["p50"]
            self.raw["attach"][name] = {"weightd": ours, "self_map": base}
            goal = 2.0 if n <= 1000 else 100.0
            size_label = "16 MiB" if size == 16 * MIB else "2 GiB"
            self.table.add(f"attach: {n:,} tensors, {size_label} (p50; p99)", f"{o['p50']:.2f} ms; {o['p99']:.2f} ms",
                           f"{b['p50']:.2f} ms (catalog + mmap the file itself)", f"{b['p50'] / o['p50']:.2f}x",
                           f"p50 <= {goal:g} ms" + ("" if n in (1000, 100000) else " (interpolated)"),
                           at_most(o["p50"], goal, f"each tensor costs {o['p50'] * 1e3 / n:.2f} us of manifest "
                                   "building, protobuf encode/decode and view building, mostly malloc/free "
                                   "(docs/performance.md)"))
        big, small = p50[(1000, 2 * GIB)], p50[(1000, 16 * MIB)]
        self.table.add("attach: 1,000 tensors, 2 GiB vs 16 MiB (growth with model bytes)", f"{big:.2f} ms",
                       f"{small:.2f} ms", f"{big / small:.2f}", "<= 1.25 (no growth, noise allowance)",
                       at_most(big / small, 1.25, "mapping cost grows with the segment size"))
        self.concurrency(concurrent, single)

    def concurrency(self, ours, single):
        self.raw["concurrency"] = ours
        p99, ok = ours["ms"]["p99"], ours["ok"]
        work = 64 * single["ms"]["p50"]
        met = at_most(p99, 50.0, f"CPU: 64 attaches x {single['ms']['p50']:.2f} ms each = {work:.0f} ms of work "
                      f"on {os.cpu_count()} cores shared by the daemon and the 64 client threads (docs/performance.md)") if ok == 64 else f"not met: {64 - ok} failed: {ours['first_error']}"
        self.table.add("concurrency: 64 clients attach at once, 1,000 tensors (p99; all succeed)",
                       f"{p99:.2f} ms ({ok}/64 ok)", f"{single['ms']['p50']:.2f} ms (one client, p50)",
                       f"{p99 / single['ms']['p50']:.1f}", "p99 < 50 ms, 64/64", met)

    # ------------------------------------------------------- writer path
    def layers(self):
        """The decoder layer count of the checkpoint (names model.layers.N.*)."""
        out = subprocess.run([self.weightctl, "inspect", self.ckpt, "--json"], capture_output=True, text=True,
                             check=True).stdout
        names = [t["name"] for t in json.loads(out)["tensors"]]
        return 1 + max(int(m.group(1)) for m in (re.match(r"model\.layers\.(\d+)\.", n) for n in names) if m)

    def writer(self):
        """Issue 13's rows: a writer process publishing every tensor against one memcpy of the same bytes
        into fresh shared memory; an update of two consecutive layers (>= 10% of the tensors) and of every
        10th tensor against the full publish; publish-to-reattach latency of a watching process."""
        log("writer path: full publish, partial updates, publish-to-reattach")
        n = self.layers()
        mid = [n // 2 - 1, n // 2] if n > 1 else [0]
        prefixes = ",".join(f"model.layers.{k}." for k in mid)
        variants = {"full": [], "layers": ["--prefixes", prefixes], "every10": ["--every", "10"]}
        runs = {v: [] for v in variants}
        shm = []
        with Daemon(self, "writer") as d:
            d.load("pub", self.ckpt, keep=True)
            for i in range(self.reps):
                order = list(variants) if i % 2 == 0 else list(reversed(variants))
                if i % 2 == 0:
                    shm.append(run_json([self.bench, "shm-copy", "--bytes", str(self.ckpt_bytes), "--seed", str(i)]))
                for v in order:
                    runs[v].append(d.bench("publish", "--name", "pub-0", "--seed", str(100 * i + len(runs[v])),
                                           "--label", f"bench-{v}-{i}", *variants[v]))
                if i % 2 == 1:
                    shm.append(run_json([self.bench, "shm-copy", "--bytes", str(self.ckpt_bytes), "--seed", str(i)]))
            latency = d.bench("publish-watch", "--name", "pub-0", "--tensor",
                              f"model.layers.{mid[-1]}.self_attn.k_proj.weight",
                              "--commits", str(20 if self.quick else 100))
        self.raw["writer"] = {"publish": runs, "shm_copy": shm, "publish_watch": latency, "layers": mid}
        self.writer_rows(runs, shm, mid)
        self.latency_rows(latency)

    def writer_rows(self, runs, shm, mid):
        full = {k: median([r[k] for r in runs["full"]]) for k in
                ("total_s", "begin_s", "write_s", "commit_s", "commit_server_s", "write_minor_faults", "bytes_staged")}
        base = median([r["seconds"] for r in shm])
        ratio = base / full["total_s"]
        per_round = [b["seconds"] / f["total_s"] for b, f in zip(shm, runs["full"])]
        spread = (f"{min(r['total_s'] for r in runs['full']):.2f}-{max(r['total_s'] for r in runs['full']):.2f} s; "
                  f"baseline {min(r['seconds'] for r in shm):.2f}-{max(r['seconds'] for r in shm):.2f} s")
        parts = (f"begin (the daemon's staging copy of the current bytes) {full['begin_s']:.2f} s, writer's "
                 f"memcpy {full['write_s']:.2f} s ({full['write_minor_faults']:.0f} faults mapping the staged "
                 f"pages), commit {full['commit_s']:.2f} s (daemon seal + hash + publish "
                 f"{full['commit_server_s']:.2f} s; the rest: the writer unmapping and the RPC; the unleased "
                 f"previous generation is freed after the reply, on the daemon's release thread)")
        label = f"{runs['full'][0]['model_tensors']} tensors, {self.ckpt_bytes / GIB:.2f} GiB"
        self.table.add(f"writer: full publish by a writer process ({label}), BeginUpdate to Commit return, "
                       f"vs one memcpy into fresh shared memory (baseline / weightd)",
                       f"{full['total_s']:.2f} s: {parts}", f"{base:.2f} s (memfd, MAP_SHARED, first touch)",
                       f"{ratio:.2f}x (rounds {rounds(per_round)})", ">= 0.8x",
                       at_least(ratio, 0.8, f"a publish passes over the bytes three times where the baseline "
                                f"passes once: staging copy, writer's memcpy, hash (range: publish {spread})"))
        for v, what in (("layers", f"layers {mid[0]}-{mid[-1]}" if len(mid) > 1 else f"layer {mid[0]}"),
                        ("every10", "every 10th tensor")):
            r0 = runs[v][0]
            t = median([r["total_s"] for r in runs[v]])
            staged = median([r["bytes_staged"] for r in runs[v]])
            desc = (f"{what}: {r0['tensors']} of {r0['model_tensors']} tensors "
                    f"({100 * r0['tensors'] / r0['model_tensors']:.0f}%), {r0['tensor_bytes'] / MIB:.0f} MiB "
                    f"({100 * r0['tensor_bytes'] / self.ckpt_bytes:.1f}% of the bytes)")
            goal = v == "layers"
            t_rounds = rounds([p["total_s"] / f["total_s"] for p, f in zip(runs[v], runs["full"])], 3)
            self.table.add(f"writer: update of {desc} vs full publish, time", f"{t:.3f} s", f"{full['total_s']:.2f} s",
                           f"{t / full['total_s']:.3f} (rounds {t_rounds})", "<= 0.15" if goal else "- (no goal: scattered tensors)",
                           at_most(t / full["total_s"], 0.15, "the staged chunks hold more than the named tensors")
                           if goal else "-")
            self.table.add(f"writer: update of {desc} vs full publish, new memory (bytes staged)",
                           f"{staged / MIB:.0f} MiB", f"{full['bytes_staged'] / MIB:.0f} MiB",
                           f"{staged / full['bytes_staged']:.3f}", "<= 0.15" if goal else "- (no goal: scattered tensors)",
                           at_most(staged / full["bytes_staged"], 0.15, "the staged chunks hold more than the named "
                                   "tensors") if goal else f"-: {staged / r0['tensor_bytes']:.1f}x the named bytes, "
                           f"one chunk (up to max(64 MiB, file/16)) per tensor")

    def latency_rows(self, r):
        a, ret, start = r["publish_to_attached_ms"], r["commit_return_to_attached_ms"], r["commit_start_to_attached_ms"]
        n, staged = r["commits"], r["bytes_staged"]
        self.table.add(f"watch: publish to watcher attached (p50; p90; {n} commits of one "
                       f"{r['tensor_bytes'] / MIB:.0f} MiB tensor; the daemon's publish time from the event)",
                       f"{a['p50']:.2f} ms; {a['p90']:.2f} ms (event delivered after "
                       f"{r['publish_to_event_ms']['p50']:.2f} ms, attach {r['event_to_attached_ms']['p50']:.2f} ms)",
                       f"writer's Commit return to attached: {ret['p50']:.2f} ms; {ret['p90']:.2f} ms" +
                       (" (negative: attached before the commit's reply arrived)" if ret["p50"] < 0 else ""), "-",
                       "p50 < 5 ms", at_most(a["p50"], 5.0, "the watch event or the attach is slow"))
        c, srv = r["commit_ms"], r["commit_server_ms"]
        self.table.add("watch: writer's Commit call start to watcher attached (p50; p90)",
                       f"{start['p50']:.2f} ms; {start['p90']:.2f} ms",
                       f"the Commit call itself: {c['p50']:.2f} ms (daemon: seal, hash the staged "
                       f"{staged / MIB:.0f} MiB chunk, publish: {srv['p50']:.2f} ms)", "-",
                       "p50 < 5 ms if counted from the commit's start",
                       at_most(start["p50"], 5.0, f"the commit seals and hashes the whole staged chunk "
                               f"({staged / MIB:.0f} MiB) that holds the {r['tensor_bytes'] / MIB:.0f} MiB tensor"))

    def reload(self):
        """Partial reload after rewriting one file of the 3 against a full load of the same checkpoint."""
        log("partial reload vs full load")
        folder = os.path.join(self.data_dir, f"{self.preset}-reload")
        os.makedirs(folder, exist_ok=True)
        for f in os.listdir(self.ckpt):  # hard links: a rewrite replaces the link, never the original
            if not os.path.exists(os.path.join(folder, f)):
                os.link(os.path.join(self.ckpt, f), os.path.join(folder, f))
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        target = files[len(files) // 2]
        reloads, fulls = [], []
        with Daemon(self, "reload") as d:
            d.load("rl", folder, keep=True)
            for i in range(self.reps):
                data_bytes = rewrite(target, i)
                steps = [lambda: reloads.append(d.bench("reload", "--name", "rl-0")),
                         lambda: fulls.extend(d.load(f"full{i}", folder))]
                for step in steps if i % 2 == 0 else reversed(steps):
                    step()
        self.raw["reload"] = {"file": target, "file_tensor_bytes": data_bytes, "reload": reloads, "full": fulls}
        t, full = median([r["seconds"] for r in reloads]), median([r["seconds"] for r in fulls])
        read, full_read = median([r["bytes_read"] for r in reloads]), median([r["bytes_read"] for r in fulls])
        exact = all(r["bytes_read"] == data_bytes for r in reloads)
        server = median([r["server_seconds"] for r in reloads])
        self.table.add(f"reload: rewrite {os.path.basename(target)} (1 of {len(files)} files, "
                       f"{data_bytes / 1e9:.2f} GB of tensors) then Reload vs full load of the same checkpoint "
                       "(time; bytes read)", f"{t:.2f} s; {read / 1e9:.2f} GB read (the daemon's own load time "
                       f"{server:.2f} s; the replaced segments of the unleased previous generation are freed "
                       "after the reply)",
                       f"{full:.2f} s; {full_read / 1e9:.2f} GB read", f"{t / full:.2f}; {read / full_read:.2f}",
                       "reads only the rewritten file",
                       "met" if exact else f"not met: read {read} bytes, the file holds {data_bytes}")

    def hugepages(self):
        """Warm load with an MFD_HUGETLB segment: reserves a pool for the duration (root)."""
        pages = (self.ckpt_bytes + (2 * MIB) - 1) // (2 * MIB) + 8
        path = "/proc/sys/vm/nr_hugepages"
        old = open(path).read().strip()
        try:
            with open(path, "w") as f:
                f.write(str(pages))
            if meminfo("HugePages_Free") < pages:
                raise RuntimeError("the kernel could not reserve the huge page pool")
            log(f"huge page pool of {pages} pages reserved (was {old}); warming it with one load")
            with Daemon(self, "huge") as d:
                d.load("hugewarm", self.ckpt)  # first touch of the pool's pages is slow on a VM
                ours, mall = [], []
                for i in range(self.reps):
                    ours += d.load(f"huge{i}", self.ckpt)
                    mall.append(run_json([self.bench, "read-malloc", *self.files])["gbps"])
            w, m = median([r["gbps"] for r in ours]), median(mall)
            self.raw["hugepages"] = {"weightd": ours, "read_malloc_gbps": mall}
            self.table.add("load, page cache warm, huge page pool (MFD_HUGETLB) vs one thread read()",
                           f"{w:.2f} GB/s", f"{m:.2f} GB/s", f"{w / m:.2f}", ">= 1.0",
                           at_least(w / m, 1.0, "huge pages did not take"))
        finally:
            with open(path, "w") as f:
                f.write(old)

    # ------------------------------------------- attach at scale (issue 14)
    def attach_scale(self):
        """Issue 14's attach rows, each against a baseline measured in the same run: the packed
        tensor table against one TensorEntry message per tensor (C++, 1k/10k/100k tensors, and 64
        concurrent attaches), the Python client against the C++ one, and touching every page of
        the llama-1b demo after a lazy or a prefaulted attach, on 4 KiB pages and (root) on a
        hugetlb pool reserved for the rows and released on every exit path."""
        log("attach at scale: packed table vs TensorEntry messages, Python vs C++, prefault")
        raw = self.raw.setdefault("attach_scale", {})
        runs = 30 if self.quick else 100
        with Daemon(self, "scale") as d:
            for n in (1000, 10000, 100000):
                path = self.synthetic(n, 16 * MIB)
                name = f"scale-{n}"
                d.load(name, path, keep=True)
                k = max(8, runs // 3) if n >= 100000 else runs
                self.attach_scale_rows(d, f"{name}-0", n, k, raw)
                if n == 1000:
                    self.attach_concurrent_rows(d, f"{name}-0", raw)
                d.unload(f"{name}-0")
            self.touch_rows(d, "4 KiB pages", raw)
        self.touch_huge_rows(raw)

    def cpu_ms(self, pid):
        """User + system CPU of process `pid` so far, in ms."""
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * 1e3 / os.sysconf("SC_CLK_TCK")

    def python_package(self):
        """The build's Python (WEIGHTD_PYTHON) and its built client/python folder, or raises RuntimeError."""
        python = "/usr/bin/python3"
        cache = os.path.join(self.build, "CMakeCache.txt")
        if os.path.exists(cache):
            m = re.search(r"^WEIGHTD_PYTHON:FILEPATH=(.*)$", open(cache).read(), re.M)
            python = m.group(1) if m else python
        pkg = os.path.join(self.build, "client/python")
        if not glob.glob(os.path.join(pkg, "weightd/_native*.so")):
            raise RuntimeError("the Python package is not built (needs pybind11 and python3-dev)")
        return python, pkg

    def py_layout(self, d, mode, name, key):
        """One fresh process of tests/bench/py_layout.py; its JSON plus its whole wall time."""
        python, pkg = self.python_package()
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "py_layout.py")
        start = time.perf_counter()
        out = run_json([python, script, mode, "--socket", d.socket, "--name", name, "--key", key],
                       env={**os.environ, "PYTHONPATH": pkg})
        out["process_seconds"] = time.perf_counter() - start
        return out

    def layout(self):
        """Issue 25's row: a second process getting a post-processed model ready (attach the runtime
        layout, load_into a meta module) vs attaching the checkpoint and post-processing it itself
        (q/k/v fusion and int8 per-channel quantization of every linear weight); rounds interleaved."""
        log("runtime layouts: attach the post-processed layout vs post-process the checkpoint")
        key = "bench/int8-qkv"
        with Daemon(self, "layout") as d:
            subprocess.run([self.weightctl, "--socket", d.socket, "load", "lay", self.ckpt], check=True,
                           capture_output=True)
            try:
                published = self.py_layout(d, "publish", "lay", key)
            except (RuntimeError, subprocess.CalledProcessError) as err:
                self.table.add("runtime layout: post-processed model ready in a second process", "n/a", "n/a",
                               "-", ">= 20x", f"not measured: {err}")
                return
            runs = {"layout": [], "process": []}
            for i in range(self.reps):
                for mode in (("layout", "process") if i % 2 == 0 else ("process", "layout")):
                    runs[mode].append(self.py_layout(d, mode, "lay", key))
        self.raw["layout"] = {"publish": published, "runs": runs}
        ready = median([r["seconds"] for r in runs["layout"]])
        process = median([r["seconds"] for r in runs["process"]])
        ratios = [p["seconds"] / l["seconds"] for l, p in zip(runs["layout"], runs["process"])]
        whole = [p["process_seconds"] / l["process_seconds"] for l, p in zip(runs["layout"], runs["process"])]
        inside = all(r["inside_mappings"] for r in runs["layout"])
        gib = published["layout_host_bytes"] / GIB
        self.table.add(f"runtime layout, {self.preset}: post-processed model ready in a second process, from "
                       f"attach to modules bound ({published['tensors']} tensors, {gib:.2f} GiB: int8 linear "
                       f"weights, fp32 scales, BF16 embedding and norms; median of {self.reps})",
                       f"{ready * 1e3:.1f} ms attach of the layout + load_into"
                       f"{'' if inside else ' (NOT all parameters inside the mappings)'}",
                       f"{process:.2f} s attach of the checkpoint + q/k/v fusion + int8 quantization "
                       f"(the first process also publishes: {published['publish_seconds']:.2f} s more)",
                       f"{median(ratios):.0f}x ({rounds(ratios, 0)}); whole processes, Python and torch "
                       f"start included: {median(whole):.1f}x", ">= 20x",
                       at_least(median(ratios), 20.0, "attaching costs more than the pass"))

    def py_attach(self, d, name, runs, *flags):
        """The Python client's attach (tests/bench/py_attach.py), or raises RuntimeError with the reason."""
        python, pkg = self.python_package()
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "py_attach.py")
        return run_json([python, script, "--socket", d.socket, "--name", name, "--runs", str(runs), *flags],
                        env={**os.environ, "PYTHONPATH": pkg})

    def attach_scale_rows(self, d, name, n, runs, raw):
        cpu0 = self.cpu_ms(d.pid)
        packed = d.bench("attach", "--name", name, "--runs", str(runs))
        daemon_cpu = (self.cpu_ms(d.pid) - cpu0) / runs
        entries = d.bench("attach", "--name", name, "--runs", str(runs), "--packed", "false")
        raw[name] = {"cpp_packed": packed, "cpp_entries": entries, "daemon_cpu_ms_per_attach": daemon_cpu}
        p, e = packed["ms"], entries["ms"]
        client_cpu = packed["cpu_ms"]["p50"]
        find = packed["first_find_ms"]["p50"]
        why = (f"per attach: the client's CPU {client_cpu:.1f} ms (receiving the table, decoding {n:,} records "
               f"into TensorInfo with 4 allocations each, and views), the daemon's {daemon_cpu:.1f} ms; "
               f"{p['p50'] * 1e3 / n:.2f} us per tensor; the first Find() then builds the name index in "
               f"{find:.1f} ms")
        goal = "p50 <= 50 ms" if n == 100000 else "-"
        met = at_most(p["p50"], 50.0, why) if n == 100000 else f"- ({why})"
        self.table.add(f"attach (C++): {n:,} tensors, packed table vs TensorEntry messages (p50; p99)",
                       f"{p['p50']:.2f} ms; {p['p99']:.2f} ms", f"{e['p50']:.2f} ms; {e['p99']:.2f} ms",
                       f"{e['p50'] / p['p50']:.2f}x faster", goal, met)
        try:
            py = self.py_attach(d, name, runs)
            py_old = self.py_attach(d, name, max(3, runs // 5), "--entries")
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            self.table.add(f"attach (Python vs C++): {n:,} tensors (p50; p99)", "n/a", f"{p['p50']:.2f} ms", "-",
                           "<= 2x C++", f"not measured: {err}")
            return
        raw[name].update({"py_packed": py, "py_entries": py_old})
        q = py["ms"]
        ratio = q["p50"] / p["p50"]
        self.table.add(f"attach (Python vs C++): {n:,} tensors, packed table (p50; p99)",
                       f"{q['p50']:.2f} ms; {q['p99']:.2f} ms (first lookup then {py['first_lookup_ms']['p50']:.1f} ms; "
                       f"TensorEntry messages in Python: {py_old['ms']['p50']:.1f} ms)",
                       f"{p['p50']:.2f} ms; {p['p99']:.2f} ms (C++; first Find then {find:.1f} ms)",
                       f"{ratio:.2f}", "<= 2.0",
                       at_most(ratio, 2.0, "Python copies the table out of the protobuf message"))

    def attach_concurrent_rows(self, d, name, raw):
        """64 clients at once, packed and TensorEntry bursts interleaved (after one warm-up burst
        that lets gRPC start its threads); the median of each mode's rounds."""
        d.bench("concurrent", "--name", name, "--clients", "64")
        rounds = {"packed": [], "entries": []}
        for _ in range(3 if self.quick else 7):
            for label, flags in (("packed", []), ("entries", ["--packed", "false"])):
                cpu0 = self.cpu_ms(d.pid)
                r = d.bench("concurrent", "--name", name, "--clients", "64", *flags)
                r["daemon_cpu_ms"] = self.cpu_ms(d.pid) - cpu0
                rounds[label].append(r)
        raw["concurrent"] = rounds
        med = lambda label, f: median([f(r) for r in rounds[label]])
        p99, e99 = med("packed", lambda r: r["ms"]["p99"]), med("entries", lambda r: r["ms"]["p99"])
        p50, e50 = med("packed", lambda r: r["ms"]["p50"]), med("entries", lambda r: r["ms"]["p50"])
        daemon_cpu, client_cpu = med("packed", lambda r: r["daemon_cpu_ms"]), med("packed", lambda r: r["client_cpu_ms"])
        failed = [r for label in rounds for r in rounds[label] if r["ok"] != 64]
        cores = os.cpu_count()
        why = (f"CPU: a burst takes {daemon_cpu:.0f} ms of daemon CPU (gRPC, leases, fd passing) and "
               f"{client_cpu:.0f} ms in the 64 clients (gRPC, fd socket, mmap, decoding), "
               f"{(daemon_cpu + client_cpu) / cores:.0f} ms on {cores} cores even if perfectly spread, "
               f"on a machine whose load average was {open('/proc/loadavg').read().split()[0]}")
        met = (at_most(p99, 50.0, why) if not failed
               else f"not met: {64 - failed[0]['ok']} failed: {failed[0]['first_error']}")
        n = len(rounds["packed"])
        self.table.add(f"attach (C++): 64 clients at once, 1,000 tensors, packed table vs TensorEntry messages "
                       f"(p99; p50; median of {n} bursts each)", f"{p99:.2f} ms; {p50:.2f} ms",
                       f"{e99:.2f} ms; {e50:.2f} ms", f"{e99 / p99:.2f}x faster", "p99 < 50 ms, 64/64", met)

    def touch(self, d, name, prefault, runs):
        return d.bench("touch", "--name", name, "--runs", str(runs), "--prefault", "true" if prefault else "false")

    def touch_rows(self, d, pages, raw, goal_ms=None):
        """Attach the demo checkpoint lazily and prefaulted, then read one byte of every 4 KiB page."""
        name = "touch-" + pages.split()[0]
        d.load(name, self.ckpt, keep=True)
        runs = 3 if self.quick else 7
        lazy, eager = [], []
        for _ in range(runs):  # interleaved: the two modes see the same machine
            lazy.append(self.touch(d, f"{name}-0", False, 1))
            eager.append(self.touch(d, f"{name}-0", True, 1))
        d.unload(f"{name}-0")
        raw[name] = {"lazy": lazy, "prefault": eager}
        med = lambda rs, k: median([r[k]["p50"] for r in rs])
        la, lt, ea, et = med(lazy, "attach_ms"), med(lazy, "touch_ms"), med(eager, "attach_ms"), med(eager, "touch_ms")
        faults_lazy, faults_eager = med(lazy, "faults"), med(eager, "faults")
        huge, mapped = eager[-1]["huge_bytes"], eager[-1]["mapped_bytes"]
        if "hugetlb" in pages:
            if huge == 0:
                raise RuntimeError("no segment of the load got MFD_HUGETLB pages")
            pages += f" ({huge / GIB:.2f} of {mapped / GIB:.2f} GiB on 2 MiB pages, the rest 4 KiB)"
        gib = self.ckpt_bytes / GIB
        row = (f"touch every page after attach, {self.preset} ({gib:.2f} GiB), {pages}: prefaulted vs lazy "
               "(touch; attach)")
        why = (f"the touch after a prefaulted attach takes {faults_eager:.0f} faults (lazy: {faults_lazy:.0f}); "
               f"what remains is reading one byte per 4 KiB page, a TLB miss per page on 4 KiB mappings")
        self.table.add(row, f"{et:.1f} ms; attach {ea:.1f} ms", f"{lt:.1f} ms; attach {la:.1f} ms",
                       f"touch {lt / et:.1f}x faster; attach + touch {(la + lt) / (ea + et):.2f}x",
                       f"<= {goal_ms:g} ms (touch)" if goal_ms else "-",
                       at_most(et, goal_ms, why) if goal_ms else f"- ({why})")

    def touch_huge_rows(self, raw):
        row = f"touch every page after attach, {self.preset}, 2 MiB hugetlb pages: prefaulted vs lazy"
        pages = (self.ckpt_bytes + 2 * MIB - 1) // (2 * MIB) + 16
        try:
            with hugetlb_pool(pages):
                with Daemon(self, "scale-huge") as d:
                    d.load("touch-warm", self.ckpt, keep=True)  # the pool's first use is slow on a VM
                    d.unload("touch-warm-0")
                    self.touch_rows(d, "hugetlb pool", raw, goal_ms=20.0)
        except (OSError, RuntimeError) as e:
            self.table.add(row, "n/a", "n/a", "-", "<= 20 ms (touch)", f"skipped: {e}")

    def run(self):
        start = time.perf_counter()
        self.prepare()
        log(f"data ready in {time.perf_counter() - start:.0f} s; measuring ({self.raw['mode']})")
        t0 = time.perf_counter()
        self.raw["loadavg_before"] = open("/proc/loadavg").read().split()[:3]
        if self.wants("catalog"):
            self.catalog()
        if self.wants("load"):
            self.load_warm()
            self.load_cold()
        if self.wants("fill"):
            fill_section(self)
        if self.wants("attach"):
            with Daemon(self, "main") as d:
                self.memory_and_pss(d)
                self.restart(d)
                self.attach(d)
        if self.wants("attach") or self.wants("attach-scale"):
            self.attach_scale()
        if self.wants("writer"):
            self.writer()
            self.reload()
        if self.wants("daemon-restart"):
            self.daemon_restart()
        if self.wants("layout"):
            self.layout()
        if self.wants("peers"):
            self.peers()
        if self.wants("peer-seed"):
            self.peer_seed()
        if self.args.hugepages and self.wants("load"):  # --only peer-seed --hugepages: that section's own rows
            try:
                self.hugepages()
            except (OSError, RuntimeError) as e:
                self.table.add("load, page cache warm, huge page pool (MFD_HUGETLB) vs one thread read()",
                               "n/a", "n/a", "-", ">= 1.0", f"not measured: {e}")
        self.raw["seconds"] = time.perf_counter() - t0
        with open(os.path.join(self.build, "bench-results.json"), "w") as f:
            json.dump(self.raw, f, indent=1, default=str)
        self.raw["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
        print(f"weightd benchmarks, {self.raw['mode']} mode, {self.preset} checkpoint; "
              f"{os.cpu_count()} cores; measured in {self.raw['seconds']:.0f} s; load average before "
              f"{' '.join(self.raw['loadavg_before'])}, after {' '.join(self.raw['loadavg_after'])}\n")
        print(self.table.markdown())


# ------------------------------------------------------------ fill (issue 14)
SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


class KernelSettings:
    """Sets kernel files for the duration of a `with` block and puts back every old value on every
    exit path: normal, an exception, Ctrl-C, or SIGTERM (turned into an exception while inside)."""

    def __init__(self):
        self.saved = []

    def set(self, path, value):
        with open(path) as f:
            old = f.read().strip()
        if path == SHMEM_ENABLED:  # "always within_size [advise] never ...": the bracketed word
            old = re.search(r"\[(\w+)\]", old).group(1)
        self.saved.append((path, old))
        with open(path, "w") as f:
            f.write(value)
        log(f"set {path} to {value} (was {old}) for this run")

    def __enter__(self):
        def raise_exit(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")
        self.old_term = signal.signal(signal.SIGTERM, raise_exit)
        return self

    def __exit__(self, *exc):
        for path, old in reversed(self.saved):
            try:
                with open(path, "w") as f:
                    f.write(old)
                log(f"restored {path} to {old}")
            except OSError as e:
                log(f"could not restore {path} to {old}: {e}")
        signal.signal(signal.SIGTERM, self.old_term)


def fill_section(ctx):
    """Issue 14's load rows: weightd's load against cat and against a bare fill of the same pages,
    with 4 KiB pages, shmem THP and a hugetlb pool, and the daemon's peak memory."""
    reps = ctx.reps
    files, total = ctx.files, ctx.ckpt_bytes
    threads = os.cpu_count()

    def cat_gbps():
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # warm
        with open(os.devnull, "w") as null:
            return gbps(total, wall(["cat", *files], stdout=null))

    def fill(pages):
        return run_json([ctx.bench, "fill-files", "--pages", pages, "--threads", str(threads), *files])

    def measure(label, daemon_flags, pages):
        """Interleaved rounds of cat, weightd load and the bare fill; ratios within each round."""
        out = {"cat": [], "load": [], "fill": []}
        with Daemon(ctx, f"fill-{label}", *daemon_flags) as d:
            d.load(f"{label}warm", ctx.ckpt)  # first allocations after a settings change compact memory
            fill(pages)
            for i in range(reps):
                out["cat"].append(cat_gbps())
                out["load"] += d.load(f"{label}{i}", ctx.ckpt)
                out["fill"].append(fill(pages))
        ctx.raw[f"fill_{label}"] = out
        load = [r["gbps"] for r in out["load"]]
        return {"vs_cat": [l / c for l, c in zip(load, out["cat"])],
                "vs_fill": [l / f["gbps"] for l, f in zip(load, out["fill"])],
                "fill_vs_cat": [f["gbps"] / c for f, c in zip(out["fill"], out["cat"])],
                "load": median(load), "cat": median(out["cat"]), "fill": median([f["gbps"] for f in out["fill"]]),
                "huge": min(r.get("huge_page_bytes", 0) for r in out["load"]),
                "huge_rounds": [r.get("huge_page_bytes", 0) // MIB for r in out["load"]],
                "fill_huge": min(f["huge_page_bytes"] for f in out["fill"]),
                "host": out["load"][0]["host_bytes"],
                "read_s": median([r["phase_start"]["SEAL"] - r["phase_start"]["READ"] for r in out["load"]])}

    def why(m, pages):
        return (f"the bare {pages} fill (no hash, no RPC) reaches {rounds(m['fill_vs_cat'])}x cat here, so "
                f"allocating and zeroing fresh pages is the limit; weightd reaches {rounds(m['vs_fill'])}x of "
                f"the bare fill (read phase {gbps(total, m['read_s']):.2f} GB/s; the rest: XXH3 on every byte, "
                f"catalog, seal)")

    label = f"{ctx.preset}, {total / GIB:.2f} GiB, {threads} threads"
    m = measure("4k", ["--huge-pages", "false"], "small")
    c = median(m["vs_cat"])
    ctx.table.add(f"fill: load, 4 KiB pages ({label}) vs cat > /dev/null", f"{m['load']:.2f} GB/s",
                  f"{m['cat']:.2f} GB/s", f"{c:.2f} ({rounds(m['vs_cat'])})", ">= 0.6",
                  at_least(c, 0.6, why(m, "4 KiB")))
    ctx.table.add(f"fill: load, 4 KiB pages vs bare 4 KiB fill (pwrite, one memfd per thread)",
                  f"{m['load']:.2f} GB/s", f"{m['fill']:.2f} GB/s",
                  f"{median(m['vs_fill']):.2f} ({rounds(m['vs_fill'])})", "(context)", "-")

    huge_rows = [("THP", "shmem THP (shmem_enabled=advise)", "thp"), ("hugetlb", "hugetlb pool", "hugetlb")]
    if os.geteuid() != 0:
        for short, what, _ in huge_rows:
            for vs in ("cat", "bare huge-page fill"):
                ctx.table.add(f"fill: load, {what} vs {vs}", "n/a", "n/a", "-", ">= 0.9",
                              "skipped: needs root to switch shmem_enabled / vm.nr_hugepages for this run")
    else:
        for short, what, pages in huge_rows:
            try:
                with KernelSettings() as k:
                    if pages == "thp":
                        k.set(SHMEM_ENABLED, "advise")
                    else:
                        # the load's segments and the bare fill's shares, each rounded up to 2 MiB pages
                        need = 2 * (total // (2 * MIB)) + 64 + 2 * threads
                        k.set(NR_HUGEPAGES, str(need))
                        if meminfo("HugePages_Free") < need:
                            raise RuntimeError(f"the kernel reserved only {meminfo('HugePages_Free')} of {need} "
                                               "huge pages (memory too fragmented)")
                    m = measure(short.lower(), [], pages)
            except (OSError, RuntimeError) as e:
                for vs in ("cat", "bare huge-page fill"):
                    ctx.table.add(f"fill: load, {what} vs {vs}", "n/a", "n/a", "-", ">= 0.9", f"not measured: {e}")
                continue
            took = m["huge"] >= 0.9 * m["host"]
            pages_note = (f"{m['huge'] / MIB:.0f} of {m['host'] / MIB:.0f} MiB on 2 MiB pages (measured); "
                          f"bare fill {m['fill_huge'] / MIB:.0f} MiB")
            c, f = median(m["vs_cat"]), median(m["vs_fill"])
            missed = (f"not met: huge pages did not take in every round (MiB on 2 MiB pages per round: "
                      f"{m['huge_rounds']}): a load fell back to 4 KiB pages on a compaction stall (daemon log)")
            ctx.table.add(f"fill: load, {what} vs cat > /dev/null", f"{m['load']:.2f} GB/s; {pages_note}",
                          f"{m['cat']:.2f} GB/s", f"{c:.2f} ({rounds(m['vs_cat'])})", ">= 0.9",
                          at_least(c, 0.9, why(m, short)) if took else missed)
            ctx.table.add(f"fill: load, {what} vs bare {short} fill (same pages, no hash)", f"{m['load']:.2f} GB/s",
                          f"{m['fill']:.2f} GB/s", f"{f:.2f} ({rounds(m['vs_fill'])})", ">= 0.9",
                          at_least(f, 0.9, why(m, short)) if took else missed)
    fill_memory(ctx)


def wait_pinned(ctx, d, name, host_bytes, deadline_s=30):
    """Seconds until `weightctl ls` shows all of the model's host bytes locked (the pinning thread
    runs after the load returns); None when the deadline passes first."""
    start = time.perf_counter()
    while time.perf_counter() - start < deadline_s:
        out = subprocess.run([ctx.weightctl, "--socket", d.socket, "ls", "--json"], capture_output=True, text=True)
        models = json.loads(out.stdout)["models"] if out.returncode == 0 else []
        if any(m["name"] == name and m["locked_bytes"] == host_bytes for m in models):
            return time.perf_counter() - start
        time.sleep(0.05)
    return None


def fill_memory(ctx):
    """Peak daemon memory during a load (4 KiB pages) against what it keeps plus its staging."""
    with Daemon(ctx, "fill-rss", "--huge-pages", "false") as d:
        base = proc_status(d.pid)
        samples, stop = [], threading.Event()

        def memfd_bytes(pid):
            """Bytes allocated to the weightd memfds the daemon holds (st_blocks: pages really there);
            per process, unlike /proc/meminfo's Shmem, which other processes on the machine move."""
            total = 0
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:weightd:"):
                        total += os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512
                except OSError:
                    pass
            return total

        def sample():
            while not stop.is_set():
                try:
                    st = proc_status(d.pid)
                    samples.append(st["VmRSS"] - st.get("RssShmem", 0) + memfd_bytes(d.pid))
                except OSError:
                    pass
                time.sleep(0.005)

        t = threading.Thread(target=sample)
        t.start()
        run = d.load("rss", ctx.ckpt, keep=True)[0]
        pinned_s = wait_pinned(ctx, d, "rss-0", run["host_bytes"])  # the pinning thread maps every page
        stop.set()
        t.join()
        after = proc_status(d.pid)
    kept = run["host_bytes"]
    staging = os.cpu_count() * RING_BYTES_PER_THREAD
    anon0 = base["VmRSS"] - base.get("RssShmem", 0)
    peak = max(max(samples + [anon0]) - anon0, after["VmHWM"] - base["VmRSS"])
    ctx.raw["fill_rss"] = {"kept": kept, "staging": staging, "peak": peak, "base": base, "after": after,
                           "pinned_after_s": pinned_s}
    ctx.table.add("fill: daemon peak memory during a load / (resident + staging)",
                  f"{peak / MIB:.0f} MiB", f"{(kept + staging) / MIB:.0f} MiB ({kept / MIB:.0f} MiB kept + "
                  f"{staging // MIB} MiB staging)", f"{peak / (kept + staging):.3f}", "<= 1.05",
                  at_most(peak / (kept + staging), 1.05, "the daemon holds more than its segments and buffers"))
# ---------------------------------------------------------------- peer seeding (issue 16)

def tcp_stream_gbps(files, total):
    """A plain TCP stream of `files` (sendfile from the page cache) over loopback from one
    process to another, received into fresh memory: the baseline of peer seeding."""
    import multiprocessing as mp

    def sender(q):
        import socket
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        for f in files:
            with open(f, "rb") as fh:
                conn.sendfile(fh)
        conn.close()

    import socket
    q = mp.Queue()
    p = mp.Process(target=sender, args=(q,))
    p.start()
    port = q.get()
    buf = bytearray(total)  # fresh pages, faulted in by the receive as a joiner's are
    view = memoryview(buf)
    start = time.perf_counter()
    conn = socket.create_connection(("127.0.0.1", port))
    got = 0
    while got < total:
        n = conn.recv_into(view[got:], min(4 * MIB, total - got))
        if n == 0:
            break
        got += n
    seconds = time.perf_counter() - start
    conn.close()
    p.join()
    if got != total:
        raise RuntimeError(f"tcp stream received {got} of {total} bytes")
    return gbps(total, seconds)


def _peer_port(log_path):
    for _ in range(200):
        m = re.search(r"peer listener on 127\.0\.0\.1:(\d+)", open(log_path).read())
        if m:
            return int(m.group(1))
        time.sleep(0.05)
    raise RuntimeError(f"no peer listener in {log_path}")


LANES = (1, 2, 4)


def _seed_once(self, joiner, peer):
    """One `weightctl load --peer` into `joiner`, timed end to end, then unloaded."""
    argv = [self.weightctl, "--socket", joiner.socket, "load", "m-0", self.ckpt, "--peer", peer, "--json"]
    start = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    if p.returncode != 0:
        raise RuntimeError(f"weightctl load --peer exited {p.returncode}: {p.stderr.strip()[-400:]}")
    done = json.loads(p.stdout)
    joiner.unload("m-0")  # the name the seed serves (Daemon.load appends the run)
    if done.get("source") != f"peer {peer}":
        raise RuntimeError(f"joiner did not seed from the peer: {done}")
    return {"gbps": gbps(done["host_bytes"], seconds), "seconds": seconds, "bytes": done["host_bytes"]}


def _peer_seed(self):
    """Seeding the demo checkpoint from a peer daemon over UCX on loopback TCP (UCX_TLS=tcp,
    UCX_NET_DEVICES=lo, as between two nodes), against a plain TCP stream of the same bytes
    and against reading the checkpoint from storage with a cold page cache; per lane count;
    with --hugepages (root) also into shmem THP and a hugetlb pool, each kernel setting
    restored on every exit path."""
    log("peer seeding")
    saved = {k: os.environ.get(k) for k in ("UCX_TLS", "UCX_NET_DEVICES")}
    os.environ["UCX_TLS"], os.environ["UCX_NET_DEVICES"] = "tcp", "lo"
    runs, tcp, cold, lane_runs, transport, huge, thp = [], [], [], {}, {}, None, None
    try:
        with Daemon(self, "seed", "--peer-address", "127.0.0.1:0", "--mlock", "false") as seed, \
                Daemon(self, "joiner", "--mlock", "false") as joiner:
            peer = f"127.0.0.1:{_peer_port(os.path.join(self.run_dir, 'seed.log'))}"
            subprocess.run(["cat", *self.files], stdout=subprocess.DEVNULL, check=True)
            seed.load("m", self.ckpt, keep=True)
            for i in range(self.reps):
                runs.append(_seed_once(self, joiner, peer))
                subprocess.run(["cat", *self.files], stdout=subprocess.DEVNULL, check=True)  # sent from the page cache
                tcp.append(tcp_stream_gbps(self.files, self.ckpt_bytes))
                drop_cache(self.files)  # only these files' pages; no machine-wide setting
                cold += joiner.load(f"c{i}", self.ckpt)
                joiner.unload(f"c{i}")
            subprocess.run(["cat", *self.files], stdout=subprocess.DEVNULL, check=True)
            for lanes in LANES:  # 4 KiB pages, so that the lanes are all that changes
                with Daemon(self, f"joiner-l{lanes}", "--mlock", "false", "--huge-pages", "false",
                            "--peer-lanes", str(lanes)) as j:
                    lane_runs[lanes] = [_seed_once(self, j, peer) for _ in range(self.reps)]
            verify = _peer_seed_verify(self, peer)
            if self.args.hugepages:
                thp = _peer_seed_thp(self, joiner, peer)
                huge = _peer_seed_huge(self, joiner, peer)
        # The transport alone: one helper exports a memfd, lanes of helpers receive it into
        # destination memfds whose pages exist beforehand (no daemon, no page creation).
        helper = os.path.join(os.path.dirname(self.weightd), "weightd-peer-helper")
        for lanes in LANES:  # a seed sender per lane (as a seed answers), then one for all lanes (as before)
            for senders in sorted({lanes, 1}, reverse=True):
                transport[(lanes, senders)] = [
                    run_json([self.bench, "peer-transport", "--bytes", str(self.ckpt_bytes), "--lanes", str(lanes),
                              "--senders", str(senders), "--helper", helper])["gbps"]
                    for _ in range(self.reps)]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    fill = run_json([self.bench, "memfd-fill", "--bytes", str(self.ckpt_bytes), "--threads", str(os.cpu_count())])["gbps"]
    w, t, c = median([r["gbps"] for r in runs]), median(tcp), median([r["gbps"] for r in cold])
    self.raw["peer_seed"] = {"weightd": runs, "tcp_stream_gbps": tcp, "storage_cold": cold, "memfd_fill_gbps": fill,
                             "transport_gbps": {f"{l} lanes, {k} senders": v for (l, k), v in transport.items()},
                             "lanes": lane_runs, "verify": verify}
    label = f"{self.preset}, {self.ckpt_bytes / GIB:.2f} GiB"
    cores = os.cpu_count()
    self.table.add(f"peer seeding ({label}) over UCX, loopback TCP, received into the segments (lanes by size "
                   "and cores), vs a plain TCP stream of the same bytes",
                   f"{w:.2f} GB/s", f"{t:.2f} GB/s", f"{w / t:.2f}", ">= 0.8",
                   at_least(w / t, 0.8, f"on {cores} cores the seed's helper (UCX send), the joiner's helper (UCX "
                            "receive into fresh memfd pages, whose creation alone runs at "
                            f"{fill:.2f} GB/s here) and the hashing after each seal share the CPUs that the "
                            "stream's two kernel copies have to themselves; docs/performance.md has the profile"))
    for (lanes, senders), gbps_runs in sorted(transport.items()):
        x = median(gbps_runs)
        self.table.add(f"peer transport alone ({label}), {lanes} lane(s), {senders} seed sender(s): helpers over "
                       "UCX active messages, loopback TCP, into memfds whose pages exist, vs the same TCP stream",
                       f"{x:.2f} GB/s", f"{t:.2f} GB/s", f"{x / t:.2f}", ">= 0.8",
                       at_least(x / t, 0.8, f"UCX's send and receive each run in a helper process per lane and "
                                f"per sender on {cores} shared cores, and each receiving helper maps every 4 KiB "
                                "page of its destinations"))
    for lanes in LANES:
        x = median([r["gbps"] for r in lane_runs[lanes]])
        self.table.add(f"peer seeding ({label}), {lanes} lane(s) and {lanes} seed sender(s), 4 KiB pages, vs the "
                       "same TCP stream", f"{x:.2f} GB/s", f"{t:.2f} GB/s", f"{x / t:.2f}", "-", "measured")
    seg, xfer = (median([r["gbps"] for r in verify[m]]) for m in ("per-segment", "per-transfer"))
    for mode, x in (("per-segment", seg), ("per-transfer", xfer)):
        self.table.add(f"peer seeding ({label}), --peer-verify {mode} (lanes by size and cores, 4 KiB pages), vs "
                       "the same TCP stream", f"{x:.2f} GB/s", f"{t:.2f} GB/s", f"{x / t:.2f}", "-", "measured")
    self.table.add(f"peer seeding ({label}): --peer-verify per-transfer vs per-segment, alternating runs",
                   f"{xfer:.2f} GB/s", f"{seg:.2f} GB/s", f"{xfer / seg:.2f}", "-", "measured")
    if thp is not None:
        self.raw["peer_seed"]["shmem_thp"] = thp
        h = median([r["gbps"] for r in thp])
        self.table.add(f"peer seeding ({label}) into shmem THP (shmem_enabled advise for this row) vs the same "
                       "TCP stream", f"{h:.2f} GB/s", f"{t:.2f} GB/s", f"{h / t:.2f}", ">= 0.8",
                       at_least(h / t, 0.8, "with fresh-page creation cheaper, the transport (rows above) and the "
                                "hashing are what is left"))
    if huge is not None:
        self.raw["peer_seed"]["hugepages"] = huge
        h = median([r["gbps"] for r in huge])
        self.table.add(f"peer seeding ({label}) into a huge page pool (MFD_HUGETLB) vs the same TCP stream",
                       f"{h:.2f} GB/s", f"{t:.2f} GB/s", f"{h / t:.2f}", ">= 0.8",
                       at_least(h / t, 0.8, "with fresh-page creation gone, the transport (rows above) and the "
                                "hashing are what is left"))
    self.table.add(f"peer seeding ({label}) vs storage with a cold page cache", f"{w:.2f} GB/s", f"{c:.2f} GB/s",
                   f"{w / c:.2f}", ">= 1.0",
                   at_least(w / c, 1.0, "this VM's disk is faster than the peer path on its cores"))


def _peer_seed_verify(self, peer):
    """Hashing per segment (each once sealed, while later ones arrive) against per transfer
    (all after the last byte): two joiners alike but for --peer-verify (4 KiB pages), seeded
    in alternation so that both see the same moments of a shared machine."""
    runs = {"per-segment": [], "per-transfer": []}
    with Daemon(self, "joiner-seg", "--mlock", "false", "--huge-pages", "false") as seg, \
            Daemon(self, "joiner-xfer", "--mlock", "false", "--huge-pages", "false",
                   "--peer-verify", "per-transfer") as xfer:
        for _ in range(self.reps):
            runs["per-segment"].append(_seed_once(self, seg, peer))
            runs["per-transfer"].append(_seed_once(self, xfer, peer))
    return runs


def _peer_seed_thp(self, joiner, peer):
    """--hugepages (root): shmem_enabled set to "advise" for this row only (restored on every
    exit), so the joiner's segments get 2 MiB shmem THP through the helpers' advised mappings."""
    path = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
    text = open(path).read()
    old = re.search(r"\[(\w+)\]", text).group(1)
    runs = []
    try:
        with open(path, "w") as f:
            f.write("advise")
        _seed_once(self, joiner, peer)  # warms the pages (first touch is slow on a VM)
        runs = [_seed_once(self, joiner, peer) for _ in range(self.reps)]
    finally:
        with open(path, "w") as f:
            f.write(old)
    return runs


def _peer_seed_huge(self, joiner, peer):
    """--hugepages (root): the joiner's host segments from a huge page pool reserved for this
    row only (vm.nr_hugepages restored on every exit), so fresh-page creation stops bounding it."""
    pages = (self.ckpt_bytes + (2 * MIB) - 1) // (2 * MIB) + 64
    path = "/proc/sys/vm/nr_hugepages"
    old = open(path).read().strip()
    runs = []
    try:
        with open(path, "w") as f:
            f.write(str(pages))
        if meminfo("HugePages_Free") < pages:
            raise RuntimeError("the kernel could not reserve the huge page pool")
        _seed_once(self, joiner, peer)  # the first run warms the pool (first touch is slow on a VM)
        runs = [_seed_once(self, joiner, peer) for _ in range(self.reps)]
    finally:
        with open(path, "w") as f:
            f.write(old)
    return runs


Bench.peer_seed = _peer_seed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="more repetitions (default: quick)")
    ap.add_argument("--build", default=os.path.join(os.path.dirname(__file__), "../../build-bench"))
    ap.add_argument("--preset", default="llama-1b", help="make-demo preset of the load/restart/peer rows")
    ap.add_argument("--hugepages", action="store_true",
                    help="also measure with a huge page pool (root: sets vm.nr_hugepages, then restores it)")
    ap.add_argument("--only", type=lambda v: v.split(","), default=[],
                    help="comma-separated sections to run: catalog, load, fill, attach, attach-scale, writer, "
                         "daemon-restart, peers, peer-seed (default: all; attach includes attach-scale)")
    ap.add_argument("--peers-status", default="{}", type=json.loads,
                    help="JSON {mode or 'venv': reason} for peers that could not be installed")
    Bench(ap.parse_args()).run()


if __name__ == "__main__":
    main()
