#!/usr/bin/env python3
"""Checks the deployment files in deploy/: the Kubernetes manifests, the
systemd unit and the example config.

Plain Python 3 plus PyYAML (Debian: python3-yaml). Prints one line per check
and a final "N passed, M failed"; exits non-zero when any check fails.
Run: /usr/bin/python3 tests/deploy/test_deploy.py
"""

import configparser
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback

try:
    import yaml
except ImportError:
    sys.stderr.write(
        "test_deploy: PyYAML is missing for %s; install python3-yaml "
        "(scripts/install-deps.sh) and run with /usr/bin/python3\n" % sys.executable)
    sys.exit(2)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEPLOY = os.path.join(ROOT, "deploy")
K8S = os.path.join(DEPLOY, "k8s")
UNIT = os.path.join(DEPLOY, "systemd", "weightd.service")
CONFIG = os.path.join(DEPLOY, "config.example.json")

# The daemon's command line, fixed by DESIGN.md.
BINARY = "/usr/local/bin/weightd"
RUN_DIR = "/run/weightd"
SOCKET = RUN_DIR + "/weightd.sock"
FD_SOCKET = RUN_DIR + "/weightd.fd.sock"
METRICS_PORT = 9400
HEALTH_PORT = 9401
MODELS_MOUNT = "/models"
DEVICE_BACKENDS = {"auto", "cuda", "cuda-legacy-ipc", "emulated", "none"}
VALUE_FLAGS = {"--socket", "--model-root", "--metrics-address", "--health-address",
               "--device-backend", "--config", "--preload", "--peer-address", "--peers"}
REPEATABLE_FLAGS = {"--model-root", "--preload", "--peers"}
PEER_PORT = 7400
CONFIG_KEYS = {"socket", "fd_socket", "model_root", "metrics_address", "health_address",
               "device_backend", "preload", "allowed_gids", "lease_claim_timeout_seconds",
               "load_threads", "mlock"}

_results = {"passed": 0, "failed": 0}


class CheckFailed(Exception):
    pass


def expect(cond, message):
    if not cond:
        raise CheckFailed(message)


def check(name):
    """Decorator: runs the function as one named check and records the result."""
    def wrap(fn):
        try:
            fn()
        except CheckFailed as e:
            _results["failed"] += 1
            print("FAIL %s: %s" % (name, e))
        except Exception:  # a crash in a check is a failure, not an abort
            _results["failed"] += 1
            print("FAIL %s: unexpected error\n%s" % (name, traceback.format_exc()))
        else:
            _results["passed"] += 1
            print("PASS %s" % name)
        return fn
    return wrap


def skip(name, why):
    print("SKIP %s: %s" % (name, why))


# ---------------------------------------------------------------- helpers

def load_yaml_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def pod_spec(obj):
    kind = obj.get("kind")
    if kind == "Pod":
        return obj["spec"]
    if kind in ("Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"):
        return obj["spec"]["template"]["spec"]
    return None


def pod_metadata(obj):
    if obj.get("kind") == "Pod":
        return obj.get("metadata", {})
    return obj["spec"]["template"].get("metadata", {})


def workload(path, kind):
    docs = [d for d in load_yaml_docs(path) if d.get("kind") == kind]
    expect(len(docs) == 1, "%s: expected one %s, found %d" % (os.path.basename(path), kind, len(docs)))
    return docs[0]


def find_container(spec, name, where=("containers", "initContainers")):
    for field in where:
        for c in spec.get(field) or []:
            if c.get("name") == name:
                return field, c
    raise CheckFailed("no container named %r in %s" % (name, "/".join(where)))


def parse_flags(argv):
    """Parses weightd's argv (without the binary) into {flag: [values]}."""
    flags = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        expect(a.startswith("--"), "unexpected positional argument %r" % a)
        if "=" in a:
            flag, value = a.split("=", 1)
            i += 1
        else:
            flag = a
            expect(i + 1 < len(argv), "%s needs a value" % flag)
            value = argv[i + 1]
            i += 2
        expect(flag in VALUE_FLAGS, "unknown weightd flag %s" % flag)
        flags.setdefault(flag, []).append(value)
    for flag, values in flags.items():
        expect(len(values) == 1 or flag in REPEATABLE_FLAGS, "%s given %d times" % (flag, len(values)))
    if "--device-backend" in flags:
        expect(flags["--device-backend"][0] in DEVICE_BACKENDS,
               "--device-backend %s is not one of %s" % (flags["--device-backend"][0], sorted(DEVICE_BACKENDS)))
    return flags


