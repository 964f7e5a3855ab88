"""results/'s records: a packed record and a new folder read alike; `python -m repro records` packs a new one and
writes the index from the records and git (a record removed from the tree keeps its line, with the commit it was last
present at); `--stale` names the README GPU command whose code changed after its last record (exit 1), and no other.
On temporary git repositories made here; then the checkout's own index against its results/ and README."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from repro.report import records
from repro.report.stale import COMMANDS, code_paths
from tests.commands import ROOT, main_in, run_in, run_repro

GATE_LINE = "python -m repro gate --no-installed --vllm 0.26.0=<path>/v0260 --control 0.25.1=<path>/v0251"


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    r = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, env={**env, "PATH": "/usr/bin:/bin"}
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _write(repo: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)


def _commit(repo: Path, message: str) -> str:
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", message)
    return _git(repo, "rev-parse", "HEAD")


def _record(command: str, outcome: str = "PASS") -> dict[str, str]:
    doc = {
        "kind": "vllm-gate",
        "environment": {"when": "2026-12-03T09:05:19+00:00", "command": command},
        "outcome": outcome,
        "builds": [{"build": "0.26.0", "role": "under-test"}],
        "cases": [{"case": "a", "verdict": "clean"}, {"case": "b", "verdict": "crash"}],
    }
    return {"results.json": json.dumps(doc), "logs/a.out.log": "the case's own log\n"}


def _records(*args: str, root: Path):
    """`python -m repro records ARGS --root ROOT` through repro.cli.main in this process (tests/commands.py main_in);
    the first test below runs it as a real subprocess."""
    return main_in(["records", *args, "--root", str(root)], root.parent)


@pytest.fixture
def repo(tmp_path):
    """A checkout with the README's gate line, the gate's command module importing the code it runs, one record."""
    repo = tmp_path / "repo"
    _git(tmp_path, "init", "-q", str(repo))
    _write(
        repo,
        {
            "README.md": f"```bash\n{COMMANDS[0].readme}  # a Hopper GPU\n```\n",
            "repro/__init__.py": "",
            "repro/cli/__init__.py": "",
            "repro/cli/vllm.py": "from repro.vllm_integration.gate import run\n",
            "repro/cli/matrix.py": "import repro.attention.worker\n",
            "repro/attention/worker.py": "",
            "repro/vllm_integration/__init__.py": "",
            "repro/vllm_integration/gate/__init__.py": "",
            "repro/vllm_integration/gate/run.py": "def run_gate():\n    return 'repro.vllm_integration.gate.fork'\n",
            "repro/vllm_integration/gate/fork.py": "",
        },
    )
    _commit(repo, "code")
    _write(repo, {f"results/rec-a/{k}": v for k, v in _record(GATE_LINE).items()})
    return repo


def test_a_packed_record_reads_as_its_folder_did(tmp_path):
    folder = tmp_path / "results" / "r"
    _write(folder, {"results.json": "{}", "logs/x.out.log": "log", "sub/paths.json": "{}"})
    before = records.members(folder, lambda rel: True)
    packed = records.pack(folder)
    assert not folder.exists() and packed.name == "r.tar.xz"
    assert records.members(packed, lambda rel: True) == before
    again = records.unpack(packed, tmp_path / "again")
    assert records.members(again, lambda rel: True) == before
    assert records.records(tmp_path / "results") == {"r": tmp_path / "results" / "r.tar.xz"}


def test_the_tests_read_a_packed_record_and_a_new_folder_alike(tmp_path):
    from tests.records import Results

    results = tmp_path / "results"
    for name in ("old", "new"):
        _write(results / name, {"results.json": json.dumps({"name": name}), "logs/a.out.log": name})
    records.pack(results / "old")
    r = Results(results)
    assert r.names() == ["new", "old"]
    assert sorted(json.loads(p.read_text())["name"] for p in r.glob("*/results.json")) == ["new", "old"]
    assert (r / "new/logs/a.out.log").read_text() == "new" and (r / "old" / "logs" / "a.out.log").read_text() == "old"
    assert (r / "old") == (r / "old")  # unpacked once: the same folder every time


def test_packing_the_same_files_gives_the_same_bytes(tmp_path):
    out = []
    for n in ("one", "two"):
        _write(tmp_path / n / "rec", {"results.json": "{}", "logs/a.log": "x"})
        out.append(records.pack(tmp_path / n / "rec").read_bytes())
    assert out[0] == out[1]


def test_an_archive_with_a_member_outside_its_record_is_refused(tmp_path):
    import io
    import tarfile

    bad = tmp_path / "rec.tar.xz"
    with tarfile.open(bad, "w:xz") as tar:
        tar.addfile(tarfile.TarInfo("../escape"), io.BytesIO(b""))
    with pytest.raises(ValueError, match="not a file under rec/"):
        records.unpack(bad, tmp_path / "out")


def test_add_packs_a_new_record_and_indexes_it_with_the_commit_that_added_it(repo):
    added = _commit(repo, "record rec-a")
    r = run_repro("records", "--add", "rec-a", "--root", str(repo))
    assert r.returncode == 0, r.stderr
    assert (repo / "results" / "rec-a.tar.xz").is_file() and not (repo / "results" / "rec-a").exists()
    (entry,) = json.loads((repo / "results" / "index.json").read_text())["records"]
    assert entry["name"] == "rec-a" and entry["stored"] == "results/rec-a.tar.xz"
    assert entry["commit"] == added and entry["committed"] is True
    assert entry["commands"] == [GATE_LINE] and entry["recorded"] == "2026-12-03T09:05:19+00:00"
    assert entry["builds"] == ["vLLM 0.26.0 (under-test)"] and entry["shows"] == "PASS; 2 cases: 1 clean, 1 crash"


def test_a_record_not_committed_yet_is_indexed_at_head_and_says_so(repo):
    head = _git(repo, "rev-parse", "HEAD")
    assert _records("--add", "rec-a", "--note", "what it shows", root=repo).returncode == 0
    (entry,) = json.loads((repo / "results" / "index.json").read_text())["records"]
    assert (entry["commit"], entry["committed"], entry["note"]) == (head, False, "what it shows")


def test_a_removed_record_keeps_its_index_line_with_where_it_was_last_present(repo):
    last = _commit(repo, "record rec-a")
    _git(repo, "rm", "-rq", "results/rec-a")
    _write(repo, {"results/rec-b/results.json": json.dumps({"environment": {"command": "python -m repro matrix"}})})
    _commit(repo, "curated")
    assert _records("--index", root=repo).returncode == 0
    index = {e["name"]: e for e in json.loads((repo / "results" / "index.json").read_text())["records"]}
    assert index["rec-a"]["stored"] is None and index["rec-a"]["last_present"] == last
    assert index["rec-a"]["commands"] == [GATE_LINE]  # read from git at that commit
    assert index["rec-b"]["stored"] == "results/rec-b/"  # a folder not packed yet is a record too


def test_stale_names_the_command_whose_code_changed_after_its_last_record(repo):
    _commit(repo, "record rec-a")
    assert _records("--add", "rec-a", root=repo).returncode == 0
    _commit(repo, "packed")
    r = _records("--stale", root=repo)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        f"fresh  gate: results/rec-a ({_git(repo, 'log', '--format=%H', '-2').split()[1][:10]}) ran the code it runs now"
    ]
    _write(repo, {"repro/attention/worker.py": "# the matrix's code: not the gate's\n"})
    _commit(repo, "matrix only")
    assert _records("--stale", root=repo).returncode == 0
    _write(repo, {"repro/vllm_integration/gate/fork.py": "SERVES = 1  # named as a string by run.py\n"})
    changed = _commit(repo, "the gate's forkserver")
    r = _records("--stale", root=repo)
    assert r.returncode == 1
    assert r.stdout.startswith("STALE  gate: results/rec-a") and changed[:10] in r.stdout
    assert "repro/vllm_integration/gate/fork.py" in r.stdout


def test_a_change_of_comments_and_docstrings_alone_leaves_a_record_fresh_and_says_so(repo):
    _commit(repo, "record rec-a")
    assert _records("--add", "rec-a", root=repo).returncode == 0
    _commit(repo, "packed")
    run = '"""The gate."""\n\n\ndef run_gate():\n    """Runs it."""\n    return "repro.vllm_integration.gate.fork"  # the forkserver\n'
    _write(repo, {"repro/vllm_integration/gate/run.py": run})
    _commit(repo, "docstrings and a comment")
    r = _records("--stale", root=repo)
    assert r.returncode == 0 and "changed since in comments and docstrings only" in r.stdout, r.stdout
    _write(repo, {"repro/vllm_integration/gate/run.py": run.replace("gate.fork", "gate.keep")})
    _commit(repo, "a string the code returns")
    r = _records("--stale", root=repo)
    assert r.returncode == 1 and "repro/vllm_integration/gate/run.py" in r.stdout, r.stdout


def test_a_change_undone_since_leaves_a_record_fresh(repo):
    """Code changed after the record, then put back as it was: no difference between what the record ran and what the
    command runs now, so fresh (it said STALE with "(unknown)" changed)."""
    _commit(repo, "record rec-a")
    assert _records("--add", "rec-a", root=repo).returncode == 0
    _commit(repo, "packed")
    run = repo / "repro/vllm_integration/gate/run.py"
    before = run.read_text()
    _write(repo, {"repro/vllm_integration/gate/run.py": before + "X = 1\n"})
    _commit(repo, "a change")
    assert _records("--stale", root=repo).returncode == 1
    _write(repo, {"repro/vllm_integration/gate/run.py": before})
    _commit(repo, "undone")
    r = _records("--stale", root=repo)
    assert r.returncode == 0 and "ran the code it runs now" in r.stdout and "(unknown)" not in r.stdout, r.stdout


@pytest.mark.parametrize("ran", ["this commit's code", "other code"])
def test_a_record_whose_run_says_it_ran_other_code_than_its_commit_is_stale(repo, ran):
    """A record carries the digest of the harness code its run ran (environment.harness_code); `--stale` checks it
    against the commit the record is indexed at, instead of trusting that it was added on the code that made it."""
    from repro.report.environment import harness_code

    code = harness_code(repo) if ran == "this commit's code" else "0" * 20
    doc = json.loads((repo / "results" / "rec-a" / "results.json").read_text())
    doc["environment"]["harness_code"] = code
    (repo / "results" / "rec-a" / "results.json").write_text(json.dumps(doc))
    head = _git(repo, "rev-parse", "HEAD")
    assert _records("--add", "rec-a", root=repo).returncode == 0  # indexed at HEAD, the code of its run or not
    r = _records("--stale", root=repo)
    if ran == "this commit's code":
        assert r.returncode == 0 and r.stdout.startswith("fresh  gate: results/rec-a"), r.stdout
    else:
        assert r.returncode == 1 and r.stdout.startswith(f"STALE  gate: results/rec-a ({head[:10]}): its run's"), (
            r.stdout
        )
        assert "harness code is not that commit's" in r.stdout


def test_a_record_added_after_later_commits_is_judged_from_the_commit_whose_code_it_ran(repo):
    """A record made on one commit and added after more (a GPU run, then fixes, then the record): its run's digest
    names the earlier commit, and `--stale` says what changed since that one, where it is indexed too."""
    from repro.report.environment import harness_code

    ran = _commit(repo, "the code a GPU run ran")
    doc = json.loads((repo / "results" / "rec-a" / "results.json").read_text())
    doc["environment"]["harness_code"] = harness_code(repo)  # the code of `ran`
    doc["environment"]["when"] = "2099-01-01T00:00:00+00:00"  # the newest record of the command
    _write(repo, {"repro/vllm_integration/gate/fork.py": "SERVES = 2  # a fix after the run\n"})
    fixed = _commit(repo, "a fix after the GPU run")
    _write(repo, {"results/rec-b/results.json": json.dumps(doc)})
    assert _records("--add", "rec-b", root=repo).returncode == 0  # indexed at HEAD: the fix
    _commit(repo, "the record added")
    r = _records("--stale", root=repo)
    assert r.returncode == 1, r.stdout
    want = f"STALE  gate: results/rec-b ({ran[:10]}, indexed at {fixed[:10]}) is older than {fixed[:10]}, which changed"
    assert r.stdout.startswith(want) and "repro/vllm_integration/gate/fork.py" in r.stdout, r.stdout


def test_stale_counts_a_readme_command_with_no_record(repo):
    _write(repo, {"README.md": f"{COMMANDS[0].readme}\n{COMMANDS[-1].readme} here\n"})
    _commit(repo, "readme gives the matrix too")
    r = _records("--stale", root=repo)
    assert r.returncode == 1 and "STALE  matrix: no record" in r.stdout


def test_a_removed_packed_record_is_read_from_git_under_its_own_name(repo):
    """A packed record (NAME.tar.xz) committed, then removed from the tree: the index reads it from git at the commit
    where it was last present, as an archive of its own name (its members are checked to lie under NAME/)."""
    assert _records("--add", "rec-a", root=repo).returncode == 0
    last = _commit(repo, "record rec-a, packed")
    _git(repo, "rm", "-q", "results/rec-a.tar.xz")
    _commit(repo, "curated")
    r = _records("--index", root=repo)
    assert r.returncode == 0, r.stderr
    index = {e["name"]: e for e in json.loads((repo / "results" / "index.json").read_text())["records"]}
    assert index["rec-a"]["stored"] is None and index["rec-a"]["last_present"] == last
    assert index["rec-a"]["commands"] == [GATE_LINE]


def test_a_damaged_record_left_in_git_history_is_refused_in_one_line_before_anything_is_written(repo):
    assert _records("--add", "rec-a", root=repo).returncode == 0
    packed = repo / "results" / "rec-a.tar.xz"
    packed.write_bytes(packed.read_bytes()[:200])  # truncated, then committed, then removed from the tree
    _commit(repo, "a damaged record")
    _git(repo, "rm", "-q", "results/rec-a.tar.xz")
    _commit(repo, "curated")
    index = (repo / "results" / "index.json").read_bytes()
    r = _records("--index", root=repo)
    assert r.returncode == 2 and "a record in git history cannot be read" in r.stderr, r.stderr
    assert (repo / "results" / "index.json").read_bytes() == index


def test_stale_outside_a_git_checkout_is_bad_input(tmp_path):
    (tmp_path / "checkout" / "results").mkdir(parents=True)
    r = _records("--stale", root=tmp_path / "checkout")
    assert r.returncode == 2 and "not a git checkout" in r.stderr and "Traceback" not in r.stderr


def test_the_code_a_command_runs_follows_imports_and_module_names(repo):
    paths = code_paths(repo, ("repro/cli/vllm.py",))
    assert "repro/vllm_integration/gate/fork.py" in paths  # named as a string
    assert "repro/vllm_integration/gate/__init__.py" in paths and "repro/attention/worker.py" not in paths


# the checkout's own records


def _index() -> dict[str, dict]:
    return records.load_index(ROOT / "results")


def test_every_record_in_results_has_its_index_line_and_every_stored_line_its_record():
    stored = {
        n: p.relative_to(ROOT).as_posix() + ("/" if p.is_dir() else "")
        for n, p in records.records(ROOT / "results").items()
    }
    index = _index()
    assert {n: index.get(n, {}).get("stored") for n in stored} == stored, "python -m repro records --index"
    assert {n for n, e in index.items() if e["stored"]} == set(stored)
    assert all(e["commit"] and (e["stored"] or e["last_present"]) for e in index.values())


def test_the_readme_cites_only_records_in_results():
    """Every record README.md and docs/vllm-gate.md cite is in results/ (packed or a folder) with its index line."""
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "vllm-gate.md").read_text()
    # a record's name starts in lower case (results/NAME is the README's placeholder)
    cited = set(re.findall(r"results/([a-z0-9][\w.-]*?)(?:/|`|\)|,|\s)", text)) - records.NOT_RECORDS
    cited = {c for c in cited if not c.endswith((".md", ".json", ".txt"))}
    index = _index()
    assert cited and all(index.get(c, {}).get("stored") for c in cited), sorted(
        c for c in cited if not index.get(c, {}).get("stored")
    )


def test_the_stale_check_knows_the_readmes_gpu_commands():
    """The README's gate line, its CI line and the matrix are among the commands `records --stale` checks: a README
    that changes their wording must change repro/report/stale.py's COMMANDS with it."""
    from repro.report.stale import shown

    names = {c.name for c in shown((ROOT / "README.md").read_text())}
    assert {"gate", "pytest GPU tier (the CI line)", "matrix"} <= names, names


