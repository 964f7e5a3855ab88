"""Bisect vLLM for the stale-metadata capture defect.

`python -m repro bisect --vllm PATH --good REV --bad REV [--check source|gate]` drives `git bisect run` with
`python -m repro.vllm_integration.releases.bisect step ...`, whose exit status git understands: 0 good, 1 bad, 125
untestable. `--check source` reads the checkout (no GPU); `--check gate` runs the end-to-end gate, optionally over an
installed wheel's compiled extensions (`--overlay`) when only Python changed between the commits."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from repro import CHECKOUT, entrypoints, exit_codes
from repro.errors import AbiMismatch, ConfigError
from repro.exit_codes import Exit, Parser
from repro.vllm_integration.releases.source_check import GOOD, check_tree

_TORCH_PIN = re.compile(r"^\s*(?:Requires-Dist:\s*)?torch\s*==\s*([\w.+]+)", re.M)


def torch_pin(tree: str | Path) -> tuple[str | None, str]:
    """The torch release a vLLM tree was built for, and where that was read: a checkout's requirements/cuda.txt (or
    the older requirements-cuda.txt, or requirements/common.txt), or an installed package's vllm-*.dist-info/METADATA
    beside it. (None, what was looked at) when none says."""
    root = Path(tree)
    pkg_parent = root.parent if (root / "__init__.py").is_file() else root  # the package, or the tree holding it
    candidates = [pkg_parent / "requirements" / "cuda.txt", pkg_parent / "requirements-cuda.txt"]
    candidates += [pkg_parent / "requirements" / "common.txt"]
    candidates += sorted(pkg_parent.glob("vllm-*.dist-info/METADATA"))
    for f in candidates:
        try:
            m = _TORCH_PIN.search(f.read_text(errors="replace"))
        except OSError:
            continue
        if m:
            return m.group(1), str(f.relative_to(pkg_parent))
    return None, "no torch pin in requirements/ or a dist-info beside the package"


_TOP_IMPORT = re.compile(r"^(?:import (vllm\.[\w.]+)|from (vllm\.[\w.]+) import )", re.M)


def required_extensions(src_pkg: str | Path) -> dict[str, str]:
    """The compiled extension modules a vllm package's Python sources import unconditionally: `import vllm.X` or
    `from vllm.X import ...` at module level (in column 0: not under a try, not in a function) where the sources hold
    no vllm/X.py or vllm/X/ package. {module: first file importing it}."""
    src = Path(src_pkg)
    out: dict[str, str] = {}
    for path in sorted(src.rglob("*.py")):
        for m in _TOP_IMPORT.finditer(path.read_text(errors="replace")):
            name = m[1] or m[2]
            rel = Path(*name.split(".")[1:])
            if (src / rel).with_suffix(".py").exists() or (src / rel).is_dir():
                continue
            out.setdefault(name, str(path.relative_to(src.parent)))
    return out


def missing_extensions(src_pkg: str | Path, compiled_pkg: str | Path) -> list[str]:
    """Required extension modules (required_extensions) the compiled side has no .so for: 'module (imported by
    file)'."""
    comp = Path(compiled_pkg)
    missing = []
    for mod, where in sorted(required_extensions(src_pkg).items()):
        rel = Path(*mod.split(".")[1:])
        if not list((comp / rel.parent).glob(f"{rel.name}.*so")):
            missing.append(f"{mod} (imported by {where})")
    return missing


def abi_problem(checkout: str | Path, installed_pkg: str | Path) -> str | None:
    """Why an overlay's compiled parts cannot serve its Python sources, or None. vLLM's extensions link against one
    torch release (the wheels pin it exactly: 0.23.0, 0.25.1 and 0.26.0 all `torch==2.11.0`; 0.27 and later 2.13 or
    2.14): sources pinned to another torch call a libtorch the .so files were not built for. A side whose pin cannot
    be read is not refused (the gate's own cases then show whether the overlay runs)."""
    want, where_src = torch_pin(checkout)
    have, where_so = torch_pin(Path(installed_pkg))
    if want and have and want != have:
        return (
            f"ABI mismatch: the sources pin torch {want} ({where_src}), the compiled parts were built for torch {have} "
            f"({where_so}); overlay them on a build of the same torch release"
        )
    src_pkg = Path(checkout) / "vllm" if (Path(checkout) / "vllm").is_dir() else Path(checkout)
    missing = missing_extensions(src_pkg, installed_pkg)
    if missing:
        return (
            f"ABI mismatch: the sources import compiled extensions the other build does not have: {', '.join(missing)}; "
            "overlay them on a build with the same extension modules"
        )
    return None