def preload_names(flags):
    names = []
    for p in flags.get("--preload", []):
        expect("=" in p, "--preload %r is not NAME=PATH" % p)
        name, path = p.split("=", 1)
        expect(name and path, "--preload %r is not NAME=PATH" % p)
        names.append((name, path))
    return names


def port_of(address):
    m = re.fullmatch(r"(.+):(\d+)", address)
    expect(m is not None, "address %r is not HOST:PORT" % address)
    return int(m.group(2))


def mounts_by_path(container):
    return {m["mountPath"]: m for m in container.get("volumeMounts") or []}


def volumes_by_name(spec):
    return {v["name"]: v for v in spec.get("volumes") or []}


_QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
             "K": 10**3, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "": 1}


def quantity_bytes(q):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|K|k|M|G|T|)", str(q))
    expect(m is not None, "memory quantity %r not understood" % q)
    return float(m.group(1)) * _QUANTITY[m.group(2)]


# ---------------------------------------------------- checks for both layouts

def check_weightd_container(label, obj, container_field_expected):
    spec = pod_spec(obj)
    field, c = find_container(spec, "weightd")

    @check("%s: weightd runs as %s" % (label, container_field_expected))
    def _():
        expect(field == container_field_expected,
               "weightd is in %s, expected %s" % (field, container_field_expected))

    flags = {}

    @check("%s: weightd command line uses the DESIGN.md flags" % label)
    def _():
        argv = list(c.get("command") or []) + list(c.get("args") or [])
        expect(argv and argv[0] == BINARY, "command must start with %s, got %r" % (BINARY, argv[:1]))
        flags.update(parse_flags(argv[1:]))
        expect(flags.get("--model-root") == [MODELS_MOUNT], "--model-root must be %s" % MODELS_MOUNT)
        expect(flags.get("--health-address") == ["0.0.0.0:%d" % HEALTH_PORT],
               "--health-address must be 0.0.0.0:%d (probes reach the pod IP)" % HEALTH_PORT)
        expect(flags.get("--metrics-address") == ["0.0.0.0:%d" % METRICS_PORT],
               "--metrics-address must be 0.0.0.0:%d" % METRICS_PORT)
        expect(flags.get("--socket", [SOCKET]) == [SOCKET], "--socket must be %s" % SOCKET)
        names = preload_names(flags)
        expect(names, "no --preload NAME=PATH")
        for name, path in names:
            expect(path.startswith(MODELS_MOUNT + "/"), "--preload %s=%s is outside %s" % (name, path, MODELS_MOUNT))

    @check("%s: container ports 9400 (metrics) and 9401 (health)" % label)
    def _():
        ports = {p["containerPort"]: p for p in c.get("ports") or []}
        for port in (METRICS_PORT, HEALTH_PORT):
            expect(port in ports, "containerPort %d missing" % port)
            expect(ports[port].get("protocol", "TCP") == "TCP", "port %d must be TCP" % port)
            name = ports[port].get("name", "")
            expect(name and len(name) <= 15, "port %d needs a name of at most 15 characters" % port)

    @check("%s: startup, readiness and liveness probes are gRPC on the health port" % label)
    def _():
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c.get(probe)
            expect(p is not None, "%s missing" % probe)
            other = {"httpGet", "tcpSocket", "exec"} & set(p)
            expect(not other, "%s uses %s, expected grpc" % (probe, sorted(other)))
            expect("grpc" in p, "%s is not a grpc probe" % probe)
            expect(p["grpc"].get("port") == HEALTH_PORT,
                   "%s probes port %r, health port is %d" % (probe, p["grpc"].get("port"), HEALTH_PORT))
        expect(port_of(flags.get("--health-address", [":0"])[0]) == HEALTH_PORT,
               "--health-address does not listen on the probed port")
        # Liveness and startup ask for the overall status; a model's service
        # name is only for readiness (a failed load must not restart-loop).
        for probe in ("startupProbe", "livenessProbe"):
            expect(not c[probe]["grpc"].get("service"), "%s must check the overall status" % probe)
        service = c["readinessProbe"]["grpc"].get("service")
        if service:
            names = [n for n, _ in preload_names(flags)]
            expect(service in names, "readiness service %r is not a preloaded model %s" % (service, names))
        sp = c["startupProbe"]
        budget = sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3)
        expect(budget >= 30, "startupProbe allows only %ds to start" % budget)

    @check("%s: weightd securityContext" % label)
    def _():
        sc = c.get("securityContext") or {}
        pod_sc = spec.get("securityContext") or {}
        expect(sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, "runAsNonRoot must be true")
        expect(sc.get("readOnlyRootFilesystem") is True, "readOnlyRootFilesystem must be true")
        expect(sc.get("allowPrivilegeEscalation") is False, "allowPrivilegeEscalation must be false")
        expect(not sc.get("privileged"), "must not be privileged")
        caps = sc.get("capabilities") or {}
        expect(caps.get("drop") == ["ALL"], "capabilities.drop must be [ALL], got %r" % caps.get("drop"))
        expect(caps.get("add") == ["IPC_LOCK"], "capabilities.add must be [IPC_LOCK] (mlock), got %r" % caps.get("add"))
        expect(spec.get("hostIPC") is not True, "hostIPC must be off (memfds need no shared IPC namespace)")
        expect(spec.get("hostPID") is not True, "hostPID must be off")

    @check("%s: weightd memory requests and limits are set and equal" % label)
    def _():
        res = c.get("resources") or {}
        req = (res.get("requests") or {}).get("memory")
        lim = (res.get("limits") or {}).get("memory")
        expect(req is not None and lim is not None, "memory requests and limits must both be set")
        expect(quantity_bytes(req) == quantity_bytes(lim),
               "memory request %s != limit %s (pinned tables must not be reclaimed under pressure)" % (req, lim))
        expect(quantity_bytes(lim) >= 2**30, "memory limit %s is too small for host-resident tables" % lim)
        expect("nvidia.com/gpu" not in (res.get("limits") or {}),
               "weightd must not request GPUs (it would take them from the inference ranks)")

    @check("%s: weightd requests 2 MiB huge pages (hugepages-2Mi), request equal to limit" % label)
    def _():
        res = c.get("resources") or {}
        req = (res.get("requests") or {}).get("hugepages-2Mi")
        lim = (res.get("limits") or {}).get("hugepages-2Mi")
        expect(req is not None and lim is not None,
               "hugepages-2Mi requests and limits must both be set (the host tables' hugetlb pool; "
               "docs/operations.md \"Huge pages\")")
        expect(quantity_bytes(req) == quantity_bytes(lim),
               "hugepages-2Mi request %s != limit %s (Kubernetes requires them equal)" % (req, lim))
        expect(quantity_bytes(lim) % 2**21 == 0, "hugepages-2Mi %s is not a whole number of 2 MiB pages" % lim)
        expect(quantity_bytes(lim) >= 2**30, "hugepages-2Mi %s is too small for host-resident tables" % lim)

    @check("%s: socket directory at %s and read-only models at %s" % (label, RUN_DIR, MODELS_MOUNT))
    def _():
        mounts = mounts_by_path(c)
        vols = volumes_by_name(spec)
        expect(RUN_DIR in mounts, "weightd does not mount %s" % RUN_DIR)
        expect(not mounts[RUN_DIR].get("readOnly"), "%s must be writable for the sockets" % RUN_DIR)
        expect(MODELS_MOUNT in mounts, "weightd does not mount %s" % MODELS_MOUNT)
        expect(mounts[MODELS_MOUNT].get("readOnly") is True, "%s must be mounted readOnly" % MODELS_MOUNT)
        expect(mounts[MODELS_MOUNT]["name"] in vols, "volume %s is not declared" % mounts[MODELS_MOUNT]["name"])
        for v in vols.values():
            ed = v.get("emptyDir")
            expect(not (ed and ed.get("medium") == "Memory"),
                   "volume %s is a memory emptyDir; memfd segments need no /dev/shm" % v["name"])

    @check("%s: prometheus scrape annotations point at the metrics port" % label)
    def _():
        ann = pod_metadata(obj).get("annotations") or {}
        expect(ann.get("prometheus.io/scrape") == "true", "prometheus.io/scrape must be \"true\"")
        expect(ann.get("prometheus.io/port") == str(METRICS_PORT), "prometheus.io/port must be \"%d\"" % METRICS_PORT)
        expect(ann.get("prometheus.io/path", "/metrics") == "/metrics", "prometheus.io/path must be /metrics")

    if obj.get("kind") != "Pod":
        @check("%s: selector matches the pod template labels" % label)
        def _():
            sel = obj["spec"]["selector"]["matchLabels"]
            labels = pod_metadata(obj).get("labels") or {}
            for k, v in sel.items():
                expect(labels.get(k) == v, "selector %s=%s does not match the template" % (k, v))

    return spec, c


