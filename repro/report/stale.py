"""Which of the README's GPU commands have no record of the code they run now (`python -m repro records --stale`):
each command's last record (results/index.json, by when it was recorded) against the last commit that changed the
code the command runs (the files its entry points import, followed through repro, imports inside functions and
module names passed as strings included). Stale: that commit is not an ancestor of the record's commit."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from repro.report.environment import HARNESS, code_digest
from repro.report.records import git, load_index

GATE_ENTRIES = (
    "repro/cli/vllm.py",
    "repro/vllm_integration/gate/worker.py",  # the case process (python -m)
    "repro/run/forkserver.py",  # the forkserver (python -m)
    "repro/vllm_integration/plugin/__init__.py",  # loaded by vLLM (entry point)
    "repro/run/own_alloc.c",  # memcheck:own's allocator, built by nvcc
)
MATRIX_ENTRIES = (
    "repro/cli/matrix.py",
    "repro/attention/worker.py",
    "repro/specdecode/worker.py",
    "repro/run/server.py",
    "repro/run/forkserver.py",  # the forkserver (python -m)
)
PYTEST_ENTRIES = ("conftest.py", "cases", "repro/pytest_options.py", *MATRIX_ENTRIES[1:], *GATE_ENTRIES[1:])
# options that leave `repro gate` the README's line: which builds, where, how long, where caches and reports go
_PLAIN_GATE = {"--no-installed", "--vllm", "--control", "--torch", "--deadline", "--timeout", "--jobs", "--out"}
_PLAIN_GATE |= {"--cache-dir", "--devices"}


def _argv(command: str) -> tuple[dict[str, str], list[str]]:
    """(the environment variables set before it, its arguments after `python -m`)."""
    words = shlex.split(command)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    if "-m" in words:
        words = words[words.index("-m") + 1 :]
    return env, words


def _options(words: list[str]) -> dict[str, str]:
    out = {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            k, eq, v = w.partition("=")
            out[k] = v if eq else (words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("-") else "")
    return out


def _gate(command: str) -> dict[str, str] | None:
    env, words = _argv(command)
    if words[:2] != ["repro", "gate"] or any(k.startswith(("REPRO_", "TORCH")) for k in env):
        return None
    return _options(words)


def _readme_gate(command: str) -> bool:
    o = _gate(command)
    return o is not None and set(o) <= _PLAIN_GATE


def _gate_modes(*kinds: str) -> Callable[[str], bool]:
    def runs(command: str) -> bool:
        o = _gate(command)
        return o is not None and "--compare-paths" not in o and any(k in o.get("--modes", "") for k in kinds)

    return runs


def _methods_all(command: str) -> bool:
    o = _gate(command)
    return o is not None and "--compare-paths" not in o and "all" in o.get("--methods", "").split(",")


def _compare_paths(command: str) -> bool:
    o = _gate(command)
    return o is not None and "--compare-paths" in o


def _pytest_gate(command: str) -> bool:
    _, words = _argv(command)
    return "pytest" in " ".join(words[:2]) and "--gate" in " ".join(words) and "gpu" in words


def _matrix(command: str) -> bool:
    _, words = _argv(command)
    return words[:2] == ["repro", "matrix"] and "--model" not in words


@dataclass(frozen=True)
class ReadmeCommand:
    """A GPU command the README gives: what README.md shows of it, which recorded commands run it, its entry files."""

    name: str
    readme: str
    runs: Callable[[str], bool]
    entries: tuple[str, ...]


COMMANDS = (
    ReadmeCommand("gate", "python -m repro gate ", _readme_gate, GATE_ENTRIES),
    ReadmeCommand(
        "gate, SM configurations",
        "--modes audit,plain,sm_margin:16,mps:16",
        _gate_modes("sm_margin:", "mps:"),
        GATE_ENTRIES,
    ),  # noqa: E501
    ReadmeCommand(
        "gate --compare-paths", "--compare-paths --paths old,kept-cold,kept-warm", _compare_paths, GATE_ENTRIES
    ),  # noqa: E501
    ReadmeCommand("gate --methods all (for CI)", "use `--methods all`", _methods_all, GATE_ENTRIES),
    ReadmeCommand("gate --modes hidden-sweep", "--modes hidden-sweep", _gate_modes("hidden-sweep"), GATE_ENTRIES),
    ReadmeCommand("gate --modes memcheck:own", "--modes memcheck:own", _gate_modes("memcheck:own"), GATE_ENTRIES),
    ReadmeCommand(
        "pytest GPU tier (the CI line)", "-m gpu -k stale_metadata -n 8 --gate", _pytest_gate, PYTEST_ENTRIES
    ),  # noqa: E501
    ReadmeCommand("matrix", "python -m repro matrix --out", _matrix, MATRIX_ENTRIES),
)


def shown(readme: str) -> list[ReadmeCommand]:
    """The GPU commands this README gives (a command it no longer shows is not its claim)."""
    return [c for c in COMMANDS if c.readme in readme]


def _module_file(root: Path, dotted: str) -> Path | None:
    base = root.joinpath(*dotted.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _imported(root: Path, path: Path) -> tuple[set[Path], set[Path]]:
    """(the project's files a Python file imports anywhere in it or names as strings ("repro.x.y": started with
    python -m, or imported at run time), the __init__.py of the packages above them). A package's __init__.py counts
    as code the command runs, but what it imports in turn is followed only when the command imports the package
    itself: repro/cli/__init__.py imports every subcommand, and `gate` runs none of the others."""
    tree = ast.parse(path.read_text(), str(path))
    here = path.relative_to(root).with_suffix("").parts
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = here[: len(here) - node.level]
                base = ".".join([*package, *([base] if base else [])])
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"repro(\.\w+)+", node.value)
        ):
            names.add(node.value)
    named, parents = set(), set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            if f := _module_file(root, ".".join(parts[:i])):
                (named if i == len(parts) else parents).add(f)
    return named, parents - named


def code_paths(root: Path, entries: tuple[str, ...]) -> list[str]:
    """Every file of the checkout a command runs: its entry files (a folder: its Python files) and all they import."""
    root = Path(root)
    todo: list[Path] = []
    for e in entries:
        p = root / e
        todo += sorted(p.rglob("*.py")) if p.is_dir() else [p] if p.is_file() else []
    seen: set[Path] = set()
    above: set[Path] = set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        if f.suffix == ".py":
            named, parents = _imported(root, f)
            todo += sorted(named - seen)
            above |= parents
    return sorted(p.relative_to(root).as_posix() for p in seen | above)


@dataclass(frozen=True)
class Staleness:
    command: ReadmeCommand
    record: str | None  # its last record's name
    commit: str | None  # the code that record ran
    changed_in: str | None  # the last commit that changed the code the command runs
    changed: tuple[str, ...]  # the files changed between the record's commit and that one
    text_only: bool = False  # changed since, but in comments and docstrings only
    other_code: bool = False  # its run says it ran other harness code than its commit's (environment.harness_code)
    indexed_at: str | None = None  # where its index dates it, when its run's code is an earlier commit's (`commit`)

    @property
    def stale(self) -> bool:
        return self.record is None or bool(self.changed)

    def line(self) -> str:
        head = f"{'STALE' if self.stale else 'fresh'}  {self.command.name}: "
        if self.record is None:
            return head + "no record of it in results/index.json"
        dated = f", indexed at {self.indexed_at[:10]}" if self.indexed_at else ""
        at = f"results/{self.record} ({(self.commit or '?')[:10]}{dated})"
        if self.other_code:
            return head + f"{at}: its run's harness code is not that commit's (it ran other code than it is dated to)"
        if not self.stale:
            since = (
                f" (changed since in comments and docstrings only, to {self.changed_in[:10]})" if self.text_only else ""
            )
            return head + f"{at} ran the code it runs now{since}"
        more = f" and {len(self.changed) - 3} more" if len(self.changed) > 3 else ""
        return head + f"{at} is older than {self.changed_in[:10]}, which changed {', '.join(self.changed[:3])}{more}"


def check(root: Path) -> list[Staleness]:
    """Each GPU command README.md gives, its last record and whether the code it runs changed since that record's
    commit."""
    root = Path(root)
    index = [e for e in load_index(root / "results").values() if e.get("stored")]
    readme = (root / "README.md").read_text() if (root / "README.md").is_file() else ""
    out = []
    for cmd in shown(readme):
        ran = [e for e in index if any(cmd.runs(c) for c in e.get("commands") or [])]
        if not ran:
            out.append(Staleness(cmd, None, None, None, ()))
            continue
        last = max(ran, key=lambda e: (e.get("recorded") or e.get("added") or "", e["name"]))
        paths = code_paths(root, cmd.entries)
        changed_in = git(root, "log", "-1", "--format=%H", "--", *paths)
        commit, indexed_at = last.get("commit"), None
        if commit and last.get("harness_code") and last["harness_code"] != code_at(root, commit):
            ran_at = code_commit(root, commit, last["harness_code"])
            if ran_at is None:
                out.append(Staleness(cmd, last["name"], commit, changed_in or commit, ("",), other_code=True))
                continue
            commit, indexed_at = ran_at, commit  # added after the commits that followed its run: judged from its code
        fresh = bool(commit) and _ancestor(root, changed_in, commit)
        changed = (
            () if fresh else tuple(git(root, "diff", "--name-only", f"{commit}..{changed_in}", "--", *paths).split())
        )
        if changed and commit:  # a change of comments and docstrings alone is no change of the code that ran
            changed = tuple(p for p in changed if not _same_code(root, p, commit, changed_in)) or ("",)
        if changed == ("",):
            out.append(Staleness(cmd, last["name"], commit, changed_in, (), text_only=True, indexed_at=indexed_at))
            continue
        # a change undone since (no difference between the record's code and today's): nothing it ran changed
        changed = changed or (() if fresh or commit else ("(unknown)",))
        out.append(Staleness(cmd, last["name"], commit, changed_in, changed, indexed_at=indexed_at))
    return out


def code_commit(root: Path, commit: str, digest: str, depth: int = 40) -> str | None:
    """The latest commit at or before `commit` (at most `depth` back) whose harness code is `digest`: the code a
    record's run ran, where it was added after later commits; None when none of them is."""
    for c in git(root, "rev-list", f"--max-count={depth}", commit).split():
        if code_at(root, c) == digest:
            return c
    return None