def build_overlay(checkout: str | Path, installed_pkg: str | Path, dest: str | Path) -> Path:
    """A `vllm` package at dest/vllm: the checkout's Python sources, plus every compiled extension (*.so) of the
    installed wheel at the same relative path. Put dest first on PYTHONPATH. Refused (AbiMismatch) when the two sides
    pin different torch releases (abi_problem)."""
    src, inst, dest = Path(checkout) / "vllm", Path(installed_pkg), Path(dest)
    if not src.is_dir():
        raise FileNotFoundError(f"{checkout}: no vllm/ package")
    if not inst.is_dir():
        raise FileNotFoundError(f"{installed_pkg}: not an installed vllm package folder")
    if why := abi_problem(checkout, inst):
        raise AbiMismatch(why)
    out = dest / "vllm"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.so", "__pycache__"), dirs_exist_ok=True)
    n = 0
    for so in inst.rglob("*.so"):
        target = out / so.relative_to(inst)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.symlink_to(so.resolve())
            n += 1
    if n == 0:
        raise FileNotFoundError(f"{installed_pkg}: no compiled extensions to overlay")
    return out


SPECULATOR = "vllm/v1/worker/gpu/spec_decode/autoregressive/speculator.py"
# The smallest change at the spot the source check points at (0.24-0.25 layout): the draft-prefill graph manager
# becomes the decode manager class, whose capture builds dummy inputs and metadata for every pass, and its capture
# is handed what to build from instead of the target's saved attention states. Run on the H200: results/h200-vllm.
FRESH_PREFILL_CAPTURE = (
    (
        r"self\.prefill_cudagraph_manager = PrefillSpeculatorCudaGraphManager\(",
        "self.prefill_cudagraph_manager = DecodeSpeculatorCudaGraphManager(",
    ),
    (
        r"self\.prefill_cudagraph_manager\.capture\(\s*self\._prefill,\s*attn_states,",
        "self.prefill_cudagraph_manager.capture(self._prefill, self.model_state, self.input_buffers, "
        "self.block_tables, self.attn_groups, self.kv_cache_config,",
    ),
)


# The defect put back into a current release (0.32+ target_dependent_ar layout): PR #48261 reverted in spirit. The
# speculator's capture keeps the attention metadata built for the first descriptor of each (graph mode, pass) and
# hands it to every later descriptor's forward, so the draft's FULL captures run on views of buffers that later builds
# rewrote, as 0.21.0-0.25.1 did. A source mutant: the real regression the self control imitates. Run on the H200:
# results/h200-vllm-0.33-selfcontrol, h200-vllm-0.33-agree.
DRAFT_CAPTURE = "vllm/v1/worker/gpu/spec_decode/target_dependent_ar/cudagraph_utils.py"
STALE_DRAFT_CAPTURE = (
    (
        r"\n(            forward_kwargs = \{\}\n)",
        "\n            # MUTANT (repro): reuse the metadata built for another descriptor (vLLM 0.21.0-0.25.1's defect)\n"
        "            saved = self.__dict__.setdefault('_repro_mutant_attn', {})\n"
        "            attn_metadata = saved.setdefault((desc.cg_mode, warmup), attn_metadata)\n"
        "\\1",
    ),
)
# name -> (file, rewrites, the layout it knows, what it does)
PATCHES = {
    "fresh-prefill-capture": (
        SPECULATOR,
        FRESH_PREFILL_CAPTURE,
        "0.24-0.25",
        "the one-call fix of the draft prefill capture",
    ),
    "stale-draft-capture": (
        DRAFT_CAPTURE,
        STALE_DRAFT_CAPTURE,
        "0.32-0.33 target_dependent_ar",
        "the defect put back into the draft capture (a source mutant)",
    ),
}