# ---------------------------------------------------------------- manifests

@check("k8s: every manifest parses and names apiVersion, kind and metadata.name")
def _():
    files = sorted(glob.glob(os.path.join(K8S, "*.yaml")) + glob.glob(os.path.join(K8S, "*.yml")))
    expect(files, "no manifests in %s" % K8S)
    names = {os.path.basename(f) for f in files}
    expect({"sidecar.yaml", "daemonset.yaml"} <= names, "missing sidecar.yaml or daemonset.yaml in %s" % K8S)
    for f in files:
        try:
            docs = load_yaml_docs(f)
        except yaml.YAMLError as e:
            raise CheckFailed("%s: %s" % (os.path.basename(f), e))
        expect(docs, "%s is empty" % os.path.basename(f))
        for d in docs:
            expect(isinstance(d, dict), "%s: a document is not a mapping" % os.path.basename(f))
            for key in ("apiVersion", "kind"):
                expect(key in d, "%s: a document has no %s" % (os.path.basename(f), key))
            expect((d.get("metadata") or {}).get("name"), "%s: %s has no metadata.name" % (os.path.basename(f), d["kind"]))


def sidecar_checks():
    path = os.path.join(K8S, "sidecar.yaml")
    kinds = [d.get("kind") for d in load_yaml_docs(path)]
    kind = "Pod" if "Pod" in kinds else "Deployment"
    obj = workload(path, kind)
    spec, c = check_weightd_container("sidecar", obj, "initContainers")

    @check("sidecar: initContainer weightd has restartPolicy Always (native sidecar)")
    def _():
        expect(c.get("restartPolicy") == "Always", "restartPolicy is %r" % c.get("restartPolicy"))

    @check("sidecar: inference container sets WEIGHTD_SOCKET and shares the socket emptyDir")
    def _():
        main = [x for x in spec.get("containers") or [] if x.get("name") != "weightd"]
        expect(main, "no inference container")
        vols = volumes_by_name(spec)
        run_vol = mounts_by_path(c)[RUN_DIR]["name"]
        expect("emptyDir" in vols.get(run_vol, {}), "socket volume %r is not an emptyDir" % run_vol)
        for m in main:
            env = {e["name"]: e.get("value") for e in m.get("env") or []}
            expect(env.get("WEIGHTD_SOCKET") == SOCKET,
                   "container %s: WEIGHTD_SOCKET is %r, expected %s" % (m["name"], env.get("WEIGHTD_SOCKET"), SOCKET))
            mounts = mounts_by_path(m)
            expect(RUN_DIR in mounts, "container %s does not mount %s" % (m["name"], RUN_DIR))
            expect(mounts[RUN_DIR]["name"] == run_vol,
                   "container %s mounts %r at %s, weightd mounts %r" % (m["name"], mounts[RUN_DIR]["name"], RUN_DIR, run_vol))
            sc = m.get("securityContext") or {}
            expect(sc.get("allowPrivilegeEscalation") is False,
                   "container %s: allowPrivilegeEscalation must be false" % m["name"])

    @check("sidecar: both containers share a group weightd can check (SO_PEERCRED)")
    def _():
        pod_sc = spec.get("securityContext") or {}
        groups = set()
        for x in (spec.get("containers") or []) + [c]:
            sc = x.get("securityContext") or {}
            groups.add(sc.get("runAsGroup", pod_sc.get("runAsGroup")))
        expect(None not in groups and len(groups) == 1, "runAsGroup differs or is unset: %r" % groups)
        expect(pod_sc.get("fsGroup") is not None, "fsGroup is unset; the emptyDir must be group-writable")

    @check("sidecar: model volume is read-only")
    def _():
        vols = volumes_by_name(spec)
        v = vols[mounts_by_path(c)[MODELS_MOUNT]["name"]]
        if "persistentVolumeClaim" in v:
            expect(v["persistentVolumeClaim"].get("readOnly") is True, "the models PVC must be readOnly")
        elif "hostPath" in v:
            expect(v["hostPath"].get("type") in ("Directory", None), "models hostPath type")