def test_unpack_writes_every_record_as_its_folder(repo):
    assert _records("--add", "rec-a", root=repo).returncode == 0
    _write(repo, {"results/rec-new/results.json": "{}"})  # a new record, not packed yet
    r = _records("--unpack", str(repo / "out"), root=repo)
    assert r.returncode == 0, r.stderr
    assert (repo / "out" / "results" / "rec-a" / "logs" / "a.out.log").read_text() == "the case's own log\n"
    assert (repo / "out" / "results" / "rec-new" / "results.json").read_text() == "{}"


# --- `records --add`: all or nothing, the index built once ----------------------------------------------------------


def _tree(results: Path) -> dict[str, bytes | None]:
    """Everything under results/, hidden temporaries included: path -> bytes (None for a folder)."""
    return {p.relative_to(results).as_posix(): None if p.is_dir() else p.read_bytes() for p in results.rglob("*")}


@pytest.fixture
def two(repo):
    """The repo with a second new record and an index already written: `--add rec-a rec-b` has two folders to pack."""
    _write(repo, {f"results/rec-b/{k}": v for k, v in _record(GATE_LINE, "AFFECTED").items()})
    (repo / "results" / "index.json").write_text('{"generated_by": "before", "records": []}\n')
    return repo


def test_a_ctrl_c_while_packing_leaves_every_record_folder_and_the_index_as_they_were(two, monkeypatch):
    """Ctrl-C while the second record is packed (xz is slow): before, the first record's folder was already gone,
    packed, with no line in the index; now nothing under results/ has changed, no temporary is left."""
    import tarfile

    before, opened = _tree(two / "results"), []
    real = tarfile.open

    def interrupted(*args, **kwargs):
        opened.append(args)
        if len(opened) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(tarfile, "open", interrupted)
    r = _records("--add", "rec-a", "rec-b", "--note", "n", root=two)
    assert r.returncode == 130 and "interrupted" in r.stderr, (r.returncode, r.stderr)
    assert _tree(two / "results") == before


