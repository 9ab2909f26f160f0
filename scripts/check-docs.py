#!/usr/bin/env python3
"""Checks that README.md and docs/*.md name only things that exist.

Four kinds of claim, each checked against the repository or the built
binaries (Python 3, standard library only):

  path    Every repo path the docs name exists: a word in the text, in a
          code span or in a code block that starts with a top-level folder
          of the repository (server/, common/, tests/, .ci/, ...; `./` and a
          trailing `:LINE`, `::test` or `[extra]` are dropped; `*` globs),
          a top-level file (README.md, CMakeLists.txt), or an all-capitals
          Markdown name (DESIGN.md). Every relative link target exists, and
          its `#anchor` is a heading of the target (GitHub's slugs).
  flag    Every `--flag` named for weightd or weightctl is in that binary's
          `--help`: for `weightctl SUB`, in `weightctl SUB --help` or the
          global options of `weightctl --help`. Attribution:
          * a command is a code-block line or a code span, split at `|`,
            `&&`, `;`, `(` and `$(`, whose first word (after `VAR=value`
            words and `sudo`) is weightd or weightctl, also as a path
            (/usr/local/bin/weightd) or as the value of `ExecStart=`; its
            flags are that program's, and for weightctl the first word that
            is not an option is the command (it must be one that `weightctl
            --help` lists, unless it is a placeholder such as COMMAND);
          * a command of one of the repository's scripts (a repo path ending
            in .sh or .py, such as tests/bench/run.sh) may use only flags
            that appear in that script's source;
          * a command of another program (systemctl, docker, pip, ip, vllm,
            ..., see FOREIGN_PROGRAMS, or any other word with a `/` or
            ending in .sh/.py) is not checked;
          * a code-block line that is not a command (a usage continuation, a
            log line) belongs to the block's last command;
          * a code span that is only text (`--rank`, `--model-root DIR`, a
            quoted log message) must name a flag of weightd, of weightctl,
            or of a repo script that the same doc names; a flag that is none
            of these passes only when its paragraph (a table row is one)
            also names a command of another program, whose flag it is.
          Single-dash options (-h) are not checked.
  metric  Every `weightd_*` name (not a CMake target or function named in a
          CMakeLists.txt, not a file name) is exported by a fresh daemon:
          build/server/weightd is started on a socket in a temporary folder
          with an empty --model-root and --metrics-address 127.0.0.1:0, asked
          one ListModels (per-method RPC families have no series before the
          first call), and /metrics is scraped. A name passes when it, or
          its _bucket/_sum/_count/_total form, or the family it is a
          suffixed form of, is exported. The daemon is killed on every path
          (it also dies with this process, PR_SET_PDEATHSIG).
  python  Python calls and signatures of the weightd package, in python code
          blocks and in code spans: `weightd.connect(...)`, `client.X(...)`
          (weightd.Client), `up.X(...)` (weightd.Update),
          `weightd.connect().X(...)`, `weightd.torch.X(...)`,
          `weightd.transformers.X(...)`, bare `load_into(...)` and
          `load_model(...)`, and `.X(...)` in a table row whose first cell is
          `Model`, `Update` or `weightd.Tensor`. A span with a default
          (`x=1`) or a `*` is a signature: its parameters must equal
          inspect.signature's (names, order, keyword-only, defaults; `self`
          and `_private` ones left out). Anything else is a call and must
          bind to the signature. The package is imported from --pythonpath
          (the build tree's client/python, with its native module); a module
          that cannot be imported there (weightd.transformers without
          transformers) is read from its source in client/python/weightd/
          with ast instead.

Claims that are right although the check says otherwise are listed in
KNOWN_EXCEPTIONS with the reason.

Prints one line per failed claim (FILE:LINE: KIND 'CLAIM': why), then
"N passed, M failed"; exits 1 when any claim failed.

  scripts/check-docs.py [--repo DIR] [--docs-dir DIR] [--weightd BIN]
                        [--weightctl BIN] [--pythonpath DIR]

--docs-dir checks every *.md in DIR instead (a scratch copy: README.md there
is read as if at the repository's root, every other file as if in docs/).
The binaries default to $WEIGHTD_BINARY / $WEIGHTCTL_BINARY, then build/.
"""