def daemonset_checks():
    path = os.path.join(K8S, "daemonset.yaml")
    obj = workload(path, "DaemonSet")
    spec, c = check_weightd_container("daemonset", obj, "containers")

    @check("daemonset: socket directory is hostPath /run/weightd (DirectoryOrCreate)")
    def _():
        vols = volumes_by_name(spec)
        v = vols.get(mounts_by_path(c)[RUN_DIR]["name"], {})
        hp = v.get("hostPath")
        expect(hp is not None, "the %s volume is not a hostPath" % RUN_DIR)
        expect(hp.get("path") == RUN_DIR, "hostPath is %r, expected %s" % (hp.get("path"), RUN_DIR))
        expect(hp.get("type") == "DirectoryOrCreate", "hostPath type is %r, expected DirectoryOrCreate" % hp.get("type"))

    @check("daemonset: runs on GPU nodes only and tolerates the GPU taint")
    def _():
        expect((spec.get("nodeSelector") or {}).get("nvidia.com/gpu.present") == "true",
               "nodeSelector nvidia.com/gpu.present: \"true\" missing")
        tol = [t for t in spec.get("tolerations") or [] if t.get("key") == "nvidia.com/gpu"]
        expect(tol, "no toleration for nvidia.com/gpu")
        expect(tol[0].get("operator") == "Exists" or "value" in tol[0], "nvidia.com/gpu toleration matches nothing")

    @check("daemonset: hostIPC is explicitly false")
    def _():
        expect(spec.get("hostIPC") is False, "hostIPC is %r, expected false" % spec.get("hostIPC"))

    @check("daemonset: peers on port %d, discovered through a headless Service that selects the pods" % PEER_PORT)
    def _():
        argv = list(c.get("command") or []) + list(c.get("args") or [])
        flags = parse_flags(argv[1:])
        expect(flags.get("--peer-address") == ["0.0.0.0:%d" % PEER_PORT], "--peer-address must be 0.0.0.0:%d" % PEER_PORT)
        ports = {p["containerPort"]: p for p in c.get("ports") or []}
        expect(PEER_PORT in ports and ports[PEER_PORT].get("name") == "peer", "containerPort %d named peer missing" % PEER_PORT)
        services = [d for d in load_yaml_docs(path) if d.get("kind") == "Service"]
        expect(len(services) == 1, "expected one Service beside the DaemonSet, found %d" % len(services))
        svc = services[0]
        expect(svc["spec"].get("clusterIP") == "None", "the peer Service must be headless (clusterIP: None)")
        labels = pod_metadata(obj).get("labels") or {}
        for k, v in (svc["spec"].get("selector") or {}).items():
            expect(labels.get(k) == v, "Service selector %s=%s does not match the pods" % (k, v))
        expect(svc["spec"].get("selector"), "the peer Service selects nothing")
        svc_ports = {p["port"]: p for p in svc["spec"].get("ports") or []}
        expect(PEER_PORT in svc_ports, "the peer Service does not expose port %d" % PEER_PORT)
        name = svc["metadata"]["name"]
        expect(any(p.split(":")[0] == name and port_of(p) == PEER_PORT for p in flags.get("--peers", [])),
               "--peers must name the Service %s:%d" % (name, PEER_PORT))

    @check("daemonset: models hostPath is mounted read-only")
    def _():
        v = volumes_by_name(spec)[mounts_by_path(c)[MODELS_MOUNT]["name"]]
        expect("hostPath" in v or "persistentVolumeClaim" in v, "models volume is neither hostPath nor PVC")

    @check("daemonset: the socket directory is handed to weightd's uid before it starts")
    def _():
        pod_sc = spec.get("securityContext") or {}
        uid = (c.get("securityContext") or {}).get("runAsUser", pod_sc.get("runAsUser"))
        expect(uid not in (None, 0), "weightd's runAsUser must be a fixed non-root uid, got %r" % uid)
        run_vol = mounts_by_path(c)[RUN_DIR]["name"]
        prep = [ic for ic in spec.get("initContainers") or [] if mounts_by_path(ic).get(RUN_DIR, {}).get("name") == run_vol]
        expect(prep, "no init container prepares the hostPath %s (kubelet creates it root-owned)" % RUN_DIR)
        script = " ".join(prep[0].get("command") or []) + " " + " ".join(prep[0].get("args") or [])
        expect(re.search(r"chown\s+%d\b" % uid, script), "init container does not chown %s to uid %d" % (RUN_DIR, uid))
        sc = prep[0].get("securityContext") or {}
        expect(sc.get("allowPrivilegeEscalation") is False, "init container: allowPrivilegeEscalation must be false")
        expect((sc.get("capabilities") or {}).get("drop") == ["ALL"], "init container: capabilities.drop must be [ALL]")


