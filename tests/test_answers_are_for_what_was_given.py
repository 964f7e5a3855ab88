"""A demanding new user's fifth round (branch rev53), each guarantee a test: a bisect answers for the checkout it was
given however the path was written, a build's label never names a folder of its own, a damaged record is an error
before anything is packed, unpacked or written (and `records --stale` that checked nothing is no answer), `vllm-check`
says "measured" only for a release's published files, and an option that would be ignored is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.commands import ROOT, fake_vllm, main_in, refused_in, tree


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=a", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


# 1. bisect: the first bad commit of the checkout named, whether its path is absolute or relative.


def test_a_bisect_of_a_checkout_given_by_a_relative_path_names_the_right_first_bad_commit(tmp_path):
    from tests.fake_vllm import MANAGER_BAD, MANAGER_GOOD, write_manager_history

    shas = write_manager_history(
        tmp_path / "vllm-repo", [MANAGER_GOOD + "\n# 0\n", MANAGER_GOOD + "\n# 1\n", MANAGER_BAD, MANAGER_BAD + "\n#\n"]
    )
    # git runs each step in the checkout: a step handed "vllm-repo" found no such folder there and exited 2, which git
    # read as bad at every commit (first bad: shas[0])
    r = main_in(["bisect", "--vllm", "vllm-repo", "--good", "HEAD~4", "--bad", "HEAD"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"first bad commit: {shas[2]} change 2" in r.stdout, r.stdout


def test_a_gate_command_after_dashes_is_refused_without_check_gate(tmp_path):
    (tmp_path / "repo").mkdir()
    _git(tmp_path / "repo", "init", "-q")
    refused_in(
        ["bisect", "--vllm", str(tmp_path / "repo"), "--", "python", "-m", "repro", "gate"],
        tmp_path,
        2,
        "runs only with --check gate",
    )


# 2. a build's label names its case ids, logs and overlay folder: never a path, never dots alone.


def test_a_build_label_is_never_dots_alone_or_a_path(tmp_path):
    src, base = fake_vllm(tmp_path / "src", compiled=False), fake_vllm(tmp_path / "base", compiled=True)
    out = str(tmp_path / "out")
    # an overlay is made at DEST/LABEL after removing what is there: DEST/.. is the folder above (the temp folder
    # itself without --out)
    for args in (
        ["--overlay", f"..={src}@{base}"],
        ["--overlay", f".={src}@{base}"],
        ["--vllm", f"..={src}"],
        ["--control", f"...={src}"],
    ):
        refused_in(["gate", *args, "--no-installed", "--out", out], tmp_path, 2, "not dots alone")
    for label in ("x/../../y", "", ".."):  # the installed build's label: a case id, so a log file's name
        refused_in(
            ["gate", "--installed-label", label, "--vllm", f"a={src}", "--out", out], tmp_path, 2, "--installed-label"
        )


# 3. a damaged record is an error, never read as a record, and nothing is half-done.


def _results(root: Path) -> Path:
    """A checkout's results/ with one good record (packed) and one whose results.json is empty."""
    from repro.report.records import pack

    results = root / "results"
    (results / "good").mkdir(parents=True)
    (results / "good" / "results.json").write_text(json.dumps({"kind": "vllm-gate", "outcome": "PASS"}))
    pack(results / "good")
    return results


def test_a_damaged_record_is_refused_before_anything_is_packed_or_indexed(tmp_path):
    root = tmp_path / "checkout"
    results = _results(root)
    (results / "new").mkdir()
    (results / "new" / "results.json").write_text(json.dumps({"kind": "vllm-gate", "outcome": "PASS"}))
    (results / "broken").mkdir()
    (results / "broken" / "results.json").write_text("")  # an empty summary
    for args in (["--add", "new"], ["--index"]):
        r = refused_in(["records", *args, "--root", str(root)], tmp_path, 2, "results/broken: cannot be read")
        assert "Traceback" not in r.stderr
    assert (results / "new").is_dir() and not (results / "new.tar.xz").exists()  # not packed without its index line