import argparse
import ast
import collections
import glob
import importlib
import inspect
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request

# Claims the check gets wrong, with why they are right: (kind, program or
# "*", claim) -> reason.
KNOWN_EXCEPTIONS = {
    ("flag", "*", "--peer-test-fault"): "tests only (server/config/config.cc); left out of weightd --help on purpose",
    ("metric", "*", "weightd_peer_bytes_sent_total"):
        "labelled by peer: no series before a peer transfer, which needs a second daemon",
    ("metric", "*", "weightd_peer_bytes_received_total"):
        "labelled by peer: no series before a peer transfer, which needs a second daemon",
}

OURS = ("weightd", "weightctl")
# Programs whose options are not ours. Any word with a '/' or ending in
# .sh or .py is another program too.
FOREIGN_PROGRAMS = {
    "apt-get", "cat", "cmake", "ctest", "curl", "dd", "docker", "echo", "git", "grep", "grpc_health_probe",
    "grpcurl", "id", "install", "ip", "journalctl", "kill", "kubectl", "make", "mkdir", "ninja", "nvidia-smi",
    "openssl", "perf", "pip", "pip3", "promtool", "python", "python3", "rsync", "sg", "ss", "ssh", "sysctl",
    "systemctl", "touch", "ulimit", "useradd", "usermod", "vllm", "weightd_bench", "pytest", "torchrun",
}
SKIPPED_WORDS = {"sudo", "exec", "env", "time", "nohup", "$", "#"}
WEIGHTCTL_GLOBAL_VALUES = {"--socket", "--tls-ca", "--tls-cert", "--tls-key"}
SHELL_CODE = {"", "sh", "bash", "shell", "console", "ini", "text", "sh-session"}
METRIC_SUFFIXES = ("_bucket", "_sum", "_count", "_total")

FLAG_RE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(\*?)")
METRIC_RE = re.compile(r"(?<![\w/.-])(weightd_[a-z0-9_]*[a-z0-9])(?![\w-]|\.[a-z])")
LINK_RE = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
SPAN_RE = re.compile(r"`([^`]+)`")
PY_CALL_RE = re.compile(r"^(\.?[A-Za-z_][\w.]*(?:\(\)\.[A-Za-z_][\w.]*)*)\((.*)\)$", re.S)

PY_RECEIVERS = {  # how the docs name an object -> where it lives in the package
    "weightd.transformers": "weightd.transformers", "weightd.torch": "weightd.torch", "weightd": "weightd",
    "client": "weightd.Client", "up": "weightd.Update",
}
PY_BARE = {"load_into": "weightd.torch.load_into", "load_model": "weightd.transformers.load_model"}
PY_CALL_RESULTS = {"weightd.connect": "weightd.Client"}
PY_ROW_CLASSES = {"Model": "weightd.Model", "Update": "weightd.Update", "weightd.Tensor": "weightd.Tensor",
                  "Client": "weightd.Client"}


class Report:
    """Counts claims and prints the failed ones."""

    def __init__(self, verbose=False):
        self.passed = 0
        self.failed = 0
        self.seen = set()
        self.verbose = verbose

    def claim(self, where, kind, text, why, program="*"):
        """why: None when the claim holds, else the reason it fails."""
        key = (where, kind, text)
        if key in self.seen:
            return
        self.seen.add(key)
        if why is not None:
            name = text.split()[-1] if kind == "flag" else text  # "weightctl load --x" -> "--x"
            exempt = KNOWN_EXCEPTIONS.get((kind, program, name)) or KNOWN_EXCEPTIONS.get((kind, "*", name))
            if exempt is None:
                self.failed += 1
                print(f"{where}: {kind} '{text}': {why}")
                return
            why = f"known exception: {exempt}"
        self.passed += 1
        if self.verbose:
            print(f"ok {where}: {kind} '{text}'" + (f" ({why})" if why else ""), file=sys.stderr)


# ---------------------------------------------------------------- Markdown