try:
    sidecar_checks()
except CheckFailed as e:
    _results["failed"] += 1
    print("FAIL sidecar: %s" % e)
try:
    daemonset_checks()
except CheckFailed as e:
    _results["failed"] += 1
    print("FAIL daemonset: %s" % e)


# ------------------------------------------------------------------ systemd

def read_unit():
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",),
                                   comment_prefixes=("#", ";"), inline_comment_prefixes=None,
                                   empty_lines_in_values=False)
    cp.optionxform = str  # systemd keys are case-sensitive
    with open(UNIT) as f:
        cp.read_file(f, UNIT)
    return cp


def unit_values(key, section="Service"):
    """All values of a (possibly repeated) key, in order; configparser keeps only the last."""
    values, current = [], None
    with open(UNIT) as f:
        for line in f:
            line = line.strip()
            if line.startswith("[") and line.endswith("]"):
                current = line[1:-1]
            elif current == section and "=" in line and not line.startswith(("#", ";")):
                k, v = line.split("=", 1)
                if k.strip() == key:
                    values.append(v.strip())
    return values


def seconds(value):
    m = re.fullmatch(r"(\d+)\s*(s|sec|min|m)?", value)
    expect(m is not None, "time span %r not understood" % value)
    n = int(m.group(1))
    return n * 60 if m.group(2) in ("min", "m") else n


