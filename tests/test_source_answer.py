"""`vllm-check` says what it is: a reading of code patterns that cannot vouch. Its answer names the pattern found in
every capture manager (the DFlash family's own builder included), which release the sources say they are and what
their files were checked against (a wheel's own RECORD or an installed folder's dist-info RECORD, a git checkout's
status at its tag: never the published release's files, of which the project records no hashes), and whether the gate
ran that release on a GPU. Never `good`: "no known bad pattern (not run on a GPU)", exit 0 so `git bisect run` keeps
working, `verified: false`, the release's GPU record named beside it; a release the gate found affected reads `bad`."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from repro import exit_codes
from repro.cli import main as cli
from repro.report.records import pack
from repro.vllm_integration.releases import compat, versions
from repro.vllm_integration.releases.compat import check_source
from repro.vllm_integration.releases.source_check import BAD, GOOD, NO_KNOWN_BAD, UNTESTABLE
from tests.fake_vllm import MANAGER_BAD, MANAGER_GOOD
from tests.fake_vllm import SPEC_DECODE as SPEC

DFLASH_MANAGER = """
class DFlashCudaGraphManager(CudaGraphManager):
    def capture(self, forward_fn, input_buffers, block_tables, attn_groups, kv_cache_config, max_model_len, causal):
        def create_forward_fn(desc, warmup):
            attn_state = _prepare_dflash_inputs_to_capture(desc.num_reqs, desc.num_tokens, input_buffers)
            return lambda mode: forward_fn(attn_state, mode)
        super().capture(create_forward_fn)