class Doc:
    """One Markdown file: its code blocks, paragraphs and headings.

    blocks: (lang, [(line, text)]); paragraphs: [(line, text)] (a table row
    is a paragraph of its own); anchors: the GitHub slugs of its headings.
    logical_dir: where its relative links start (docs/, or the root for
    README.md), also for a scratch copy elsewhere.
    """

    def __init__(self, path, shown, logical_dir):
        self.path, self.shown, self.logical_dir = path, shown, logical_dir
        self.logical_path = os.path.join(logical_dir, os.path.basename(path))
        with open(path, encoding="utf-8") as f:
            self.lines = f.read().split("\n")
        self.blocks, self.paragraphs, self.anchors = [], [], set()
        self._parse()

    def where(self, line):
        return f"{self.shown}:{line}"

    def _parse(self):
        block, paragraph = None, []
        slugs = collections.Counter()
        for number, text in enumerate(self.lines, 1):
            fence = re.match(r"^\s*```\s*([\w-]*)", text)
            if block is not None:
                if fence and not fence.group(1):
                    self.blocks.append(block)
                    block = None
                else:
                    block[1].append((number, text))
                continue
            if fence:
                self._end(paragraph)
                paragraph, block = [], (fence.group(1).lower(), [])
            elif not text.strip():
                self._end(paragraph)
                paragraph = []
            elif text.lstrip().startswith("|"):
                self._end(paragraph)
                paragraph = []
                self.paragraphs.append([(number, text)])
            else:
                if text.startswith("#"):
                    slug = Slug(text.lstrip("#"))
                    self.anchors.add(slug if slugs[slug] == 0 else f"{slug}-{slugs[slug]}")
                    slugs[slug] += 1
                paragraph.append((number, text))
        self._end(paragraph)

    def _end(self, paragraph):
        if paragraph:
            self.paragraphs.append(paragraph)