def expect_settings(section, want):
    """Each key of `want` has exactly its value in the unit `section`."""
    for k, v in want.items():
        expect(section.get(k) == v, "%s=%r, expected %r" % (k, section.get(k), v))


@check("systemd: unit parses and has the required service settings")
def _():
    s = read_unit()["Service"]
    want = {"Type": "notify", "NotifyAccess": "main", "LimitMEMLOCK": "infinity",
            "RuntimeDirectory": "weightd", "Restart": "on-failure", "User": "weightd",
            "Group": "weightd",
            # the record key (weightd.sock.key) outlives a restart, as the fd store does
            "RuntimeDirectoryPreserve": "restart"}
    expect_settings(s, want)
    expect(s.get("RuntimeDirectoryMode") in ("0750", "0755"), "RuntimeDirectoryMode=%r" % s.get("RuntimeDirectoryMode"))
    wd = seconds(s.get("WatchdogSec", ""))
    expect(0 < wd <= 120, "WatchdogSec=%s should be between 1 s and 2 min" % wd)
    expect(read_unit()["Install"].get("WantedBy") == "multi-user.target", "WantedBy=multi-user.target missing")


@check("systemd: the fd store keeps models across restarts and reload is an in-place upgrade")
def _():
    s = read_unit()["Service"]
    store_max = int(s.get("FileDescriptorStoreMax", "0") or 0)
    expect(1024 <= store_max <= int(s.get("LimitNOFILE", "0") or 0),
           "FileDescriptorStoreMax=%r: needs >= 1024 and <= LimitNOFILE=%r" % (store_max, s.get("LimitNOFILE")))
    expect(s.get("ExecReload") == "/usr/local/bin/weightctl --socket %s upgrade --timeout 60" % SOCKET,
           "ExecReload=%r, expected weightctl upgrade (it reports the outcome)" % s.get("ExecReload"))


