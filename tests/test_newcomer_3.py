"""Issue 28, the third newcomer round: bad input as a newcomer types it, each as a subprocess on a machine without a
GPU. Every refusal is one line on stderr with the README's exit code (2 bad input, 4 could not run here), no
traceback, and nothing written: not in the folder it runs in, not in the temp folder (TMPDIR points into tmp_path)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

from tests.test_newcomer import _fake_vllm, _no_traceback

ROOT = Path(__file__).resolve().parent.parent


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("REPRO_SERVER", "REPRO_VLLM", "REPRO_VLLM_CONTROL")}
    # this checkout first: run from tmp_path, the interpreter would otherwise import whichever checkout its
    # environment installed
    path = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    return {**env, "PYTHONPATH": path, "TMPDIR": str(tmp), "XDG_RUNTIME_DIR": str(tmp), **extra}


def _run(cmd: list[str], tmp_path: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=_env(tmp_path, **env))


def _tree(tmp_path: Path) -> set[Path]:
    return {p for p in tmp_path.rglob("*") if "__pycache__" not in p.parts}


def refused(cmd: list[str], tmp_path: Path, code: int, msg: str, timeout: float = 300, **env: str):
    """Run `cmd` in tmp_path (TMPDIR inside it): one line on stderr holding `msg`, exit `code`, no traceback, nothing
    new anywhere under tmp_path."""
    _env(tmp_path)  # the temp folder exists before, so it is no change
    before = _tree(tmp_path)
    r = _run(cmd, tmp_path, timeout, **env)
    _no_traceback(r)
    assert r.returncode == code, (cmd, r.returncode, r.stderr[-2000:])
    assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, (cmd, r.stderr[-2000:])
    assert _tree(tmp_path) == before, sorted(map(str, _tree(tmp_path) - before))
    return r


def repro(*args: str) -> list[str]:
    return [sys.executable, "-m", "repro", *args]


# ---- item 1: impossible sizes are refused before anything is allocated


@pytest.mark.parametrize(
    "args",
    [
        ("matrix", "--max-model-len", "99999999999"),
        ("matrix", "--model", "--max-num-seqs", "99999999999"),
        ("matrix", "--capture-sizes", "1,99999999999"),
        ("matrix", "--q-heads", "99999999999", "--kv-heads", "1"),
        ("matrix", "--page-size", "99999999999984"),
        ("run", "--backend", "vllm", "--max-model-len", "99999999999"),
    ],
    ids=lambda a: " ".join(a),
)
def test_impossible_sizes_are_refused_before_allocating(tmp_path, args):
    t0 = time.time()
    refused(repro(*args), tmp_path, 2, "GB of GPU memory", timeout=120)
    assert time.time() - t0 < 60  # refused, not an allocation that took the machine's memory


# ---- item 2: a report file and the output folder on one path


@pytest.mark.parametrize(
    "args",
    [("matrix", "--model", "--json", "X", "--out", "X"), ("run", "--backend", "vllm", "--json", "./X", "--out", "X/")],
    ids=lambda a: " ".join(a),
)
def test_json_and_out_on_one_path_are_refused(tmp_path, args):
    refused(repro(*args), tmp_path, 2, "are one path: --json takes a file, --out a folder")


# ---- item 3: a socket path no server can listen at


@pytest.mark.parametrize(
    "sock, msg",
    [
        ("/proc/x/s.sock", "the socket's folder /proc/x: cannot create it"),
        ("@" + "a" * 120 + "/s.sock", "bytes long, over the 107 a Unix socket's path may hold"),
        ("@notes.txt", "notes.txt exists and is not a socket"),  # the server would have replaced the file
    ],
)
def test_serve_at_a_socket_path_no_server_can_have(tmp_path, sock, msg):
    (tmp_path / "notes.txt").write_text("a user's file\n")
    sock = str(tmp_path / sock[1:]) if sock.startswith("@") else sock
    refused(repro("serve", "--idle", "5"), tmp_path, 2, msg, REPRO_SERVER=sock)
    assert (tmp_path / "notes.txt").read_text() == "a user's file\n"


# ---- item 4: nan and inf are no number of seconds


@pytest.mark.parametrize(
    "args",
    [
        ("serve", "--idle", "nan"),
        ("serve", "--idle", "inf"),
        ("matrix", "--timeout", "nan"),
        ("matrix", "--dry-run", "--timeout=-inf"),
        ("run", "--backend", "vllm", "--timeout", "inf"),
        ("gate", "--timeout", "nan", "--dry-run"),
        ("gate", "--timeout", "0"),
    ],
    ids=lambda a: " ".join(a),
)
def test_nan_and_inf_are_refused_wherever_seconds_are_read(tmp_path, args):
    refused(repro(*args), tmp_path, 2, "must be a positive, finite number of seconds")


# ---- item 5: a window below -1 (FA3 runs it without one)


@pytest.mark.parametrize("args", [("matrix", "--window", "-5"), ("run", "--backend", "vllm", "--window", "-2")])
def test_window_below_minus_one_is_refused(tmp_path, args):
    refused(repro(*args), tmp_path, 2, "--window must be -1 (no window) or >= 0")


def test_window_minus_one_and_zero_are_cases():
    from repro.case.descriptors import AttnConfig
    from repro.errors import ConfigError

    assert not AttnConfig(window_left=-1).is_local and AttnConfig(window_left=0).is_local
    with pytest.raises(ConfigError, match="window_left must be -1"):
        AttnConfig(window_left=-5)


# ---- item 6: --overlay judged before anything is made; made only where its cases can run


@pytest.mark.parametrize(
    "overlay, code, msg",
    [
        ("bogus", 2, "is not LABEL=SOURCES@BASE"),
        ("X=/nonexistent@/nonexistent", 2, "/nonexistent holds no vllm/ package of sources"),
        ("X=@sources@/nonexistent", 2, "/nonexistent holds no vllm package to take the compiled parts from"),
        ("X=@sources@@plain", 2, "has no compiled extensions to overlay"),
        ("0.24.0=@sources@@base", 4, "cannot run here: no CUDA GPU visible"),
    ],
)
def test_gate_overlay_is_judged_before_anything_is_made(tmp_path, overlay, code, msg):
    _fake_vllm(tmp_path / "sources", compiled=False)
    _fake_vllm(tmp_path / "plain", compiled=False)
    _fake_vllm(tmp_path / "base", compiled=True)
    overlay = overlay.replace("@sources", str(tmp_path / "sources")).replace("@base", str(tmp_path / "base"))
    overlay = overlay.replace("@plain", str(tmp_path / "plain"))
    refused(repro("gate", "--no-installed", "--overlay", overlay), tmp_path, code, msg)
    if code == 4:  # listing its cases makes nothing either
        before = _tree(tmp_path)
        r = _run(repro("gate", "--no-installed", "--overlay", overlay, "--dry-run"), tmp_path)
        assert r.returncode == 0 and "stale_metadata-vllm-0.24.0-under-test-audit" in r.stdout, r.stderr
        assert _tree(tmp_path) == before


# ---- item 7: --repeat is bounded (every repetition is planned and listed before any case runs)


@pytest.mark.parametrize(
    "args",
    [("gate", "--repeat", "100000000", "--dry-run"), ("matrix", "--repeat", "100000000"), ("gate", "--repeat", "0")],
    ids=lambda a: " ".join(a),
)
def test_repeat_is_bounded(tmp_path, args):
    t0 = time.time()
    refused(repro(*args), tmp_path, 2, "argument --repeat: must be 1 to 1000", timeout=60)
    assert time.time() - t0 < 30


def test_the_largest_repeat_lists_at_once(tmp_path):
    build = _fake_vllm(tmp_path / "vllm-0.25.1", compiled=True)
    t0 = time.time()
    r = _run(repro("gate", "--no-installed", "--control", f"0.25.1={build}", "--repeat", "1000", "--dry-run"), tmp_path)
    assert r.returncode == 0 and len(r.stdout.split()) == 2000 and time.time() - t0 < 60, r.stderr


# ---- item 8: gate --modes / --backends: a value twice, a backend vLLM would not name so


@pytest.mark.parametrize(
    "args, msg",
    [
        (("--modes", "audit,audit"), "--modes: audit given twice"),
        (("--modes", "memcheck,memcheck:caching"), "--modes: memcheck given twice"),  # one mode, two spellings
        (("--backends", "FLASH_ATTN,FLASH_ATTN"), "--backends: FLASH_ATTN given twice"),
        (("--backends", "flash_attn,FLASH_ATTN"), "--backends: FLASH_ATTN given twice"),
        (("--backends", "BOGUS_BACKEND"), "--backends: 'BOGUS_BACKEND' is neither a backend the auditor has a table"),
    ],
)
def test_gate_refuses_a_value_twice_and_an_unknown_backend(tmp_path, args, msg):
    build = _fake_vllm(tmp_path / "vllm-0.25.1", compiled=True)
    refused(repro("gate", "--no-installed", "--control", f"0.25.1={build}", *args, "--dry-run"), tmp_path, 2, msg)


def test_gate_takes_every_backend_vllm_names_so():
    from repro.vllm_integration.gate.case import parse_backends
    from repro.vllm_integration.plugin.backend_fields import known_name

    names = "FLASH_ATTN,triton_attn,FLASHINFER,FLEX_ATTENTION,TREE_ATTN,CUTLASS_MLA,ROCM_AITER_UNIFIED_ATTN"
    assert parse_backends(names)[:2] == ("FLASH_ATTN", "TRITON_ATTN")
    assert not any(known_name(n) for n in ("BOGUS_BACKEND", "ATTN", "FLASH", "FLASH_ATTN_", "_ATTN", "FLASH__ATTN"))


# ---- item 9: redact changes the paths and nothing else


def test_redact_keeps_every_byte_but_the_paths(tmp_path):
    odd = tmp_path / "odd.log"  # not UTF-8, CRLF line endings
    odd.write_bytes(b"\x89 start\r\nlog at /home/u/scratch/x.log\r\n\xff\xfe \xc3 end\r\n")
    png = tmp_path / "heatmap.png"  # binary: NUL bytes, and a path-like run inside
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00 /home/u/scratch/x.log \x00\xff")
    before = png.read_bytes()
    r = _run(repro("redact", str(odd), str(png)), tmp_path)
    _no_traceback(r)
    assert r.returncode == 0 and "redacted 1 file(s)" in r.stdout, r.stderr
    assert odd.read_bytes() == b"\x89 start\r\nlog at <repo>/scratch/x.log\r\n\xff\xfe \xc3 end\r\n"
    assert png.read_bytes() == before


# ---- item 10: the bisect step and repro.run.smcontrol as the README's table says


def step(*args: str) -> list[str]:
    return [sys.executable, "-m", "repro.vllm_integration.releases.bisect", "step", *args]


@pytest.mark.parametrize(
    "cmd, msg",
    [
        (step("--repo", "/nonexistent"), "--repo /nonexistent: no such folder"),
        (step("--repo", ".", "--overlay", "/nonexistent", "--check", "gate", "--", "true"), "--overlay /nonexistent"),
        (step("--check", "bogus"), "argument --check: invalid choice: 'bogus'"),
        (repro("bisect", "--vllm", ".", "--overlay", "/nonexistent"), "--overlay /nonexistent: no such folder"),
    ],
    ids=lambda c: " ".join(c[2:]) if isinstance(c, list) else c,
)
def test_bisect_step_bad_input_is_exit_2_in_one_line(tmp_path, cmd, msg):
    refused(cmd, tmp_path, 2, msg)


def test_bisect_step_and_smcontrol_explain_themselves(tmp_path):
    r = _run(step("--help"), tmp_path)
    assert r.returncode == 0 and not r.stderr
    for flag in ("--repo", "--check", "--overlay"):
        block = r.stdout.split(f"  {flag}", 1)[1].split("\n  -", 1)[0]
        assert len(block.split()) > 3, (flag, block)  # a help text, not just the metavar
    r = _run([sys.executable, "-m", "repro.run.smcontrol", "--help"], tmp_path)
    assert r.returncode == 0 and not r.stderr and r.stdout.startswith("usage: python -m repro.run.smcontrol")


# ---- items 11 and 12: the gate's pytest options as pytest users type them


def _pytest_cmd(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        "-k",
        "stale_metadata and pair",
        *args,
    ]


def _pytest(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """A pytest run of its own in the checkout (not this run's xdist worker, log folder or GPU probe)."""
    full = {k: v for k, v in _env(tmp_path, **env).items() if not k.startswith(("PYTEST_XDIST", "REPRO_RUN_LOG"))}
    full = {k: v for k, v in full.items() if not k.startswith(("REPRO_GPU_PROBE", "REPRO_GATE"))} | env
    return subprocess.run(_pytest_cmd(*args), capture_output=True, text=True, timeout=600, cwd=ROOT, env=full)


def test_gate_report_with_a_space_roots_the_run_in_the_checkout(tmp_path):
    """`--gate-report DIR` with DIR an existing folder outside the checkout: pytest picks its rootdir before any
    plugin, so it took DIR for a test path ("unrecognized arguments: --gate --gate-report"); now the same run as
    `--gate-report=DIR`."""
    out = tmp_path / "gate-out"
    out.mkdir()
    spaced = _pytest(tmp_path, "--co", "--gate-report", str(out))
    assert f"rootdir: {ROOT}" in spaced.stdout and "configfile: pyproject.toml" in spaced.stdout, spaced.stdout[:2000]
    assert spaced.returncode == 0 and "ignored: the gate's options take effect in a gate run only" in spaced.stderr
    for form in (("--gate-report", str(out)), (f"--gate-report={out}",)):
        r = _pytest(tmp_path, "-q", "--gate", *form)
        _no_traceback(r)
        assert "unrecognized arguments" not in r.stderr, r.stderr
        if "GATE FAILED: no GPU case can run here" in r.stdout + r.stderr:  # no GPU here: one line, exit 1
            assert r.returncode == 1, (form, r.returncode, r.stderr)
    assert not any(out.iterdir())  # the gate stopped before any case ran: no report to write


@pytest.mark.parametrize(
    "args, env, msg",
    [
        (("--gate-require", "bogus"), {}, "--gate-require bogus: unknown gate requirement"),
        (("--gate", "--gate-require", "mig,bogus"), {}, "--gate-require mig,bogus: unknown gate requirement"),
        (("--gate",), {"REPRO_GATE_REQUIRE": "bogus"}, "REPRO_GATE_REQUIRE=bogus: unknown gate requirement"),
    ],
)
def test_gate_require_bogus_is_bad_input_with_or_without_gate(tmp_path, args, env, msg):
    _env(tmp_path)  # the temp folder exists before
    before = _tree(tmp_path)
    r = _pytest(tmp_path, *args, **env)
    _no_traceback(r)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, (r.returncode, r.stderr)
    assert _tree(tmp_path) == before


def test_the_options_come_from_conftest_without_the_entry_point(tmp_path):
    """A checkout used without `pip install -e .`: conftest.py loads the same plugin (registered once either way)."""
    r = _pytest(tmp_path, "--co", "-q", "--gate-require", "bogus", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    assert r.returncode == 2 and "--gate-require bogus: unknown gate requirement" in r.stderr, r.stderr


# ---- item 13: every value judged before a build or a GPU is looked for


@pytest.mark.parametrize(
    "args, msg",
    [
        (("gate", "--no-installed", "--out", "/proc/x"), "--out /proc/x: cannot create it"),
        (("gate", "--no-installed", "--logs", "/proc/x"), "--logs /proc/x: cannot create it"),
        (("gate", "--no-installed", "--cache-dir", "/proc/x"), "--cache-dir /proc/x: cannot create it"),
        (("gate", "--no-installed", "--compare-paths", "--paths", "bogus"), "--paths bogus: pick each from old,"),
        (("gate", "--no-installed", "--compare-paths", "--paths", "old,old"), "at most once"),
        (("gate", "--no-installed", "--paths", "old"), "--paths old: picks the paths of --compare-paths"),
        (("run", "--backend", "vllm", "--backend-path", "@notes.txt"), "not a shared library"),
        (
            ("run", "--backend", "vllm", "--backend-path", "@lib"),
            "vllm takes vLLM's _vllm_fa3_C*.so file, not a folder",
        ),
        (("run", "--backend", "upstream", "--backend-path", "@lib"), "upstream takes a folder holding flash_attn_3/"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, tuple) else None,
)
def test_bad_values_are_judged_before_builds_or_a_gpu(tmp_path, args, msg):
    (tmp_path / "notes.txt").write_text("not a library\n")
    (tmp_path / "lib").mkdir()
    args = [str(tmp_path / a[1:]) if a.startswith("@") else a for a in args]
    refused(repro(*args), tmp_path, 2, msg)


# ---- item 14: vllm-check on a zip without vllm/ names the file given


def test_vllm_check_of_a_zip_without_vllm_names_the_file(tmp_path):
    whl = tmp_path / "random.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("other/__init__.py", "")
    r = refused(repro("vllm-check", str(whl)), tmp_path, 2, f"{whl}: not a vLLM wheel (no vllm/ package inside)")
    assert str(tmp_path / "tmp") not in r.stderr


def test_vllm_check_names_the_wheel_when_its_tree_is_untestable(tmp_path):
    from repro.vllm_integration.releases.compat import check_source

    whl = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("other/__init__.py", "")
    c = check_source(whl)  # the source check itself (the CLI refuses such a wheel before it)
    assert c.verdict == "untestable" and c.source == whl.name and c.reason.startswith(f"{whl.name}: not a vLLM"), c


# ---- item 16: with REPRO_VLLM_WHEELS, each wheel is held to its own recorded torch pin


def _wheel(folder: Path, version: str, torch: str) -> None:
    with zipfile.ZipFile(folder / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl", "w") as z:
        z.writestr(
            f"vllm-{version}.dist-info/METADATA", f"Name: vllm\nVersion: {version}\nRequires-Dist: torch=={torch}\n"
        )


@pytest.mark.parametrize("pin_033, code", [("2.14.0", 0), ("2.11.0", 1)])
def test_wheel_pins_are_each_held_to_their_record(tmp_path, pin_033, code):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "0.26.0", "2.11.0")
    _wheel(wheels, "0.33.0", pin_033)  # the record says 2.14.0
    test = "tests/test_overlay_abi.py::test_release_wheels_pin_the_torch_recorded_for_them"
    full = {k: v for k, v in _env(tmp_path).items() if not k.startswith("PYTEST_XDIST")}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**full, "REPRO_VLLM_WHEELS": str(wheels)},
    )
    assert r.returncode == code and ("1 passed" if code == 0 else "1 failed") in r.stdout, r.stdout[-2000:]


# ---- item 17: a server per checkout


def test_two_checkouts_keep_a_server_each(tmp_path):
    """`serve` in a second checkout started its server on the first's socket, stopping the first's server."""
    other = tmp_path / "other-checkout"
    shutil.copytree(ROOT / "repro", other / "repro", ignore=shutil.ignore_patterns("__pycache__"))
    runtime = Path(tempfile.mkdtemp(prefix="r28-"))  # short: a socket's path holds 107 bytes, tmp_path's are long
    sock_dir = runtime / f"repro-{os.getuid()}"

    def serve(checkout: Path, *args: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in _env(tmp_path, XDG_RUNTIME_DIR=str(runtime)).items() if k != "PYTHONPATH"}
        cmd = [sys.executable, "-m", "repro", "serve", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=checkout, env=env)

    try:
        first, second = serve(ROOT, "--idle", "120"), serve(other, "--idle", "120")
        assert first.returncode == 0 and second.returncode == 0, (first.stderr, second.stderr)
        a, b = serve(ROOT, "--status").stdout, serve(other, "--status").stdout
        assert "runs this code" in a and "runs this code" in b, (a, b)
        assert a.split(":")[0] != b.split(":")[0]  # "repro server at <socket>": two sockets
        assert len(list(sock_dir.glob("server-*.sock"))) == 2
    finally:
        stopped = [serve(ROOT, "--stop").stdout, serve(other, "--stop").stdout]
    left = list(runtime.iterdir())
    if not left:
        runtime.rmdir()
    assert all("stopped the repro server" in s for s in stopped), stopped
    assert not left, left  # both stopped: no socket, no log, no repro-<uid>/ folder left
