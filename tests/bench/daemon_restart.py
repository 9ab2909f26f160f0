"""Benchmark row of issue 15: a daemon restarted through the fd store serves
its model again, against a full load of the same checkpoint in the same run.

The service manager is played by a small stand-in here (as in
tests/testing/fd_store_standin.h): it receives the daemon's FDSTORE=1
datagrams on its NOTIFY_SOCKET and starts the daemon again with the stored
fds at 3, 4, ... and LISTEN_FDS, LISTEN_FDNAMES, LISTEN_PID (sd_listen_fds(3)).
"""
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time


class StandIn:
    """An fd store on a datagram socket; start() runs the daemon the way systemd would."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.05)
        self.store = []  # [(name, fd)] in store order
        self.ready_at = []  # time.perf_counter() of each READY=1
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _receive(self):
        while not self.stop.is_set():
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 65536, 253)
            except socket.timeout:
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            if fields.get("READY") == "1":
                self.ready_at.append(time.perf_counter())
            with self.lock:
                if fields.get("FDSTORE") == "1":
                    for fd in fds:
                        os.set_inheritable(fd, False)
                        self.store.append((fields.get("FDNAME", "stored"), fd))
                    continue
                if fields.get("FDSTOREREMOVE") == "1":
                    for name, fd in [e for e in self.store if e[0] == fields.get("FDNAME")]:
                        os.close(fd)
                    self.store = [e for e in self.store if e[0] != fields.get("FDNAME")]
            for fd in fds:
                os.close(fd)

    def records(self):
        with self.lock:
            return sum(1 for name, _ in self.store if name.startswith("wd-rec-"))

    def start(self, argv, log_path):
        self.stop.set()  # no receiving thread while forking with a preexec_fn
        self.thread.join()
        with self.lock:
            names = [n for n, _ in self.store]
            fds = [fd for _, fd in self.store]
        n = len(fds)

        def child():
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 3 + n + 16) for fd in fds]
            for i, fd in enumerate(high):
                os.dup2(fd, 3 + i, inheritable=True)
            os.environ["NOTIFY_SOCKET"] = self.path
            if n:
                os.environ["LISTEN_FDS"] = str(n)
                os.environ["LISTEN_FDNAMES"] = ":".join(names)
                os.environ["LISTEN_PID"] = str(os.getpid())

        proc = subprocess.Popen(argv, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, close_fds=False,
                                preexec_fn=child)
        self.stop.clear()  # receiving again: the new daemon stores its fds
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()
        return proc


def wait_ready(weightctl, sock, model, timeout=120):
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        out = subprocess.run([weightctl, "--socket", sock, "ls", "--json"], capture_output=True, text=True)
        if out.returncode == 0 and any(m["name"] == model and m["state"] == "READY"
                                       for m in json.loads(out.stdout)["models"]):
            return time.perf_counter()
        time.sleep(0.005)
    raise RuntimeError(f"{model} not READY within {timeout} s")


def measure(ctx, reps):
    """{load_s, restart_s, restore_ms} medians over `reps` kill-and-restart rounds."""
    run = os.path.join(ctx.run_dir, "restart")
    os.makedirs(run, exist_ok=True)
    sock = os.path.join(run, "w.sock")
    argv = [ctx.weightd, "--socket", sock, "--model-root", ctx.data_dir, "--metrics-address", "",
            "--device-backend", "none"]
    store = StandIn(os.path.join(run, "notify.sock"))
    daemon = store.start(argv, os.path.join(run, "first.log"))
    load_s, restart_s, restore_ms, ready_s = [], [], [], []
    try:
        wait_for_socket(ctx.weightctl, sock)
        for i in range(reps):
            out = subprocess.run([ctx.weightctl, "--socket", sock, "load", f"m{i}", ctx.ckpt, "--json"],
                                 capture_output=True, text=True, check=True)
            load_s.append(json.loads(out.stdout)["seconds"])
        deadline = time.time() + 30
        while store.records() < reps and time.time() < deadline:
            time.sleep(0.01)
        for i in range(reps):
            daemon.send_signal(signal.SIGKILL)
            daemon.wait()
            log_path = os.path.join(run, f"restart-{i}.log")
            readies = len(store.ready_at)
            t0 = time.perf_counter()
            daemon = store.start(argv, log_path)
            answered = wait_ready(ctx.weightctl, sock, f"m{reps - 1}") - t0
            if len(store.ready_at) <= readies:
                raise RuntimeError(f"restart {i}: no READY=1 reached the stand-in: see {log_path}")
            ready_s.append(store.ready_at[readies] - t0)  # what systemd sees: models are restored before READY=1
            restart_s.append(answered)
            m = re.search(r"(\d+) models restored, \d+ records dropped, in ([0-9.]+) ms", open(log_path).read())
            if not m or int(m.group(1)) != reps:
                raise RuntimeError(f"restart {i} restored {m.group(1) if m else 0} of {reps} models: see {log_path}")
            restore_ms.append(float(m.group(2)))
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
    # The floor of any restart: starting the binary at all (exec, loading its
    # shared libraries: gRPC, protobuf, Abseil, UCX, ...), without serving.
    exec_s = []
    for _ in range(5):
        t = time.perf_counter()
        subprocess.run([ctx.weightd, "--version"], capture_output=True, check=True)
        exec_s.append(time.perf_counter() - t)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    return {"load_s": load_s, "restart_s": restart_s, "restore_ms": restore_ms, "ready_s": ready_s,
            "load_p50": med(load_s), "restart_p50": med(restart_s), "restore_ms_p50": med(restore_ms),
            "ready_p50": med(ready_s), "exec_s": exec_s, "exec_p50": med(exec_s)}


def _attach_s(ctx, sock, name):
    """Seconds a fresh process takes to attach `name` (gRPC connection, manifest, every view)."""
    out = subprocess.run([ctx.bench, "restart", "--mode", "attach", "--socket", sock, "--name", name],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["seconds"]


def _start_probe(ctx, sock, name):
    """A `weightd_bench restart --mode probe` asking the daemon every ~1 ms, once it has had an answer."""
    probe = subprocess.Popen([ctx.bench, "restart", "--mode", "probe", "--socket", sock, "--name", name,
                              "--seconds", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = probe.stderr.readline()
    if line.strip() != "probing":
        probe.kill()
        raise RuntimeError(f"the probe did not start: {line}{probe.stderr.read()}")
    return probe


def _probe_down_s(probe):
    """The longest interval the probe saw between two answers listing the model READY."""
    out, err = probe.communicate(timeout=90)
    if probe.returncode != 0:
        raise RuntimeError(f"probe failed: {err}")
    return json.loads(out)["down_seconds"]


def _wait_pinned(weightctl, sock, name, timeout=60):
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        out = subprocess.run([weightctl, "--socket", sock, "ls", "--json"], capture_output=True, text=True)
        models = json.loads(out.stdout)["models"] if out.returncode == 0 else []
        if any(m["name"] == name and m["host_bytes"] > 0 and m["locked_bytes"] == m["host_bytes"] for m in models):
            return
        time.sleep(0.02)
    raise RuntimeError(f"{name} was not pinned within {timeout} s")


def measure_downtime(ctx, reps):
    """Down time with one model loaded and the metrics listener on, as operators restart a daemon:
    `weightctl upgrade` (what `systemctl reload` runs), and SIGTERM then a new start with the stored
    fds (what `systemctl restart` does), each from the command until `weightctl ls` answers READY and
    as the down window a client asking every ~1 ms sees (the old daemon answers while it winds down);
    plus the first attach right after a load (pinning under way) against one after pinning."""
    run = os.path.join(ctx.run_dir, "downtime")
    os.makedirs(run, exist_ok=True)
    sock = os.path.join(run, "w.sock")
    argv = [ctx.weightd, "--socket", sock, "--model-root", ctx.data_dir, "--metrics-address", "127.0.0.1:0",
            "--device-backend", "none"]
    store = StandIn(os.path.join(run, "notify.sock"))
    logs = [os.path.join(run, "start-0.log")]
    daemon = store.start(argv, logs[0])
    upgrade_s, restart_s, restore_ms, first_attach, later_attach = [], [], [], [], []
    upgrade_down_s, restart_down_s = [], []
    try:
        wait_for_socket(ctx.weightctl, sock)
        for i in range(reps):  # first attach: right after each load returns, while pinning runs
            name = f"a{i}"
            subprocess.run([ctx.weightctl, "--socket", sock, "load", name, ctx.ckpt], capture_output=True, check=True)
            first_attach.append(_attach_s(ctx, sock, name))
            _wait_pinned(ctx.weightctl, sock, name)
            later_attach.append(_attach_s(ctx, sock, name))
            subprocess.run([ctx.weightctl, "--socket", sock, "unload", name], capture_output=True, check=True)
        subprocess.run([ctx.weightctl, "--socket", sock, "load", "m", ctx.ckpt], capture_output=True, check=True)
        _wait_pinned(ctx.weightctl, sock, "m")
        deadline = time.time() + 30
        while store.records() < 1 and time.time() < deadline:
            time.sleep(0.01)
        for i in range(reps):  # each from a steady state: the restored model pinned again, as on a node
            _wait_pinned(ctx.weightctl, sock, "m")
            probe = _start_probe(ctx, sock, "m")
            t0 = time.perf_counter()
            subprocess.run([ctx.weightctl, "--socket", sock, "upgrade", "--timeout", "60"], capture_output=True,
                           check=True)
            upgrade_s.append(wait_ready(ctx.weightctl, sock, "m") - t0)
            upgrade_down_s.append(_probe_down_s(probe))
        for i in range(reps):
            _wait_pinned(ctx.weightctl, sock, "m")
            probe = _start_probe(ctx, sock, "m")
            t0 = time.perf_counter()
            daemon.send_signal(signal.SIGTERM)
            if daemon.wait(timeout=60) != 0:
                raise RuntimeError(f"restart {i}: the daemon exited {daemon.returncode}: see {logs[-1]}")
            logs.append(os.path.join(run, f"start-{i + 1}.log"))
            daemon = store.start(argv, logs[-1])
            restart_s.append(wait_ready(ctx.weightctl, sock, "m") - t0)
            restart_down_s.append(_probe_down_s(probe))
            m = re.search(r"restored 'm' generation \d+ from the fd store in ([0-9.]+) ms without reading the "
                          r"checkpoint \(record authenticated", open(logs[-1]).read())
            if not m:
                raise RuntimeError(f"restart {i}: 'm' was not restored from an authenticated record: see {logs[-1]}")
            restore_ms.append(float(m.group(1)))
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    return {"upgrade_s": upgrade_s, "restart_s": restart_s, "restore_ms": restore_ms, "first_attach_s": first_attach,
            "later_attach_s": later_attach, "upgrade_p50": med(upgrade_s), "restart_p50": med(restart_s),
            "restore_ms_p50": med(restore_ms), "first_attach_p50": med(first_attach),
            "later_attach_p50": med(later_attach), "upgrade_down_s": upgrade_down_s,
            "restart_down_s": restart_down_s, "upgrade_down_p50": med(upgrade_down_s),
            "restart_down_p50": med(restart_down_s)}


def wait_for_socket(weightctl, sock, timeout=30):
    deadline = time.perf_counter() + timeout
    while subprocess.run([weightctl, "--socket", sock, "ls"], capture_output=True).returncode != 0:
        if time.perf_counter() > deadline:
            raise RuntimeError("weightd did not start")
        time.sleep(0.02)