@pytest.mark.parametrize("step", ["write_text", "replace"])
def test_a_failure_writing_the_index_leaves_every_record_folder_and_the_index_as_they_were(two, monkeypatch, step):
    """results/index.json cannot be written (a full disk, once): its temporary (.index.json.XXXX) not written, or not
    renamed into place after both archives were. Before, the record was packed and its folder removed with no index
    line; now the archives already renamed into place are taken back, the folders stay, no temporary is left."""
    before, failed = _tree(two / "results"), []
    real = getattr(Path, step)

    def failing(self, *args, **kwargs):
        target = Path(args[0]) if step == "replace" else self
        if (
            target.name == "index.json" if step == "replace" else target.name.startswith(".index.json.")
        ) and not failed:
            failed.append(target.name)
            raise OSError(28, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, step, failing)
    with pytest.raises(OSError, match="No space left"):
        _records("--add", "rec-a", "rec-b", root=two)
    assert failed and _tree(two / "results") == before


# `records --add rec-a rec-b` in a process of its own, sent `what` (SIGINT, SIGTERM; KILL: it ends at once, as by
# SIGKILL) at one step: `at` "index" as the index is renamed into place (the archives already are), "packing" as the
# index's temporary is written
SENT = """
import os, signal, sys
from pathlib import Path
from repro.cli import main
root, what, at = sys.argv[1:]
step = "replace" if at == "index" else "write_text"
real = getattr(Path, step)
def sent(self, *args, **kwargs):
    if (Path(args[0]).name == "index.json") if at == "index" else self.name.startswith(".index.json."):
        os._exit(9) if what == "KILL" else os.kill(os.getpid(), getattr(signal, what))
    return real(self, *args, **kwargs)
setattr(Path, step, sent)
sys.exit(main(["records", "--add", "rec-a", "rec-b", "--root", root]))
"""