def _code(text: str) -> str | None:
    """A Python file's syntax tree less its docstrings (comments are not in it); None when it does not parse."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            if isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                if isinstance(body[0].value.value, str):
                    node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _same_code(root: Path, path: str, old: str, new: str) -> bool:
    """Does `path` hold the same code at both commits: a Python file the same tree less docstrings, any other file
    the same bytes. A file missing at either commit, or not parsing, is changed."""
    a, b = (
        subprocess.run(["git", "-C", str(root), "show", f"{c}:{path}"], capture_output=True, text=True)
        for c in (old, new)
    )
    if a.returncode or b.returncode:
        return False
    if path.endswith(".py"):
        return _code(a.stdout) is not None and _code(a.stdout) == _code(b.stdout)
    return a.stdout == b.stdout


def code_at(root: Path, commit: str) -> str | None:
    """environment.harness_code of the checkout as it was at `commit` (from git); None when git cannot say."""
    names = git(root, "ls-tree", "-r", "--name-only", commit, "--", *HARNESS).splitlines()
    names = [n for n in names if n.endswith(".py")]
    if not names:
        return None
    blobs = subprocess.run(
        ["git", "-C", str(root), "cat-file", "--batch"],
        input="".join(f"{commit}:{n}\n" for n in names).encode(),
        capture_output=True,
        check=False,
    ).stdout
    files, at = [], 0
    for n in names:  # each answer: "<sha> blob <size>\n<bytes>\n"
        head_end = blobs.index(b"\n", at)
        size = int(blobs[at:head_end].split()[2])
        files.append((n, blobs[head_end + 1 : head_end + 1 + size]))
        at = head_end + 1 + size + 1
    return code_digest(files)


def _ancestor(root: Path, older: str, newer: str) -> bool:
    r = subprocess.run(["git", "-C", str(root), "merge-base", "--is-ancestor", older, newer], capture_output=True)
    return r.returncode == 0