def Slug(heading):
    """GitHub's anchor for a heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def Spans(paragraph):
    """(line, text) of each code span of a paragraph; spans may wrap lines."""
    joined = "\n".join(text for _, text in paragraph)
    first = paragraph[0][0]
    for m in SPAN_RE.finditer(joined):
        yield first + joined.count("\n", 0, m.start()), m.group(1).replace("\n", " ")


def Texts(doc):
    """(line, text) of every line, with link targets blanked (links are
    checked on their own)."""
    for number, text in enumerate(doc.lines, 1):
        yield number, LINK_RE.sub(lambda m: f"[{m.group(1)}]()", text)


# ---------------------------------------------------------------- paths


class Repo:
    def __init__(self, root):
        self.root = root
        names = self._tracked_top_level()
        self.dirs = sorted(n for n in names if os.path.isdir(os.path.join(root, n)))
        self.files = sorted(n for n in names if os.path.isfile(os.path.join(root, n)))
        dirs = "|".join(re.escape(d) for d in self.dirs)
        files = "|".join(re.escape(f) for f in self.files + ["[A-Z][A-Z0-9_]*\\.md"])
        self.path_re = re.compile(
            r"(?<![\w/.~$@:-])(?:\./)?((?:%s)/[\w.*/{},-]*[\w/*}]|(?:%s)/|(?:%s)(?![\w/-]))" % (dirs, dirs, files))

    def _tracked_top_level(self):
        try:
            out = subprocess.run(["git", "-C", self.root, "ls-files"], capture_output=True, text=True,
                                 timeout=30, check=True).stdout
            return {line.split("/")[0] for line in out.splitlines() if line}
        except (OSError, subprocess.SubprocessError):
            return {n for n in os.listdir(self.root) if not n.startswith(("build", ".git"))}

    def exists(self, path):
        braces = re.match(r"^(.*)\{([^{}]*)\}(.*)$", path)
        if braces:
            head, choices, tail = braces.groups()
            return all(self.exists(head + c + tail) for c in choices.split(","))
        full = os.path.join(self.root, path)
        if "*" in path:
            return bool(glob.glob(full))
        return os.path.isdir(full) if path.endswith("/") else os.path.exists(full)


def CheckPaths(docs, repo, report):
    for doc in docs:
        for number, text in Texts(doc):
            for m in repo.path_re.finditer(text):
                path = m.group(1).rstrip(".")
                if "..." in path:
                    continue
                why = None if repo.exists(path) else "no such file or folder in the repository"
                report.claim(doc.where(number), "path", path, why)
        for paragraph in doc.paragraphs:
            for number, text in paragraph:
                for m in LINK_RE.finditer(text):
                    CheckLink(doc, docs, repo, number, m.group(2), report)


def CheckLink(doc, docs, repo, number, target, report):
    if re.match(r"^[a-z]+:", target):
        return  # https:, mailto:
    path, _, anchor = target.partition("#")
    full = os.path.normpath(os.path.join(doc.logical_dir, path)) if path else None
    if full and not os.path.exists(full):
        report.claim(doc.where(number), "path", target, "the link's target does not exist")
        return
    if not anchor or (full and not full.endswith(".md")):
        report.claim(doc.where(number), "path", target, None)
        return
    target_doc = doc if not full else next((d for d in docs if d.logical_path == full), None)
    if target_doc is None:
        target_doc = Doc(full, full, os.path.dirname(full))
    why = None if anchor in target_doc.anchors else f"no heading '#{anchor}' in {os.path.basename(target_doc.path)}"
    report.claim(doc.where(number), "path", target, why)


# ---------------------------------------------------------------- flags


class Helps:
    """The flags each binary's --help lists, and those of the repository's
    own scripts (every --word in their source)."""

    def __init__(self, weightd, weightctl, repo):
        self.error, self.repo = None, repo
        try:
            self.weightd = {f for f, _ in FLAG_RE.findall(Run([weightd, "--help"]))} | {"--help"}
            top = Run([weightctl, "--help"])
            head, _, commands = top.partition("\ncommands:\n")
            self.weightctl_global = {f for f, _ in FLAG_RE.findall(head)}
            self.commands = [line.split()[0] for line in commands.splitlines() if re.match(r"^  \S", line)]
            self.weightctl = {c: {f for f, _ in FLAG_RE.findall(Run([weightctl, c, "--help"]))} | self.weightctl_global
                              for c in self.commands}
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            self.error = str(e)
            return
        self.all_weightctl = set().union(self.weightctl_global, *self.weightctl.values())
        self.ours = self.weightd | self.all_weightctl

    def allowed(self, program, sub):
        if program == "weightd":
            return self.weightd
        if program == "script":
            return self.script_flags(sub)
        return self.weightctl.get(sub, self.all_weightctl)

    def script_flags(self, word):
        """The flags in the source of repo script `word`; None when it is not one."""
        path = word[2:] if word.startswith("./") else word
        full = os.path.join(self.repo.root, path)
        if not path.endswith((".sh", ".py")) or not os.path.isfile(full):
            return None
        with open(full, encoding="utf-8", errors="replace") as f:
            return {flag for flag, _ in FLAG_RE.findall(f.read())} | {"--help"}

    def doc_script_flags(self, doc):
        """The flags of every repo script that `doc` names."""
        flags = set()
        for _, text in Texts(doc):
            for m in self.repo.path_re.finditer(text):
                flags |= self.script_flags(m.group(1).rstrip(".")) or set()
        return flags


def Run(argv):
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}: {result.stderr.strip()[:200]}")
    return result.stdout + result.stderr


class Command:
    """One command of a line: program ('weightd', 'weightctl', 'foreign' or
    None for text), weightctl's command, and the text after the program."""

    def __init__(self, program, sub, rest, bad_sub=None):
        self.program, self.sub, self.rest, self.bad_sub = program, sub, rest, bad_sub


def Commands(text, helps):
    for segment in re.split(r"\|\||&&|\$\(|[|;()]", text):
        yield ParseCommand(segment.split(), helps)


def ParseCommand(words, helps):
    i = 0
    while i < len(words):
        word = words[i]
        assignment = re.match(r"^[A-Za-z_][A-Za-z0-9_]*=(.*)$", word)
        if assignment and os.path.basename(assignment.group(1)) in OURS:
            words = [assignment.group(1)] + words[i + 1:]
            i = 0
            break
        if not assignment and word not in SKIPPED_WORDS:
            break
        i += 1
    if i >= len(words):
        return Command(None, None, "")
    program, rest = os.path.basename(words[i]), words[i + 1:]
    if program == "weightctl":
        sub, bad = WeightctlCommand(rest, helps)
        return Command("weightctl", sub, " ".join(rest), bad)
    if program == "weightd":
        return Command("weightd", None, " ".join(rest))
    if helps.script_flags(words[i]) is not None:
        return Command("script", words[i], " ".join(rest))
    if program in FOREIGN_PROGRAMS or "/" in words[i] or words[i].endswith((".sh", ".py")):
        return Command("foreign", None, " ".join(rest))
    return Command(None, None, " ".join(words[i:]))