def _sent(root: Path, what: str, at: str) -> subprocess.CompletedProcess:
    return run_in([sys.executable, "-c", SENT, str(root), what, at], root.parent, timeout=120)


@pytest.mark.parametrize("what", ["SIGINT", "SIGTERM"])
def test_a_signal_during_the_renames_is_held_and_the_add_completes_and_says_so(two, what):
    """Before: SIGTERM, held by a signal mask with its default action, killed the process once the mask was lifted,
    leaving the folders moved aside (results/.rec-*); a Ctrl-C made it exit 130 "interrupted" though every rename was
    made. Now either is held until the renames and removals are done: exit 0, everything in place, nothing left."""
    r = _sent(two, what, "index")
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert f"{what} held until every rename was made" in r.stderr and "interrupted" not in r.stderr
    assert sorted(_tree(two / "results")) == ["index.json", "rec-a.tar.xz", "rec-b.tar.xz"]
    assert r.stdout.splitlines()[-1] == f"wrote {two}/results/index.json"


def test_a_sigterm_while_packing_leaves_results_as_it_was(two):
    """SIGTERM before the renames: as Ctrl-C (exit 130, the temporaries removed); before, it killed the process and
    left the archives' hidden temporaries in results/."""
    before = _tree(two / "results")
    r = _sent(two, "SIGTERM", "packing")
    assert r.returncode == 130 and "interrupted" in r.stderr, (r.returncode, r.stderr)
    assert _tree(two / "results") == before