def patched_copy(name: str, tree: str | Path, dest: str | Path) -> Path:
    """Copy tree/vllm (Python only, with its vllm-*.dist-info) to dest with PATCHES[name] applied; each rewrite must
    match once. Use dest as an overlay's sources (`gate --overlay LABEL=dest@<build>`) or a bisect checkout."""
    rel, rewrites, layout, _ = PATCHES[name]
    src, dest = Path(tree), Path(dest)
    shutil.copytree(
        src / "vllm", dest / "vllm", ignore=shutil.ignore_patterns("*.so", "__pycache__"), dirs_exist_ok=True
    )
    for info in src.glob("vllm-*.dist-info"):
        shutil.copytree(info, dest / info.name, dirs_exist_ok=True)
    path = dest / rel
    if not path.exists():
        raise FileNotFoundError(f"{tree}: no {rel} (only the {layout} layout is known)")
    text = path.read_text()
    for pattern, repl in rewrites:
        text, n = re.subn(pattern, repl, text)
        if n != 1:
            raise ValueError(f"{rel}: {pattern!r} matched {n} times, expected once")
    path.write_text(text)
    return dest


def fresh_prefill_capture(tree: str | Path, dest: str | Path) -> Path:
    """PATCHES["fresh-prefill-capture"]: the 0.24-0.25 draft prefill capture fixed."""
    return patched_copy("fresh-prefill-capture", tree, dest)


def step(repo: str, check: str, gate_cmd: list[str] | None = None, overlay: str | None = None) -> int:
    """One `git bisect run` step on the checkout's current commit."""
    if check == "source":
        v = check_tree(repo)
        said = "no known bad pattern (not run on a GPU)" if v.verdict == GOOD else v.verdict  # a pattern, not a run
        print(f"[repro bisect] {said}: {v.reason}" + (f" (layout {v.layout})" if v.layout else ""), flush=True)
        return exit_codes.source([v.verdict])
    if check == "gate":
        if not gate_cmd:
            print("[repro bisect] untestable: no gate command", flush=True)
            return Exit.UNTESTABLE
        env = dict(os.environ)
        tmp = None
        if overlay:
            tmp = tempfile.mkdtemp(prefix="repro-overlay-")
            try:
                build_overlay(repo, overlay, tmp)
            except FileNotFoundError as e:  # AbiMismatch too
                shutil.rmtree(tmp, ignore_errors=True)
                print(f"[repro bisect] untestable: {e}", flush=True)
                return Exit.UNTESTABLE
            env["PYTHONPATH"] = tmp + os.pathsep + env.get("PYTHONPATH", "")
        try:
            r = subprocess.run(gate_cmd, env=env)
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        return exit_codes.gate_step(r.returncode)
    print(f"[repro bisect] unknown check {check!r}", flush=True)
    return Exit.UNTESTABLE


@dataclass(frozen=True)
class Bisected:
    """What a bisect ended with, read from git's bisect refs (plumbing), never from its messages: the first bad commit,
    or None; whether every commit left untested but the bad one was skipped (untestable); git's log, to show."""

    first: str | None
    only_skipped: bool
    log: str


def bisect_state(repo: str) -> tuple[str | None, bool]:
    """(the first bad commit, only skipped commits left) from the bisect refs git keeps under refs/bisect/ (bad,
    good-*, skip-*): the bad commit is the first once no commit between the good ones and it is left; when every one
    left was skipped, git cannot tell which is first. Words of git's output are never read (they are translated)."""

    def out(*args: str) -> list[str]:
        r = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)
        return r.stdout.split() if r.returncode == 0 else []

    bad = out("rev-parse", "--verify", "--quiet", "refs/bisect/bad")
    if not bad:
        return None, False
    goods = out("for-each-ref", "--format=%(objectname)", "refs/bisect/good-*")
    skipped = set(out("for-each-ref", "--format=%(objectname)", "refs/bisect/skip-*"))
    left = [c for c in out("rev-list", bad[0], "--not", *goods) if c != bad[0]]
    if not left:
        return bad[0], False
    return None, all(c in skipped for c in left)