@check("systemd: ExecStart runs %s --config /etc/weightd/config.json" % BINARY)
def _():
    execs = unit_values("ExecStart")
    expect(len(execs) == 1, "expected one ExecStart, found %d" % len(execs))
    argv = execs[0].split()
    expect(argv[0] == BINARY, "ExecStart binary is %s, expected %s" % (argv[0], BINARY))
    flags = parse_flags(argv[1:])
    expect(flags.get("--config") == ["/etc/weightd/config.json"], "ExecStart must pass --config /etc/weightd/config.json")


@check("systemd: hardening is on and leaves what weightd needs")
def _():
    s = read_unit()["Service"]
    on = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "read-only",
          "PrivateTmp": "yes", "ProtectKernelTunables": "yes", "ProtectControlGroups": "yes",
          "LockPersonality": "yes"}
    expect_settings(s, on)
    fams = set(s.get("RestrictAddressFamilies", "").split())
    expect(fams == {"AF_UNIX", "AF_INET", "AF_INET6"}, "RestrictAddressFamilies=%s" % sorted(fams))
    # Settings that would break weightd.
    expect(s.get("PrivateDevices", "no") in ("no", "false"), "PrivateDevices hides /dev/nvidia*")
    expect(s.get("MemoryDenyWriteExecute", "no") in ("no", "false"), "MemoryDenyWriteExecute may break the CUDA driver")
    expect(s.get("PrivateNetwork", "no") in ("no", "false"), "PrivateNetwork blocks the metrics and health ports")
    expect(s.get("ProcSubset", "all") == "all", "ProcSubset=pid hides /proc/driver/nvidia")
    if s.get("DevicePolicy") in ("closed", "strict"):
        allowed = " ".join(unit_values("DeviceAllow"))
        for dev in ("nvidia-frontend", "nvidia-uvm"):
            expect(dev in allowed, "DevicePolicy=%s without DeviceAllow for %s" % (s.get("DevicePolicy"), dev))
    filt = unit_values("SystemCallFilter")
    if filt:
        expect(filt[0].startswith("@system-service") or "memfd_create" in " ".join(filt),
               "SystemCallFilter must allow memfd_create and mlock (@system-service does)")
        expect(not any(f.startswith("~") and ("@ipc" in f or "@memlock" in f) for f in filt),
               "SystemCallFilter denies @ipc or @memlock (memfd_create, mlock)")
    caps = s.get("CapabilityBoundingSet")
    if caps:
        expect(not caps.startswith("~") or "CAP_IPC_LOCK" not in caps or s.get("LimitMEMLOCK") == "infinity",
               "mlock needs CAP_IPC_LOCK or LimitMEMLOCK=infinity")


@check("systemd: model roots of the example config are in ReadOnlyPaths")
def _():
    with open(CONFIG) as f:
        roots = json.load(f)["model_root"]
    ro = set()
    for v in unit_values("ReadOnlyPaths"):
        ro.update(p.lstrip("-+") for p in v.split())
    for r in roots:
        expect(any(r == p or r.startswith(p.rstrip("/") + "/") for p in ro),
               "model root %s is not under ReadOnlyPaths=%s" % (r, sorted(ro)))


