"""A battery of bad or unusual inputs against the command line, as a new user might give them: every path a command
writes or reads given as a device, a fifo, a link, a folder, an input, another file's text, a huge or deeply nested
file, an empty name; nonsense option values; the pytest tier's variables set to nonsense. Each input runs in a folder
of its own (its files made fresh), bounded by a timeout and a memory cap (setrlimit in the child), in a session of its
own. Counted: clean refusals (exit 2, one line on stderr), tracebacks, exit codes that contradict docs/exit-codes.md,
files written or destroyed that should not have been, processes left running.

    python scripts/bad_inputs.py [--repo CHECKOUT] [--jobs 2] [--timeout 120] [-v]

Run it from a clean clone (`git clone . /tmp/clone && python /tmp/clone/scripts/bad_inputs.py`): it runs that
checkout's `python -m repro` with PYTHONPATH set to it. It never writes outside its temporary folder: a device a
command must not replace is a stand-in made there (a character device as /dev/null is one when run as root, else a
fifo). Exit 0 when nothing went wrong, 1 otherwise."""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

MEMORY_CAP = 6 << 30  # bytes of address space a command may map (torch's import maps ~3 GiB)
FILE_CAP = 1 << 30  # bytes a command may write into one file
BAD = {2}  # bad input: one line on stderr, nothing written (docs/exit-codes.md)


@dataclass
class Case:
    name: str
    argv: list[str]  # `python -m repro` arguments ({d}: the case's folder), or a full command when `raw`
    codes: set[int] = field(default_factory=lambda: set(BAD))
    env: dict[str, str] = field(default_factory=dict)
    raw: bool = False
    may_write: tuple[str, ...] = ()  # names under the folder the command may create


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_CAP, FILE_CAP))


def _results_json(repo: Path) -> bytes:
    folder = repo / "results" / "h200-default"
    if (folder / "results.json").is_file():
        return (folder / "results.json").read_bytes()
    with tarfile.open(repo / "results" / "h200-default.tar.xz") as tar:
        return tar.extractfile("h200-default/results.json").read()