def run_bisect(
    repo: str, good: str, bad: str, check: str = "source", gate_cmd: list[str] | None = None, overlay: str | None = None
) -> Bisected:
    """git bisect over the checkout, its answer read from git's bisect refs (bisect_state). Leaves the checkout
    reset."""

    def git(*args: str, check_rc: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=check_rc)

    git("bisect", "reset", check_rc=False)
    started = git("bisect", "start", bad, good, check_rc=False)
    if started.returncode != 0:
        git("bisect", "reset", check_rc=False)
        said = (started.stderr.strip() or started.stdout.strip()).replace("\n", " ") or "no reason given"
        raise ConfigError(f"git bisect start {bad} {good} failed: {said}")
    first, _ = bisect_state(repo)
    if first is not None:  # nothing between --good and --bad: git named --bad, and a `git bisect run` now
        git("bisect", "reset", check_rc=False)  # would judge the checkout's HEAD instead and answer out of the range
        return Bisected(
            first, False, f"no commit lies between --good {good} and --bad {bad}: git named --bad, no check ran\n"
        )
    # git runs each step in the checkout's top folder: a path given relative to here would name nothing there (the
    # step's exit 2, which git reads as "bad", at every commit)
    cmd = entrypoints.command(entrypoints.BISECT, "step", "--repo", os.path.abspath(repo), "--check", check)
    if overlay:
        cmd += ["--overlay", os.path.abspath(overlay)]
    if gate_cmd:
        cmd += ["--", *gate_cmd]
    env = dict(os.environ)
    root = str(CHECKOUT)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(["git", "-C", repo, "bisect", "run", *cmd], capture_output=True, text=True, env=env)
    first, only_skipped = bisect_state(repo)
    git("bisect", "reset", check_rc=False)
    return Bisected(first, only_skipped, r.stdout + r.stderr)


def add_check_option(p: argparse.ArgumentParser, whose: str) -> None:
    """--check as `repro bisect` and the step take it."""
    help_ = f"source: read {whose} Python (no GPU); gate: run the gate command given after -- (default %(default)s)"
    p.add_argument("--check", choices=("source", "gate"), default="source", help=help_)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m repro.vllm_integration.releases.bisect")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    s = sub.add_parser("step", help="one bisect step: exit 0 good, 1 bad, 125 untestable, 128 bad input")
    s.add_argument("--repo", default=".", help="the vLLM checkout at the commit to judge (default: this folder)")
    add_check_option(s, "the commit's")
    s.add_argument("--overlay", help="installed vllm package folder whose compiled extensions to reuse")
    s.add_argument("gate", nargs=argparse.REMAINDER, help="-- the gate command for --check gate")
    for name, (_, _, layout, what) in PATCHES.items():
        f = sub.add_parser(name, help=f"copy a tree's vllm/ with {what}")
        f.add_argument("tree", help=f"a tree holding vllm/ in the {layout} layout")
        f.add_argument("dest", help="where the patched copy's vllm/ goes")
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        a = p.parse_args(args)
    except SystemExit as e:  # a step's bad input: 2 would tell git bisect "bad" at every commit; over 127 stops it
        raise SystemExit(Exit.ABORT if args[:1] == ["step"] and e.code == Exit.BAD_INPUT else e.code) from None
    if a.cmd == "step":  # bad input, the same at every commit: said once, before anything runs
        for flag, folder in (("--repo", a.repo), ("--overlay", a.overlay)):
            if folder is not None and not os.path.isdir(folder):
                sys.stderr.write(f"repro: error: {flag} {folder}: no such folder (git bisect run stops here)\n")
                return Exit.ABORT
    if a.cmd in PATCHES:
        try:
            print(patched_copy(a.cmd, a.tree, a.dest))
        except (FileNotFoundError, ValueError) as e:
            print(f"[repro bisect] {e}", file=sys.stderr)
            return Exit.BAD_INPUT
        return Exit.OK
    gate = [x for x in a.gate if x != "--"] or None
    try:
        return step(a.repo, a.check, gate, a.overlay)
    except Exception as e:  # exit 1 would tell git bisect "bad": a step that broke has shown nothing
        print(f"[repro bisect] untestable: {type(e).__name__}: {e}", flush=True)
        return Exit.UNTESTABLE


if __name__ == "__main__":
    sys.exit(main())