def WeightctlCommand(rest, helps):
    """(command, unknown command word) of weightctl's arguments."""
    i = 0
    while i < len(rest):
        if rest[i] in WEIGHTCTL_GLOBAL_VALUES:
            i += 2
        elif rest[i].startswith("-"):
            i += 1
        else:
            word = rest[i]
            if word in helps.commands:
                return word, None
            if re.match(r"^[a-z][a-z-]*$", word):
                return None, word
            return None, None  # COMMAND, ..., [ARGS]
    return None, None


def CheckCommandFlags(where, command, report, helps):
    if command.bad_sub:
        report.claim(where, "flag", f"weightctl {command.bad_sub}",
                     "weightctl --help lists no such command", "weightctl")
    allowed = helps.allowed(command.program, command.sub)
    name = command.sub if command.program == "script" else \
        command.program + (f" {command.sub}" if command.sub else "")
    for flag, star in FLAG_RE.findall(command.rest):
        ok = any(a.startswith(flag) for a in allowed) if star else flag in allowed
        why = f"not in {name}'s source" if command.program == "script" else f"not in `{name} --help`"
        report.claim(where, "flag", f"{name} {flag}{star}", None if ok else why, command.program)


def CheckTextFlags(where, text, report, helps, foreign_nearby, script_flags):
    for flag, star in FLAG_RE.findall(text):
        ok = any(a.startswith(flag) for a in helps.ours) if star else flag in helps.ours
        ok = ok or flag in script_flags
        if not ok and foreign_nearby:
            continue  # another program's option
        report.claim(where, "flag", flag + star, None if ok else "in neither `weightd --help` nor `weightctl ... --help`")


def CheckFlags(docs, report, helps):
    if helps.error:
        report.claim("(binaries)", "flag", "--help", helps.error)
        return
    for doc in docs:
        script_flags = helps.doc_script_flags(doc)
        for lang, lines in doc.blocks:
            if lang in SHELL_CODE:
                CheckBlockFlags(doc, lines, report, helps, script_flags)
        for paragraph in doc.paragraphs:
            CheckParagraphFlags(doc, paragraph, report, helps, script_flags)


def JoinContinuations(lines):
    joined, start = "", None
    for number, text in lines:
        text = re.sub(r"(^|\s)#(\s.*)?$", "", text)  # comments
        start = start if joined else number
        if text.rstrip().endswith("\\"):
            joined += text.rstrip()[:-1] + " "
            continue
        yield start, joined + text
        joined = ""
    if joined:
        yield start, joined


def CheckBlockFlags(doc, lines, report, helps, script_flags):
    last = None
    for number, text in JoinContinuations(lines):
        for command in Commands(text, helps):
            if command.program in OURS or command.program == "script":
                last = command
                CheckCommandFlags(doc.where(number), command, report, helps)
            elif command.program is None and last is not None:
                CheckCommandFlags(doc.where(number), Command(last.program, last.sub, command.rest), report, helps)
            elif command.program is None:
                CheckTextFlags(doc.where(number), command.rest, report, helps, False, script_flags)


def CheckParagraphFlags(doc, paragraph, report, helps, script_flags):
    spans = [(n, list(Commands(t, helps))) for n, t in Spans(paragraph)]
    foreign = any(c.program == "foreign" for _, commands in spans for c in commands)
    for number, commands in spans:
        for command in commands:
            if command.program in OURS or command.program == "script":
                CheckCommandFlags(doc.where(number), command, report, helps)
            elif command.program is None:
                CheckTextFlags(doc.where(number), command.rest, report, helps, foreign, script_flags)


# ---------------------------------------------------------------- metrics


def CMakeNames(root):
    names = set()
    for path in glob.glob(os.path.join(root, "**", "CMakeLists.txt"), recursive=True):
        if os.path.relpath(path, root).startswith("build"):
            continue
        with open(path, encoding="utf-8") as f:
            names.update(re.findall(r"weightd_\w+", f.read()))
    return names