def test_a_truncated_packed_record_is_an_error_to_every_reader(tmp_path):
    root = tmp_path / "checkout"
    results = _results(root)
    data = (results / "good.tar.xz").read_bytes()
    (results / "cut.tar.xz").write_bytes(data[: len(data) // 2])
    refused_in(["records", "--speed", "cut", "--root", str(root)], tmp_path, 2, "--speed cut")
    refused_in(["records", "--index", "--root", str(root)], tmp_path, 2, "results/cut: cannot be read")
    # --unpack: nothing half-unpacked left, not even the folder it made
    refused_in(["records", "--unpack", str(tmp_path / "new" / "dir"), "--root", str(root)], tmp_path, 2, "results/cut")


def test_unpack_never_writes_over_an_existing_results_folder_or_through_a_file(tmp_path):
    root = tmp_path / "checkout"
    _results(root)
    mine = tmp_path / "mine" / "results" / "good"
    mine.mkdir(parents=True)
    (mine / "results.json").write_text("my own edits\n")
    refused_in(["records", "--unpack", str(tmp_path / "mine"), "--root", str(root)], tmp_path, 2, "holds files")
    assert (mine / "results.json").read_text() == "my own edits\n"
    (tmp_path / "afile").write_text("x\n")
    refused_in(["records", "--unpack", str(tmp_path / "afile"), "--root", str(root)], tmp_path, 2, "not a folder")
    r = main_in(["records", "--unpack", str(tmp_path / "fresh"), "--root", str(root)], tmp_path)
    assert r.returncode == 0, r.stderr
    assert {p.name for p in (tmp_path / "fresh").iterdir()} == {"results"}  # no staging folder left beside it
    assert json.loads((tmp_path / "fresh" / "results" / "good" / "results.json").read_text())["outcome"] == "PASS"


def test_stale_that_found_no_readme_command_to_check_is_no_answer(tmp_path):
    root = tmp_path / "checkout"
    _results(root)
    (root / "README.md").write_text("# another project\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "x")
    before = tree(tmp_path)
    r = main_in(["records", "--stale", "--root", str(root)], tmp_path)
    assert r.returncode == 2 and "shows none of the GPU commands" in r.stderr, (r.returncode, r.stdout, r.stderr)
    assert tree(tmp_path) - before <= {tmp_path / "tmp"}


# 4. vllm-check: "measured on the H200" only where the files are the measured release's.


def test_a_wheel_named_as_a_measured_release_is_not_measured_unless_its_files_are_that_release(tmp_path):
    from tests.fake_vllm import MANAGER_GOOD
    from tests.fake_vllm import SPEC_DECODE as SPEC

    whl = tmp_path / "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"  # 0.34.0 has GPU records (results/)
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("vllm/__init__.py", "")
        z.writestr(f"{SPEC}/autoregressive/cudagraph_utils.py", MANAGER_GOOD)
    r = main_in(["vllm-check", str(whl)], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "measured on the H200" not in r.stdout and "never run on a GPU" in r.stdout, r.stdout


# 5. plugin-request: the audit file the plugin writes at the end of a person's vLLM run is judged when it is asked for.


def test_the_plugin_requests_audit_file_never_overwrites_a_file_and_is_judged_before_the_run(tmp_path):
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n")
    # each was accepted, then at the end of the vLLM run the auditor's open(path, "w") overwrote the file or raised
    refused_in(["plugin-request", "--audit-file", str(mine)], tmp_path, 2, "is not a report this command writes")
    refused_in(["plugin-request", "--audit-file", str(tmp_path)], tmp_path, 2, "is a folder")
    refused_in(["plugin-request", "--audit-file", str(tmp_path / "no" / "a.json")], tmp_path, 2, "cannot write it")
    assert mine.read_text() == "my notes\n"
    r = main_in(["plugin-request", "--audit-file", "audit.json"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["plugin"]["audit_file"] == str(tmp_path / "audit.json")  # whatever vLLM's cwd
    assert not (tmp_path / "audit.json").exists()


# 6. --overwrite empties a report folder: never one that holds an input of the command.


def test_overwrite_never_removes_a_build_or_a_cache_that_lies_in_the_report_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "verdicts.md").write_text("# an earlier report\n")  # a report folder: --overwrite may empty it
    build = fake_vllm(out / "build", compiled=False)
    other = fake_vllm(tmp_path / "other", compiled=False)
    args = ["gate", "--no-installed", "--out", str(out), "--overwrite"]
    # the build under test was removed with the old report, then the gate died on it (a traceback)
    refused_in([*args, "--vllm", f"a={build}"], tmp_path, 2, "which --overwrite would remove")
    refused_in([*args, "--vllm", f"a={other}", "--cache-dir", str(out / "cache")], tmp_path, 2, "out/cache")
    assert (build / "vllm" / "__init__.py").is_file() and (out / "verdicts.md").is_file()


# 7. pytest --gate: the report folder it writes when the session ends is judged before any case runs.


def test_a_gate_report_that_is_a_file_is_refused_before_the_gpu_tier_runs_and_kept(tmp_path):
    mine = tmp_path / "report"
    mine.write_text("mine\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "REPRO_", "STANDIN_"))}
    cmd = [sys.executable, "-m", "pytest", "cases", "-m", "gpu", "-k", "stale_metadata", "--gate", "-q"]
    cmd += ["-p", "tests.standin_gpu_tier", "-p", "no:cacheprovider", f"--gate-report={mine}"]
    # the whole tier ran, then the session died making the folder (a traceback, the report lost)
    r = subprocess.run(cmd, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.strip() == f"repro: error: --gate-report {mine}: exists and is not a folder", r.stderr
    assert "Traceback" not in r.stdout and mine.read_text() == "mine\n"


# 8. bisect --status reads the current commit's source alone: never `good` from a pattern, and no --good needed.


def test_bisect_status_on_a_first_commit_reads_its_source_and_never_says_good(tmp_path):
    from tests.fake_vllm import write_manager_history

    repo = tmp_path / "vllm-repo"
    write_manager_history(
        repo, []
    )  # one commit whose manager rebuilds its metadata; no HEAD~1 (--status reads no --good)
    r = main_in(["bisect", "--vllm", str(repo), "--status"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("no known bad pattern (not run on a GPU): ") and "good" not in r.stdout, r.stdout


# 9. a person's knob is judged where the command starts, as the flag it stands for.


def test_a_cache_folder_named_by_repro_cache_dir_is_judged_as_cache_dir_is(tmp_path):
    build = fake_vllm(tmp_path / "build", compiled=False)
    (tmp_path / "afile").write_text("x\n")
    # it was a traceback once the first case asked the cache for its build folder
    args = ["gate", "--no-installed", "--vllm", f"a={build}", "--out", str(tmp_path / "out")]
    refused_in(args, tmp_path, 2, "REPRO_CACHE_DIR", REPRO_CACHE_DIR=str(tmp_path / "afile"))


def test_a_bad_repro_gate_compile_is_refused_by_its_name_before_anything_is_written(tmp_path):
    build = fake_vllm(tmp_path / "build", compiled=False)
    args = ["gate", "--no-installed", "--vllm", f"a={build}", "--out", str(tmp_path / "out")]
    # it was refused once the run had started (a progress line, the report folder made and removed), as '--compile'
    refused_in(args, tmp_path, 2, "REPRO_GATE_COMPILE='fast'", REPRO_GATE_COMPILE="fast")


# 10. an empty --out folder the user made is theirs: a stopped command empties it again, never removes it.


def test_an_empty_out_folder_the_user_made_is_never_removed_when_a_command_stops(tmp_path):
    from repro.cli import outputs

    mine = tmp_path / "mine"
    mine.mkdir(mode=0o750)
    out = outputs.open_folder(str(mine), "gate")
    (out / "logs").mkdir()  # made by the command, nothing written into it
    outputs.abandon("interrupted with Ctrl-C")
    assert mine.is_dir() and not any(mine.iterdir()) and (mine.stat().st_mode & 0o777) == 0o750
    made = tmp_path / "new" / "out"  # one the command made, with its parent: removed again, both
    outputs.open_folder(str(made), "gate")
    outputs.abandon("refused")
    assert not (tmp_path / "new").exists()


# 11. vllm-check: sources this Python cannot read are untestable or missing hooks, never a traceback (exit 1: "bad").


def test_sources_that_do_not_parse_are_said_so_never_a_traceback_read_as_bad(tmp_path):
    from tests.fake_vllm import MANAGER_GOOD, write_manager_tree

    tree = tmp_path / "checkout"
    write_manager_tree(tree, "autoregressive", MANAGER_GOOD)
    backend = tree / "vllm" / "v1" / "attention" / "backends" / "flash_attn.py"
    backend.parent.mkdir(parents=True)
    backend.write_text("class (\n")  # a checkout mid-edit (or syntax newer than this Python)
    r = main_in(["vllm-check", str(tree)], tmp_path)
    assert r.returncode == 0 and "flash_attn.py does not parse (SyntaxError" in r.stdout, (r.returncode, r.stdout)
    manager = tree / "vllm" / "v1" / "worker" / "gpu" / "spec_decode" / "autoregressive" / "cudagraph_utils.py"
    manager.write_bytes(b"\xff\xfe not UTF-8")
    r = main_in(["vllm-check", str(tree)], tmp_path)
    assert r.returncode == 125 and "untestable" in r.stdout and "does not parse" in r.stdout, (r.returncode, r.stdout)


def test_a_bisect_git_refuses_to_start_says_gits_reason(tmp_path):
    from tests.fake_vllm import MANAGER_BAD, write_manager_history

    write_manager_history(tmp_path / "vllm-repo", [MANAGER_BAD])
    r = main_in(["bisect", "--vllm", "vllm-repo", "--good", "HEAD", "--bad", "HEAD~1"], tmp_path)  # swapped
    assert r.returncode == 2 and "Maybe you mistook good and bad revs?" in r.stderr, r.stderr  # was "failed: []"
    assert len(r.stderr.strip().splitlines()) == 1


# 12. agree: a comparison that compared nothing is no answer.


def test_agree_with_no_case_it_could_compare_is_no_answer_never_every_verdict_agrees(tmp_path):
    r = main_in(["matrix", "--model", "--quiet", "--splits", "32", "--out", str(tmp_path / "model")], tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "model" / "results.json").read_text())
    doc["source"] = "gpu"  # a GPU run whose every case skipped (no FA3 build there): nothing measured
    for case in doc["cases"]:
        case["verdict"] = case["result"]["verdict"] = "skip"
    (tmp_path / "skipped.json").write_text(json.dumps(doc))
    # it printed "Verdicts agree in 0 of 0 cases" and exit 0: every verdict agrees
    r = main_in(["agree", str(tmp_path / "skipped.json"), "--out", str(tmp_path / "agree.md")], tmp_path)
    assert r.returncode == 2 and r.stderr.splitlines()[-1].startswith("repro: error: no case of"), r.stderr
    assert not (tmp_path / "agree.md").exists() and "Verdicts agree" not in r.stdout


def test_an_inject_source_without_inject_is_refused_as_it_would_choose_nothing(tmp_path):
    refused_in(["plugin-request", "--inject-source", "last"], tmp_path, 2, "give --inject too")
    r = main_in(["plugin-request", "--inject", "stale-capture", "--inject-source", "last"], tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout)["plugin"]["inject_source"] == "last"


def test_a_number_out_of_range_is_named_with_its_value(tmp_path):
    for flag, value in (("--jobs", "0"), ("--jobs", "-3"), ("--cache-keep", "0")):
        # it was "--repeat and --jobs must be at least 1, --timeout positive" whichever one it was
        refused_in(["gate", flag, value], tmp_path, 2, f"{flag} must be at least 1, got {value}")


def test_a_negative_sm_count_is_not_told_it_is_too_many(tmp_path):
    refused_in(["gate", "--modes", "sm_margin:-3"], tmp_path, 2, "sm_margin:-3: impossible SM count: 0 to 1024")