"""
LOOP = """
class CudaGraphManager:
    def capture(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs"):
        for desc in self.descs:
            create_forward_fn(desc, warmup=True)
"""


def _files(bad: bool = False) -> dict[str, str]:
    """A vLLM 0.34.0-shaped tree: the capture loop, the speculator's manager and DFlash's."""
    return {
        "vllm/__init__.py": "",
        "vllm/v1/worker/gpu/cudagraph_utils.py": LOOP,
        f"{SPEC}/autoregressive/cudagraph_utils.py": MANAGER_BAD if bad else MANAGER_GOOD,
        f"{SPEC}/target_dependent_ar/__init__.py": "",
        f"{SPEC}/dflash/cudagraph.py": DFLASH_MANAGER,
    }


def _hash(text: str) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()


def _wheel(tmp: Path, version: str, bad: bool = False, patch: str | None = None, rerecord: bool = False) -> Path:
    """A wheel whose RECORD lists its files' hashes; `patch`: a file changed after RECORD was written (`rerecord`:
    before, the RECORD written again over the patched file, as a rebuilt wheel's is)."""
    files = _files(bad)
    if patch and rerecord:
        files[patch] += "\n# patched\n"
    record = "".join(f"{n},{_hash(t)},{len(t)}\n" for n, t in files.items())
    if patch and not rerecord:
        files[patch] += "\n# patched\n"
    path = tmp / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        for n, t in files.items():
            z.writestr(n, t)
        z.writestr(f"vllm-{version}.dist-info/RECORD", record)
    return path


@pytest.fixture
def records(tmp_path, monkeypatch):
    """results/vllm-gpu-records.json naming gate records: 0.26.0 clean, 0.25.1 affected (rows as the gate writes them:
    an affected build under test is not ok)."""
    root = tmp_path / "results"
    for name, version, affected in (("gate-a", "0.26.0", False), ("gate-b", "0.25.1", True)):
        (root / name).mkdir(parents=True)
        row = {"build": version, "role": "under-test", "affected": affected, "ok": not affected}
        doc = {"kind": "vllm-gate", "builds": [row]}
        (root / name / "results.json").write_text(json.dumps(doc))
    (root / "vllm-gpu-records.json").write_text(json.dumps({"0.26.0": "gate-a", "0.25.1": "gate-b"}))
    monkeypatch.setattr(compat, "GPU_RECORDS", root / "vllm-gpu-records.json")
    return root


def test_every_capture_manager_is_named_with_its_pattern_the_dflash_builder_too(tmp_path, records):
    c = check_source(_wheel(tmp_path, "0.34.0"))
    assert c.pattern == NO_KNOWN_BAD and len(c.patterns) == 2  # the loop itself delegates: not a manager of its own
    assert any("DFlashCudaGraphManager.capture" in p and "_prepare_dflash_inputs_to_capture" in p for p in c.patterns)
    assert any("SpeculatorCudaGraphManager.capture" in p and "(prepare_inputs_to_capture)" in p for p in c.patterns)


def test_a_release_no_gpu_record_holds_reads_no_known_bad_pattern_never_good(tmp_path, records, capsys):
    whl = _wheel(tmp_path, "0.34.0")
    c = check_source(whl)
    assert (c.verdict, c.release, c.files, c.gpu_record, c.verified) == (
        NO_KNOWN_BAD,
        "0.34.0",
        "match its own RECORD: not compared with the published wheel",
        None,
        False,
    )
    assert "not run on a GPU (no GPU record of 0.34.0)" in c.reason
    out = tmp_path / "check.json"
    assert cli(["vllm-check", str(whl), "--json", str(out)]) == 0  # exit 0: `git bisect run` reads it as good
    printed = capsys.readouterr().out
    assert "no known bad pattern (not run on a GPU)" in printed and ": good" not in printed
    row = json.loads(out.read_text())[0]
    assert row["verdict"] == NO_KNOWN_BAD and row["verified"] is False and row["pattern"] != GOOD


def test_a_recorded_release_never_reads_good_its_own_record_is_not_the_published_wheel(tmp_path, records):
    """A wheel of a release the gate found clean, its files as its own RECORD lists them: still no known bad pattern,
    never `good`, never "published" (only a comparison with the published wheel could say so); its GPU record is
    named beside the answer. A release the gate found affected reads bad: never verified."""
    good = check_source(_wheel(tmp_path, "0.26.0"))
    assert (good.verdict, good.verified) == (NO_KNOWN_BAD, False) and "results/gate-a" in good.reason
    assert "not compared with its published files" in good.reason
    assert good.gpu_record == {"release": "0.26.0", "answer": GOOD, "record": "results/gate-a"}
    (tmp_path / "b").mkdir()
    affected = check_source(_wheel(tmp_path / "b", "0.25.1"))  # no bad pattern in these sources; the GPU said affected
    assert affected.verdict == BAD and not affected.verified and exit_codes.source([affected.verdict]) == 1
    assert "the gate found 0.25.1 affected on a GPU (results/gate-b)" in affected.reason


def test_a_patched_wheel_with_its_record_written_again_never_reads_as_the_published_release(tmp_path, records, capsys):
    """The finding: a wheel named as a release the gate found clean, one file patched and its RECORD regenerated over
    it, matches its own RECORD. Before, that read `good (GPU record)`, "files identical", verified, "measured on the
    H200": the patched build passed for the published one. Now every line says only what was checked."""
    whl = _wheel(tmp_path, "0.26.0", patch=f"{SPEC}/dflash/cudagraph.py", rerecord=True)
    c = check_source(whl)
    assert (c.verdict, c.verified) == (NO_KNOWN_BAD, False)
    assert c.files == "match its own RECORD: not compared with the published wheel"
    assert cli(["vllm-check", str(whl)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"{whl.name}: no known bad pattern (not run on a GPU)")
    assert ": good" not in printed and "identical" not in printed and "published files" not in printed.split("(")[0]
    assert "files: match its own RECORD: not compared with the published wheel" in printed
    assert "these files: predicted: read from its sources, never run on a GPU" in printed
    assert "measured on the H200" not in printed


def test_a_packed_gpu_record_answers_as_its_folder_did_and_both_readers_read_one_table(tmp_path, records):
    """results/ keeps its records packed (NAME.tar.xz): vllm-check's answer and docs/versions.md's table read the
    same table through one reader (compat.gpu_records), a packed record as a folder."""
    pack(records / "gate-a")
    assert not (records / "gate-a").exists()
    good = check_source(_wheel(tmp_path, "0.26.0"))
    assert (good.verdict, good.verified, good.gpu_record) == (NO_KNOWN_BAD, False, compat.gpu_record("0.26.0"))
    assert good.gpu_record == {"release": "0.26.0", "answer": GOOD, "record": "results/gate-a"}
    table = records / "vllm-gpu-records.json"
    assert versions.gpu_records(table) == {"0.26.0": ["gate-a"], "0.25.1": ["gate-b"]}
    assert "results/gate-a" in versions.measured("0.26.0", versions.gpu_records(table))


def test_patched_files_of_a_recorded_release_are_not_its_record(tmp_path, records):
    c = check_source(_wheel(tmp_path, "0.26.0", patch=f"{SPEC}/dflash/cudagraph.py"))
    assert c.verdict == NO_KNOWN_BAD and not c.verified and c.files.startswith("differ from its own RECORD: 1 changed")
    assert (
        "has a GPU record (found clean, results/gate-a), but these files were not compared with its published"
        in c.reason
    )


def test_an_installed_folder_is_read_against_its_dist_info_record(tmp_path, records):
    whl = _wheel(tmp_path, "0.26.0")
    site = tmp_path / "site"
    with zipfile.ZipFile(whl) as z:
        z.extractall(site)
    c = check_source(site)
    assert (
        c.verdict == NO_KNOWN_BAD and c.files == "match their dist-info RECORD: not compared with the published wheel"
    )
    (site / SPEC / "dflash" / "extra.py").write_text("x = 1\n")  # an overlay adds a file RECORD does not list
    c = check_source(site)
    assert c.verdict == NO_KNOWN_BAD and "1 not in RECORD" in c.files


def _git(repo: Path, *args: str) -> None:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, env={**env, "PATH": "/usr/bin:/bin"}
    )


def test_a_git_checkout_is_its_tag_while_clean(tmp_path, records):
    repo = tmp_path / "vllm-checkout"
    for name, text in _files().items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "release")
    _git(repo, "tag", "v0.26.0")
    c = check_source(repo)  # a tag can be made anywhere: not the published release
    assert (c.verdict, c.files) == (NO_KNOWN_BAD, "clean at tag v0.26.0: not compared with the published release")
    (repo / SPEC / "dflash" / "cudagraph.py").write_text(DFLASH_MANAGER + "\n# local change\n")
    c = check_source(repo)
    assert c.verdict == NO_KNOWN_BAD and "git status shows 1 changed file" in c.files