def test_a_kill_as_the_index_is_replaced_leaves_the_index_there(two):
    """Killed (SIGKILL) as the new index is renamed into place: the index there is replaced atomically, its hard link
    kept aside, so results/index.json is still the old one (before: it was moved aside first, and a kill between left
    no index.json: the next `records --index` dropped every note)."""
    old = (two / "results" / "index.json").read_bytes()
    r = _sent(two, "KILL", "index")
    assert r.returncode == 9, r.stderr
    assert (two / "results" / "index.json").read_bytes() == old


def test_add_describes_each_record_once_and_writes_archives_and_index_together(two, monkeypatch):
    """The index is built once: each record's files are described once (before: three times, the check, a trial
    index, the index written); then both archives and the index are in place and both folders gone."""
    described = []
    real = records.describe
    monkeypatch.setattr(records, "describe", lambda files: described.append(files) or real(files))
    r = _records("--add", "rec-a", "rec-b", root=two)
    assert r.returncode == 0, r.stderr
    assert len(described) == 2
    assert sorted(_tree(two / "results")) == ["index.json", "rec-a.tar.xz", "rec-b.tar.xz"]  # no temporary left
    index = {e["name"]: e for e in json.loads((two / "results" / "index.json").read_text())["records"]}
    assert {n: e["stored"] for n, e in index.items()} == {f"rec-{x}": f"results/rec-{x}.tar.xz" for x in "ab"}
    assert index["rec-b"]["shows"].startswith("AFFECTED")
    assert r.stdout.splitlines() == [f"packed {two}/results/rec-{x}.tar.xz" for x in "ab"] + [
        f"wrote {two}/results/index.json"
    ]