def DiePdeathsig():
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def ScrapeFreshDaemon(weightd, weightctl):
    """The metric names a fresh daemon exports; raises RuntimeError."""
    tmp = tempfile.mkdtemp(prefix="check-docs-")
    proc = None
    try:
        os.mkdir(os.path.join(tmp, "models"))
        sock = os.path.join(tmp, "weightd.sock")
        proc = subprocess.Popen(
            [weightd, "--socket", sock, "--model-root", os.path.join(tmp, "models"),
             "--metrics-address", "127.0.0.1:0"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            preexec_fn=DiePdeathsig)
        url = WaitForMetricsUrl(proc)
        Run([weightctl, "--socket", sock, "ls"])
        # Loopback only: never through an http_proxy the environment names.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        body = opener.open(url, timeout=10).read().decode()
        return ExportedNames(body)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


def WaitForMetricsUrl(proc, timeout=60):
    """Reads the daemon's log until 'metrics on http://...' and 'listening on'."""
    lines = queue.Queue()

    def Drain():  # also after this returns, so that the log never fills its pipe
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=Drain, daemon=True).start()
    url, log = None, []
    while True:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError("weightd did not say 'metrics on http://...' and 'listening on' within "
                               f"{timeout} s: " + "".join(log[-5:]))
        if line is None:
            raise RuntimeError("weightd exited before it listened: " + "".join(log[-5:]).strip())
        log.append(line)
        m = re.search(r"metrics on (http://\S+)", line)
        url = m.group(1) if m else url
        if url and "listening on" in line:
            return url


def ExportedNames(body):
    names = set()
    for line in body.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, 1)[0])
    return names


def MetricExported(name, exported):
    if name in exported or any(name + s in exported for s in METRIC_SUFFIXES):
        return True
    return any(name.endswith(s) and name[:-len(s)] in exported for s in METRIC_SUFFIXES)


def CheckMetrics(docs, report, root, weightd, weightctl):
    build_names = CMakeNames(root)
    claims = [(doc.where(n), m) for doc in docs for n, text in Texts(doc)
              for m in METRIC_RE.findall(text) if m not in build_names]
    if not claims:
        return
    try:
        exported = ScrapeFreshDaemon(weightd, weightctl)
    except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as e:
        report.claim("(weightd)", "metric", "/metrics", f"cannot scrape a fresh daemon: {e}")
        return
    for where, name in claims:
        report.claim(where, "metric", name, None if MetricExported(name, exported) else
                     "a fresh daemon does not export it")


# ---------------------------------------------------------------- Python


class Package:
    """Signatures of the weightd package: imported where possible, else
    read from its source with ast."""

    def __init__(self, root, pythonpath):
        self.source = os.path.join(root, "client", "python", "weightd")
        if pythonpath:
            sys.path.insert(0, pythonpath)
        self.notes = []

    def signature(self, dotted):
        """(inspect.Signature without self, None) or (None, why)."""
        parts = dotted.split(".")
        module, attrs = self._import(parts)
        if module is None:
            return self._source_signature(parts)
        obj = module
        for attr in attrs:
            if not hasattr(obj, attr):
                return None, f"{'.'.join(parts[:-1])} has no attribute '{attr}'"
            obj = getattr(obj, attr)
        try:
            return DropSelf(inspect.signature(obj)), None
        except (TypeError, ValueError) as e:
            return None, f"no signature: {e}"

    def _import(self, parts):
        """(module, remaining attributes); module None where it cannot be imported."""
        for n in range(len(parts), 0, -1):
            name = ".".join(parts[:n])
            try:
                return importlib.import_module(name), parts[n:]
            except ModuleNotFoundError as e:
                if not (e.name == name or name.startswith(e.name + ".")):  # a dependency is missing
                    self.notes.append(f"{name}: read from source ({e})")
                    return None, parts[n:]
            except Exception as e:  # ImportError, or a dependency failing as it loads (torch: RuntimeError, OSError)
                self.notes.append(f"{name}: read from source ({type(e).__name__}: {e})")
                return None, parts[n:]
        self.notes.append(f"{parts[0]}: not importable from {sys.path[0]}, read from source")
        return None, parts

    def _source_signature(self, parts):
        """From the package's source: weightd.X (re-exported), weightd.MOD.X, weightd.Class.method."""
        files = {os.path.splitext(os.path.basename(p))[0]: p for p in glob.glob(os.path.join(self.source, "*.py"))}
        trees = {}
        for stem in [parts[1]] if len(parts) > 2 and parts[1] in files else files:
            with open(files[stem], encoding="utf-8") as f:
                trees[stem] = ast.parse(f.read())
        names = parts[2:] if len(parts) > 2 and parts[1] in files else parts[1:]
        for tree in trees.values():
            node = FindDef(tree.body, names)
            if node is not None:
                return DropSelf(AstSignature(node.args)), None
        return None, f"{'.'.join(parts)} is not defined in {os.path.relpath(self.source)}"