def systemd_analyze():
    for cand in (shutil.which("systemd-analyze"), "/usr/bin/systemd-analyze", "/bin/systemd-analyze"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def verify_unit(analyze, text, tmp):
    path = os.path.join(tmp, "weightd.service")
    with open(path, "w") as f:
        f.write(text)
    proc = subprocess.run([analyze, "verify", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=120)
    # verify exits 0 on unknown keys and bad values ("..., ignoring"), so any
    # line about this unit counts as a complaint.
    complaints = [l for l in proc.stdout.splitlines() if "weightd.service" in l]
    return proc.returncode, complaints, proc.stdout


ANALYZE = systemd_analyze()
if ANALYZE is None:
    skip("systemd: systemd-analyze verify", "systemd-analyze is not installed (Debian package systemd)")
else:
    def stub_text():
        with open(UNIT) as f:
            text = f.read()
        stubbed, n = re.subn(r"^(ExecStart=[-@:+!]*)%s\b" % re.escape(BINARY), r"\1/bin/true", text, flags=re.M)
        expect(n == 1, "could not substitute the ExecStart binary")
        # ExecReload runs weightctl, which is not installed where the tests run.
        stubbed, n = re.subn(r"^(ExecReload=[-@:+!]*)/usr/local/bin/weightctl\b", r"\1/bin/true", stubbed, flags=re.M)
        expect(n == 1, "could not substitute the ExecReload binary")
        return stubbed

    @check("systemd: systemd-analyze verify accepts the unit (ExecStart and ExecReload stubbed with /bin/true)")
    def _():
        with tempfile.TemporaryDirectory(prefix="weightd-unit-") as tmp:
            rc, complaints, out = verify_unit(ANALYZE, stub_text(), tmp)
        expect(rc == 0 and not complaints, "systemd-analyze verify rc=%d:\n%s" % (rc, out.strip()))

    @check("systemd: systemd-analyze verify would catch a broken unit here")
    def _():
        broken = stub_text().replace("[Service]\n", "[Service]\nNotAWeightdOption=1\nWatchdogSec=soon\n", 1)
        with tempfile.TemporaryDirectory(prefix="weightd-unit-") as tmp:
            rc, complaints, out = verify_unit(ANALYZE, broken, tmp)
        expect(rc != 0 or len(complaints) >= 2,
               "a unit with a bogus key and a bad value passed verify; the verify check proves nothing:\n%s" % out)


# ------------------------------------------------------------- config.example

@check("config.example.json: keys are exactly the flag names plus the documented extras")
def _():
    with open(CONFIG) as f:
        cfg = json.load(f)
    expect(isinstance(cfg, dict), "top level must be an object")
    missing = CONFIG_KEYS - set(cfg)
    extra = set(cfg) - CONFIG_KEYS
    expect(not missing and not extra, "missing keys %s, unknown keys %s" % (sorted(missing), sorted(extra)))


@check("config.example.json: values have the right types and match the defaults")
def _():
    with open(CONFIG) as f:
        cfg = json.load(f)
    expect(cfg["socket"] == SOCKET, "socket is %r, default is %s" % (cfg["socket"], SOCKET))
    expect(cfg["fd_socket"] == FD_SOCKET, "fd_socket is %r, default is %s" % (cfg["fd_socket"], FD_SOCKET))
    expect(isinstance(cfg["model_root"], list) and cfg["model_root"], "model_root must be a non-empty list")
    for r in cfg["model_root"]:
        expect(isinstance(r, str) and r.startswith("/"), "model_root %r is not an absolute path" % r)
    expect(cfg["metrics_address"] == "127.0.0.1:%d" % METRICS_PORT, "metrics_address default is 127.0.0.1:%d" % METRICS_PORT)
    port_of(cfg["health_address"])
    expect(cfg["device_backend"] == "auto", "device_backend is %r, expected auto" % cfg["device_backend"])
    expect(isinstance(cfg["preload"], dict), "preload must be an object {name: path}")
    for name, path in cfg["preload"].items():
        expect(isinstance(path, str) and any(path.startswith(r.rstrip("/") + "/") for r in cfg["model_root"]),
               "preload %s=%r is not under a model_root" % (name, path))
    expect(isinstance(cfg["allowed_gids"], list) and all(isinstance(g, int) and not isinstance(g, bool)
                                                        for g in cfg["allowed_gids"]), "allowed_gids must be a list of integers")
    t = cfg["lease_claim_timeout_seconds"]
    expect(isinstance(t, (int, float)) and not isinstance(t, bool) and t == 10,
           "lease_claim_timeout_seconds is %r, default is 10" % t)
    n = cfg["load_threads"]
    expect(isinstance(n, int) and not isinstance(n, bool) and n >= 0, "load_threads must be an integer >= 0 (0 = auto)")
    expect(cfg["mlock"] is True, "mlock must be true")


print("%d passed, %d failed" % (_results["passed"], _results["failed"]))
sys.exit(1 if _results["failed"] else 0)