def test_a_known_bad_pattern_is_bad_with_or_without_a_record(tmp_path, records):
    for version in ("0.34.0", "0.26.0"):
        (tmp_path / version).mkdir()
        c = check_source(_wheel(tmp_path / version, version, bad=True))
        assert c.verdict == BAD and c.reason.startswith("known bad pattern: draft capture reuses")
    assert exit_codes.source([NO_KNOWN_BAD, GOOD]) == 0 and exit_codes.source([NO_KNOWN_BAD, UNTESTABLE]) == 125


def test_a_gpu_record_answers_only_for_rows_it_judged_and_any_affected_method_makes_it_bad(tmp_path, records):
    """A release's rows, one per speculative method, self controls aside: a row the gate could not vouch for (not
    affected, not ok: CANNOT VOUCH) is no answer, never good; an affected method is bad whatever the others say; an
    unreadable archive is no answer, never a crash."""

    def answer(rows):
        (records / "gate-a" / "results.json").write_text(json.dumps({"kind": "vllm-gate", "builds": rows}))
        rec = compat.gpu_record("0.26.0")
        return rec and rec["answer"]

    ok = {"build": "0.26.0", "role": "under-test", "affected": False, "ok": True}
    caught = {"build": "0.26.0 (self control)", "role": "self-control", "affected": True, "ok": True}
    assert answer([ok, caught]) == GOOD
    assert answer([{**ok, "ok": False}, caught]) is None  # cut by a deadline, cannot vouch
    assert answer([ok, {**ok, "build": "0.26.0 eagle3", "affected": True, "ok": False}]) == BAD
    assert answer([{**ok, "build": "0.26.0 mtp"}]) == GOOD  # a record of one method names it after the release
    assert answer([caught]) is None  # self controls alone answer nothing for the build
    pack(records / "gate-a")
    (records / "gate-a.tar.xz").write_bytes(b"not xz at all")
    assert compat.gpu_record("0.26.0") is None