def FindDef(body, names, module=None):
    """The def of names (["f"], ["Class", "method"]; a class: its __init__) in
    `body`, looking into base classes defined in the same module."""
    module = body if module is None else module
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == names[0]:
            if len(names) == 1:
                return node if isinstance(node, ast.FunctionDef) else FindDef(node.body, ["__init__"], module)
            if not isinstance(node, ast.ClassDef):
                return None
            found = FindDef(node.body, names[1:], module)
            for base in node.bases:
                if found is None and isinstance(base, ast.Name):
                    found = FindDef(module, [base.id] + names[1:], module)
            return found
    return None


def AstSignature(args):
    P = inspect.Parameter
    params = []
    positional = args.posonlyargs + args.args
    defaults = [P.empty] * (len(positional) - len(args.defaults)) + [Literal(d) for d in args.defaults]
    for a, d in zip(positional, defaults):
        params.append(P(a.arg, P.POSITIONAL_OR_KEYWORD, default=d))
    if args.vararg:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        params.append(P(a.arg, P.KEYWORD_ONLY, default=P.empty if d is None else Literal(d)))
    if args.kwarg:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def Literal(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def DropSelf(sig):
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    return sig.replace(parameters=params)


def Public(sig):
    """`sig` as the docs spell it: no private parameters, no annotations."""
    return sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                   for p in sig.parameters.values() if not p.name.startswith("_")],
                       return_annotation=inspect.Signature.empty)


def Resolve(func, row_class=None):
    """The package name a call's function (ast) stands for, or None."""
    if isinstance(func, ast.Name):
        return PY_BARE.get(func.id)
    if not isinstance(func, ast.Attribute):
        return None
    base = Dotted(func.value, row_class)
    if base is None:
        return None
    full = f"{base}.{func.attr}"
    for receiver in sorted(PY_RECEIVERS, key=len, reverse=True):
        if full == receiver or full.startswith(receiver + "."):
            return PY_RECEIVERS[receiver] + full[len(receiver):]
    return None


def Dotted(node, row_class):
    if isinstance(node, ast.Name):
        return row_class if node.id == "_row" else node.id
    if isinstance(node, ast.Attribute):
        base = Dotted(node.value, row_class)
        return None if base is None else f"{base}.{node.attr}"
    if isinstance(node, ast.Call):
        return PY_CALL_RESULTS.get(Resolve(node.func, row_class) or "")
    return None


def CheckCall(where, text, call, dotted, package, report):
    sig, why = package.signature(dotted)
    if sig is None:
        report.claim(where, "python", text, why)
        return
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        report.claim(where, "python", text, None)
        return
    kwargs = {k.arg: None for k in call.keywords}
    try:
        if any(isinstance(a, ast.Constant) and a.value is Ellipsis for a in call.args):
            sig.bind_partial(**kwargs)
        else:
            sig.bind(*[None] * len(call.args), **kwargs)
        why = None
    except TypeError as e:
        why = f"does not fit {dotted}{Public(sig)}: {e}"
    report.claim(where, "python", text, why)


def CheckSignature(where, text, documented, dotted, package, report):
    sig, why = package.signature(dotted)
    if sig is None:
        report.claim(where, "python", text, why)
        return
    real = Public(sig)
    same = [(p.name, p.kind, p.default) for p in documented.parameters.values()] == \
           [(p.name, p.kind, p.default) for p in real.parameters.values()]
    report.claim(where, "python", text, None if same else f"the package has {dotted.split('.')[-1]}{real}")