def make_fixtures(d: Path, repo: Path, plain: bytes) -> None:
    """The inputs and bystanders every case may name, made fresh in its folder."""
    (d / "tmp").mkdir()
    (d / "plain.json").write_bytes(plain)
    (d / "plain2.json").write_bytes(plain)
    doc = json.loads(plain)
    for name, change in (
        ("wall_str.json", {"wall_s": "fast"}),
        ("wall_list.json", {"wall_s": [1]}),
        ("cases_obj.json", {"cases": {}}),
        ("cases_junk.json", {"cases": [1, "x", None]}),
        ("case_nokeys.json", {"cases": [{}]}),
        ("case_result_str.json", {"cases": [{"result": "clean"}]}),
        ("schema_str.json", {"schema": "new"}),
    ):
        (d / name).write_text(json.dumps({**doc, **change}))
    (d / "predicted.json").write_text(json.dumps({**doc, "source": "model"}))
    (d / "empty.json").write_text("")
    (d / "corrupt.json").write_text("{not json")
    (d / "list.json").write_text("[]")
    (d / "null.json").write_text("null")
    (d / "binary.json").write_bytes(bytes(range(256)) * 4)
    (d / "latin1.json").write_bytes(b'{"cases": "\xe9"}')
    (d / "deep.json").write_text("[" * 200000 + "]" * 200000)
    (d / "deep_obj.json").write_text('{"a":' * 50000 + "1" + "}" * 50000)
    (d / "deep_small.json").write_text('{"cases": ' + "[" * 500 + "]" * 500 + "}")
    with open(d / "huge.json", "wb") as f:  # sparse: no disk used
        f.truncate(2 << 30)
    (d / "j.xml").write_text('<testsuite name="x"><testcase name="a"/></testsuite>')
    (d / "deep.xml").write_text("<a>" * 100000 + "</a>" * 100000)
    (d / "laughs.xml").write_text(
        '<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "aaaaaaaaaa">'
        + "".join(f'<!ENTITY {chr(98 + i)} "{("&" + chr(97 + i) + ";") * 10}">' for i in range(8))
        + "]><testsuite>&i;</testsuite>"
    )
    with zipfile.ZipFile(d / "vllm-0.26.0-py3-none-any.whl", "w") as z:
        z.writestr("vllm/__init__.py", "x = 1\n" * 5000)
    whole = (d / "vllm-0.26.0-py3-none-any.whl").read_bytes()
    (d / "vllm-0.25.1-py3-none-any.whl").write_bytes(whole[: len(whole) // 2])  # truncated
    (d / "text.whl").write_text("not a zip\n")
    with zipfile.ZipFile(d / "novllm.whl", "w") as z:
        z.writestr("other/__init__.py", "")
    (d / "victim.py").write_bytes((repo / "conftest.py").read_bytes())
    (d / "README.md").write_bytes((repo / "README.md").read_bytes())
    (d / "verdicts.md").write_text("# Verdicts\n\n| case | verdict |\n")
    (d / "notreport.json").write_text('{"mine": true}\n')
    (d / "notes.txt").write_text("my notes\n")
    os.mkfifo(d / "fifo")
    os.mkfifo(d / "fifo.json")
    (d / "link").symlink_to(d / "notes.txt")
    (d / "link.md").symlink_to(d / "verdicts.md")
    (d / "dangling").symlink_to(d / "nowhere")
    (d / "zero_link.json").symlink_to("/dev/zero")
    os.link(d / "plain.json", d / "hard.json")
    (d / "folder").mkdir()
    (d / "folder" / "kept.txt").write_text("kept\n")
    (d / "ro").mkdir()
    (d / "ro" / "f.json").write_text("{}")
    if os.geteuid() == 0:
        os.mknod(d / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers: a stand-in
        os.mknod(d / "full", 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    else:
        os.mkfifo(d / "null")
        os.mkfifo(d / "full")
    rec = d / "repo"  # a checkout for `records`: one record folder holding a link out, one beside its archive
    (rec / "results" / "rec").mkdir(parents=True)
    (rec / "results" / "rec" / "results.json").write_text(json.dumps({"kind": "x", "cases": []}))
    (rec / "results" / "linked").mkdir()
    (rec / "results" / "linked" / "results.json").write_text("{}")
    (rec / "results" / "linked" / "passwd").symlink_to("/etc/passwd")
    (rec / "results" / "twice").mkdir()
    (rec / "results" / "twice" / "results.json").write_text("{}")
    with tarfile.open(rec / "results" / "twice.tar.xz", "w:xz") as tar:
        tar.add(rec / "results" / "twice", "twice")
    (rec / "results" / "cut.tar.xz").write_bytes(b"\xfd7zXZ\x00\x00")
    (rec / "results" / "index.json").write_text(json.dumps({"records": []}))
    subprocess.run(["git", "init", "-q", str(rec)], check=True)
    (d / "redact").mkdir()
    (d / "redact" / "a.json").write_text('{"p": "/home/someone/x.txt"}\n')
    (d / "outside.txt").write_text("/home/someone/secret.txt\n")
    (d / "redact" / "out.txt").symlink_to(d / "outside.txt")


# --- the cases -----------------------------------------------------------------------------------------------------

WRITE_TARGETS = [  # (name, an --out/--json value): none may be written
    "null", "full", "fifo", "fifo.json", "link", "link.md", "dangling", "folder", "victim.py", "README.md",
    "verdicts.md", "notreport.json", "notes.txt", "plain.json", "hard.json", "", " ", "zero_link.json", "ro",
    "/proc/self/status", "nowhere/deeper/x.md", "plain2.json", "j.xml", "vllm-0.26.0-py3-none-any.whl", "repo",
    "binary.json", "deep.json",
]  # fmt: skip
WRITERS = [
    ("agree", ["agree", "{d}/plain.json", "--out"]),
    ("bench", ["bench", "--paths", "{d}/plain.json", "{d}/plain2.json", "--out"]),
    ("bench2", ["bench", "{d}/plain.json", "{d}/plain2.json", "--out"]),
    ("xdist", ["xdist-report", "{d}/j.xml", "--out"]),
    ("matrix", ["matrix", "--model", "--quiet", "--json"]),
    ("run", ["run", "--model", "--json"]),
    ("vllm-check", ["vllm-check", "{d}/vllm-0.26.0-py3-none-any.whl", "--json"]),
    ("plugin-request", ["plugin-request", "--audit-file"]),
]
READ_INPUTS = [  # (name, a path given as an input): each one refused
    "/dev/zero", "/dev/full", "/dev/null", "{d}/fifo.json", "{d}/deep.json", "{d}/deep_obj.json",
    "{d}/deep_small.json", "{d}/huge.json", "{d}/empty.json", "{d}/corrupt.json", "{d}/list.json", "{d}/null.json",
    "{d}/binary.json", "{d}/latin1.json", "{d}/wall_str.json", "{d}/wall_list.json", "{d}/cases_obj.json",
    "{d}/cases_junk.json", "{d}/case_nokeys.json", "{d}/case_result_str.json", "{d}/schema_str.json",
    "{d}/nowhere.json", "{d}/folder", "", "{d}/zero_link.json", "{d}/dangling", "{d}/j.xml",
]  # fmt: skip
READERS = [
    ("agree", lambda p: ["agree", p]),
    ("bench", lambda p: ["bench", p, "{d}/plain.json"]),
    ("bench-paths", lambda p: ["bench", "--paths", "{d}/plain.json", p]),
    ("agree-two", lambda p: ["agree", "{d}/plain.json", p]),
]
XML_INPUTS = [
    "/dev/zero", "/dev/full", "/dev/null", "{d}/fifo", "{d}/deep.json", "{d}/huge.json", "{d}/empty.json",
    "{d}/corrupt.json", "{d}/binary.json", "{d}/deep.xml", "{d}/laughs.xml", "{d}/folder", "", "{d}/nowhere.xml",
]  # fmt: skip
WHEELS = [
    ("/dev/zero", BAD), ("{d}/fifo", BAD), ("{d}/text.whl", BAD), ("{d}/novllm.whl", BAD), ("{d}/empty.json", BAD),
    ("{d}/vllm-0.25.1-py3-none-any.whl", {125}), ("{d}/folder", BAD), ("", BAD), ("{d}/nowhere.whl", BAD),
    ("{d}/huge.json", BAD), ("{d}/zero_link.json", BAD),
]  # fmt: skip
OPTIONS = [  # nonsense values of options
    ["matrix", "--model", "--sms", "0"], ["matrix", "--model", "--sms", "-3"], ["matrix", "--model", "--sms", "abc"],
    ["matrix", "--model", "--sms", "1e999"], ["matrix", "--model", "--repeat", "0"], ["matrix", "--timeout", "-1"],
    ["matrix", "--timeout", "nan"], ["matrix", "--timeout", "inf"], ["matrix", "--model", "--modes", "bogus"],
    ["matrix", "--model", "--strategies", "bogus"], ["matrix", "--out", ""], ["matrix", "--model", "--json", "{d}/folder"],
    ["run", "--sm", "0"], ["run", "--sm", "x"], ["run", "--timeout", "-5"], ["run", "--timeout", "nan"],
    ["run", "--out", "{d}/plain.json"], ["gate", "--modes", "bogus"], ["gate", "--modes", ""], ["gate", "--methods", "bogus"],
    ["gate", "--methods", ""], ["gate", "--jobs", "0"], ["gate", "--jobs", "-1"],
    ["gate", "--timeout", "0"], ["gate", "--timeout", "nan"], ["gate", "--deadline", "-1"], ["gate", "--vllm", "x"],
    ["gate", "--vllm", "=x"], ["gate", "--vllm", "a=b", "--vllm", "a=b"], ["gate", "--out", "{d}/plain.json"],
    ["gate", "--out", ""], ["gate", "--cache-dir", "{d}/plain.json"], ["gate", "--self-control", "bogus"],
    ["gate", "--self-control-attempts", "0"], ["gate", "--keep-forkserver", "-1"], ["gate", "--compile", "bogus"],
    ["xdist-report", "{d}/j.xml", "--workers", "0"], ["xdist-report", "{d}/j.xml", "--workers", "-2"],
    ["agree"], ["bench"], ["bench", "{d}/plain.json"], ["bench", "--paths", "{d}/plain.json", "{d}/plain.json"],
    ["agree", "{d}/plain.json", "{d}/hard.json"], ["redact"], ["records"], ["nonsense"], ["--bogus"],
    ["plugin-request", "--backend", "bogus"], ["serve", "--stop", "--start"], ["bisect"], ["bisect", "{d}/folder"],
    ["vllm-check"], ["doctor", "--bogus"], ["matrix", "--model", "--sms", "99999"], ["run", "--sm", "-1"],
    ["gate", "--modes", "mps:0"], ["gate", "--modes", "sm_margin:-4"], ["gate", "--cache-keep", "-1"],
    ["serve", "--stop", "--status"],
]  # fmt: skip
RECORDS = [
    ["--unpack", ""], ["--unpack", " "], ["--unpack", "{d}/plain.json"], ["--unpack", "{d}/repo/results"],
    ["--add", "nothere"], ["--add", "linked"], ["--add", "twice"], ["--add", ""], ["--add", "../x"],
    ["--add", "cut"], ["--speed", "nothere"], ["--speed", "rec", "rec"], ["--note", "x", "--stale"], ["--index", "--note", "x"],
]  # fmt: skip
GATE_VARS = [
    ("REPRO_GATE_METHODS", "bogus"), ("REPRO_GATE_METHODS", ""), ("REPRO_GATE_MODES", "bogus"), ("REPRO_GATE_MODES", ""),
    ("REPRO_GATE_TIMEOUT", "soon"), ("REPRO_GATE_TIMEOUT", "-1"), ("REPRO_SELF_CONTROL", "bogus"),
    ("REPRO_GATE_REQUIRE", "bogus"),
]  # fmt: skip


def cases(repo: Path) -> list[Case]:
    out = []
    for wname, argv in WRITERS:
        for target in WRITE_TARGETS:
            value = target if target in ("", " ") or target.startswith("/") else "{d}/" + target
            out.append(Case(f"{wname} -> {target or repr(target)}", [*argv, value]))
    for rname, make in READERS:
        for p in READ_INPUTS:
            out.append(Case(f"{rname} <- {p or repr(p)}", make(p)))
    for p in XML_INPUTS:
        out.append(Case(f"xdist-report <- {p or repr(p)}", ["xdist-report", p]))
    for p, codes in WHEELS:
        out.append(Case(f"vllm-check <- {p or repr(p)}", ["vllm-check", p], set(codes)))
    for argv in OPTIONS:
        out.append(Case("options: " + " ".join(a or "''" for a in argv), argv))
    for argv in RECORDS:
        out.append(Case("records " + " ".join(a or "''" for a in argv), ["records", *argv, "--root", "{d}/repo"]))
    # a device name is judged against the machine's devices: with no GPU and no build here, "could not run here" (4)
    out.append(Case("options: gate --devices bogus", ["gate", "--devices", "bogus"], {2, 4}))
    out.append(Case("redact <- a link it is given", ["redact", "{d}/redact/out.txt"]))
    out.append(Case("redact <- /dev/zero", ["redact", "/dev/zero"]))
    out.append(Case("redact <- fifo", ["redact", "{d}/fifo"]))
    out.append(Case("redact <- ''", ["redact", ""]))
    out.append(Case("redact <- folder with a link", ["redact", "{d}/redact"], {0}, may_write=("redact/a.json",)))
    out.append(Case("plugin-request --audit-file /dev/full", ["plugin-request", "--audit-file", "/dev/full"]))
    out.append(Case("matrix --json /dev/full", ["matrix", "--model", "--quiet", "--json", "/dev/full"]))
    out.append(Case("run --json /dev/full", ["run", "--model", "--json", "/dev/full"]))
    out.append(
        Case("vllm-check --json /dev/full", ["vllm-check", "{d}/vllm-0.26.0-py3-none-any.whl", "--json", "/dev/full"])
    )
    for var, value in GATE_VARS:
        out.append(
            Case(
                f"pytest --gate with {var}={value!r}",
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:xdist",
                    "-p",
                    "no:cacheprovider",
                    "-k",
                    "stale_metadata",
                    "--gate",
                    str(repo / "cases" / "test_vllm_gate.py"),
                    "--rootdir",
                    str(repo),
                ],
                env={var: value},
                raw=True,
            )  # fmt: skip
        )
    return out


# --- running one -----------------------------------------------------------------------------------------------------


def snapshot(d: Path) -> dict[str, tuple]:
    """Every path under d (links not followed): its kind, inode and, for a small regular file, its bytes' hash."""
    seen = {}
    for top, dirs, files in os.walk(d):
        rel_top = os.path.relpath(top, d)
        if rel_top.split(os.sep)[0] in ("tmp",) or "__pycache__" in top:
            dirs[:] = []
            continue
        for n in dirs + files:
            p = os.path.join(top, n)
            st = os.lstat(p)
            digest = None
            if stat.S_ISREG(st.st_mode) and st.st_size < (64 << 20):
                with open(p, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            seen[os.path.relpath(p, d)] = (stat.S_IFMT(st.st_mode), st.st_ino, st.st_size, digest)
    return seen


def strays(pid: int) -> list[int]:
    """Processes left in the session the command started (its own pid as session id)."""
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == pid and fields[0] != "Z":  # field 6: the session
            left.append(int(entry))
    return left


def run_one(case: Case, repo: Path, plain: bytes, timeout: float) -> dict:
    d = Path(tempfile.mkdtemp(prefix="bad-input-"))
    try:
        make_fixtures(d, repo, plain)
        argv = [a.replace("{d}", str(d)) for a in case.argv]
        cmd = argv if case.raw else [sys.executable, "-m", "repro", *argv]
        env = {k: v for k, v in os.environ.items() if not k.startswith("REPRO_")}
        env |= {"PYTHONPATH": str(repo), "TMPDIR": str(d / "tmp"), "XDG_RUNTIME_DIR": str(d / "tmp"), **case.env}
        env["CUDA_VISIBLE_DEVICES"] = ""
        before = snapshot(d)
        t0 = time.time()
        p = subprocess.Popen(
            cmd, cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            preexec_fn=_limits, start_new_session=True, text=True, errors="replace",
        )  # fmt: skip
        try:
            out, err = p.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            timed_out = True
        wall = time.time() - t0
        left = strays(p.pid)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        after = snapshot(d)
        changed = sorted(k for k in before if k not in after or after[k] != before[k])
        changed = [k for k in changed if k not in case.may_write]
        new = sorted(k for k in after if k not in before and not k.startswith(case.may_write or ("\0",)))
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        return {
            "name": case.name,
            "rc": p.returncode,
            "expected": sorted(case.codes),
            "wall_s": round(wall, 1),
            "timed_out": timed_out,
            "traceback": "Traceback (most recent call last)" in err or "Traceback (most recent call last)" in out,
            "one_line": case.raw or len(lines) == 1,
            "destroyed": changed,
            "written": new,
            "strays": left,
            "stderr": err[-600:],
        }
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent), help="the checkout to run")
    ap.add_argument("--jobs", type=int, default=2, help="commands at a time (default 2)")
    ap.add_argument("--timeout", type=float, default=120, help="seconds a command may run (default 120)")
    ap.add_argument("--json", help="write every case's outcome here")
    ap.add_argument("-k", default="", help="run only the cases whose name holds this")
    ap.add_argument("-v", action="store_true", help="print every case, not only the wrong ones")
    a = ap.parse_args()
    repo = Path(a.repo).resolve()
    plain = _results_json(repo)
    todo = [c for c in cases(repo) if a.k in c.name]
    print(f"{len(todo)} inputs, {a.jobs} at a time, {a.timeout:g} s and {MEMORY_CAP >> 30} GiB each", flush=True)
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        outcomes = list(pool.map(lambda c: run_one(c, repo, plain, a.timeout), todo))
    counts = dict.fromkeys(("clean refusals", "tracebacks", "wrong exit codes", "destroyed", "written", "strays"), 0)
    counts |= {"timed out": 0, "not one line": 0, "as expected (not a refusal)": 0}
    for o in outcomes:
        wrong = []
        if o["traceback"]:
            counts["tracebacks"] += 1
            wrong.append("traceback")
        if o["timed_out"]:
            counts["timed out"] += 1
            wrong.append("timed out")
        if o["rc"] not in o["expected"]:
            counts["wrong exit codes"] += 1
            wrong.append(f"exit {o['rc']}, docs say {o['expected']}")
        if o["destroyed"]:
            counts["destroyed"] += 1
            wrong.append(f"changed {o['destroyed']}")
        if o["written"]:
            counts["written"] += 1
            wrong.append(f"wrote {o['written']}")
        if o["strays"]:
            counts["strays"] += 1
            wrong.append(f"left {len(o['strays'])} process(es)")
        if o["rc"] == 2 and not o["one_line"]:
            counts["not one line"] += 1
            wrong.append("stderr is not one line")
        if not wrong:
            counts["clean refusals" if o["rc"] == 2 else "as expected (not a refusal)"] += 1
        if wrong or a.v:
            print(f"{'WRONG' if wrong else 'ok   '} {o['name']}: rc {o['rc']} ({o['wall_s']} s) {'; '.join(wrong)}")
            if wrong:
                print("      " + o["stderr"].strip().replace("\n", "\n      ")[-400:])
    print(json.dumps({"inputs": len(outcomes), **counts, "wall_s": round(time.time() - t0)}, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(outcomes, indent=1))
    bad = ("tracebacks", "wrong exit codes", "destroyed", "written", "strays", "timed out", "not one line")
    return 1 if any(counts[k] for k in bad) else 0


if __name__ == "__main__":
    sys.exit(main())