def CheckSpan(where, text, package, report, row_class):
    m = PY_CALL_RE.match(text.strip())
    if not m:
        return
    func, args = m.groups()
    source = ("_row" + func) if func.startswith(".") else func
    try:
        call = ast.parse(f"{source}({args})", mode="eval").body
    except SyntaxError:
        call = None
    try:
        signature = ast.parse(f"def _({args}): pass").body[0].args
    except SyntaxError:
        signature = None
    target = ast.parse(source, mode="eval").body
    dotted = Resolve(target, row_class) if isinstance(target, (ast.Name, ast.Attribute)) else None
    if dotted is None:
        return
    if signature is not None and ("=" in args or re.search(r"(^|,)\s*\*", args)):
        CheckSignature(where, text, AstSignature(signature), dotted, package, report)
    elif call is not None:
        CheckCall(where, text, call, dotted, package, report)


def RowClass(paragraph):
    text = paragraph[0][1]
    if len(paragraph) != 1 or not text.lstrip().startswith("|"):
        return None
    m = re.match(r"^\s*\|\s*`([^`]+)`\s*\|", text)
    return PY_ROW_CLASSES.get(m.group(1)) if m else None


def CheckPython(docs, report, package):
    for doc in docs:
        for paragraph in doc.paragraphs:
            row_class = RowClass(paragraph)
            for number, text in Spans(paragraph):
                if not text.startswith(".") or row_class:
                    CheckSpan(doc.where(number), text, package, report, row_class)
        for lang, lines in doc.blocks:
            if lang == "python":
                CheckPythonBlock(doc, lines, package, report)


def CheckPythonBlock(doc, lines, package, report):
    first = lines[0][0] if lines else 0
    try:
        trees = [(first, ast.parse("\n".join(text for _, text in lines)))]
    except SyntaxError:
        trees = []
        for number, text in lines:
            try:
                trees.append((number, ast.parse(text.strip())))
            except SyntaxError:
                pass
    for start, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                dotted = Resolve(node.func)
                if dotted is not None:
                    line = start + node.lineno - 1
                    CheckCall(doc.where(line), ast.unparse(node), node, dotted, package, report)


# ---------------------------------------------------------------- main


def LoadDocs(root, docs_dir):
    if docs_dir:
        paths = sorted(glob.glob(os.path.join(docs_dir, "*.md")))
    else:
        paths = [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    docs = []
    for path in paths:
        name = os.path.basename(path)
        logical_dir = root if name == "README.md" else os.path.join(root, "docs")
        shown = path if docs_dir else os.path.relpath(path, root)
        docs.append(Doc(path, shown, logical_dir))
    return docs


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", default=os.path.dirname(here))
    ap.add_argument("--docs-dir", help="check the *.md files here instead of README.md and docs/*.md")
    ap.add_argument("--weightd", default=os.environ.get("WEIGHTD_BINARY"))
    ap.add_argument("--weightctl", default=os.environ.get("WEIGHTCTL_BINARY"))
    ap.add_argument("--pythonpath", help="the folder holding the built weightd package (default build/client/python)")
    ap.add_argument("--verbose", action="store_true", help="also list every claim that holds, on stderr")
    args = ap.parse_args()
    root = os.path.abspath(args.repo)
    weightd = args.weightd or os.path.join(root, "build", "server", "weightd")
    weightctl = args.weightctl or os.path.join(root, "build", "client", "weightctl")
    pythonpath = args.pythonpath or os.path.join(root, "build", "client", "python")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that `finally` kills the daemon

    docs = LoadDocs(root, args.docs_dir)
    report = Report(args.verbose)
    repo = Repo(root)
    CheckPaths(docs, repo, report)
    CheckFlags(docs, report, Helps(weightd, weightctl, repo))
    CheckMetrics(docs, report, root, weightd, weightctl)
    package = Package(root, pythonpath if os.path.isdir(pythonpath) else None)
    CheckPython(docs, report, package)
    for note in sorted(set(package.notes)):
        print(f"note: {note}", file=sys.stderr)
    sys.stderr.flush()
    print(f"{report.passed} passed, {report.failed} failed")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
