"""scripts/mutate_vllm.py, on a tiny fake vLLM prefix made here: each mutant makes a DEST that differs from SRC only in
its patched file (every other entry a link into SRC, the dist-info visible to importlib.metadata), writes its marker,
never writes SRC, and a prefix of another version (its anchor absent) is refused with exit 2 and nothing at DEST."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "mutate_vllm.py"
_spec = importlib.util.spec_from_file_location("mutate_vllm", SCRIPT)
mutate_vllm = sys.modules.setdefault("mutate_vllm", importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(mutate_vllm)

SPEC = mutate_vllm.SPEC
NAMES = ["target-dependent-wrong-descriptor", "standalone-wrong-descriptor", "dflash-wrong-descriptor"]
# the anchors the mutants match (vLLM 0.34.0's capture code, as its wheel ships it), read from the script
AR_EXCERPT, DFLASH_EXCERPT = mutate_vllm.MUTANTS[NAMES[0]].anchor, mutate_vllm.MUTANTS[NAMES[2]].anchor


def fake_prefix(root: Path, version: str = "0.34.0", ar_excerpt: str = AR_EXCERPT) -> Path:
    """A site-packages-like folder: vllm/ with the two capture files, siblings, caches, a dist-info and another
    package."""
    files = {
        "vllm/__init__.py": "__version__ = 'fake'\n",
        "vllm/__pycache__/__init__.cpython-312.pyc": "bytecode",
        "vllm/config/__init__.py": "\n",
        f"{SPEC}/autoregressive/__init__.py": "\n",
        f"{SPEC}/autoregressive/speculator.py": "class AutoRegressiveSpeculator: ...\n",
        f"{SPEC}/autoregressive/__pycache__/cudagraph_utils.cpython-312.pyc": "stale bytecode",
        f"{SPEC}/autoregressive/cudagraph_utils.py": "def capture(self, desc):\n    if True:\n" + ar_excerpt,
        f"{SPEC}/dflash/cudagraph.py": "def capture(self, desc):\n    if True:\n" + DFLASH_EXCERPT + "            )\n",
        f"{SPEC}/dflash/utils.py": "\n",
        f"vllm-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n",
        f"vllm-{version}.dist-info/RECORD": "\n",
        "torch_stub/__init__.py": "\n",
        "cutlass.pth": "import sys\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under root (links followed): its content hash and mtime."""
    out = {}
    for folder, _dirs, names in os.walk(root, followlinks=True):
        for name in names:
            path = Path(folder, name)
            out[str(path.relative_to(root))] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    return out


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", NAMES)
def test_a_mutant_changes_only_its_file_links_the_rest_and_leaves_src_untouched(tmp_path, name):
    src = fake_prefix(tmp_path / "src")
    before = snapshot(src)
    dest = tmp_path / "dest"
    done = run(str(src), str(dest), "--mutant", name)
    assert done.returncode == 0, done.stderr
    assert snapshot(src) == before

    mutant = mutate_vllm.MUTANTS[name]
    got = {k: v[0] for k, v in snapshot(dest).items() if k != "MUTANT.json"}
    # The patched folder's bytecode cache is not carried; everything else reads as in SRC but the patched file.
    stale = f"{Path(mutant.file).parent}/__pycache__/{Path(mutant.file).stem}.cpython-312.pyc"
    want = {k: v[0] for k, v in before.items() if k != stale}
    assert set(got) == set(want)
    assert [k for k in got if got[k] != want[k]] == [mutant.file]

    patched = dest / mutant.file
    assert not patched.is_symlink()
    text = patched.read_text()
    assert text.count(mutant.replacement) == 1 and mutant.anchor not in text
    compile(text, str(patched), "exec")  # the patched code is valid Python
    # Only the folders on the patched file's path are real; everything else in them is a link into SRC.
    for folder, dirs, names in os.walk(dest):
        for entry in dirs + names:
            path = Path(folder, entry)
            rel = path.relative_to(dest).as_posix()
            if rel == "MUTANT.json" or mutant.file == rel or mutant.file.startswith(rel + "/"):
                assert not path.is_symlink(), rel
            else:
                assert path.is_symlink() and path.resolve() == (src / rel).resolve(), rel
    assert (dest / "vllm-0.34.0.dist-info").is_symlink()
    dists = list(importlib.metadata.distributions(name="vllm", path=[str(dest)]))
    assert [d.version for d in dists] == ["0.34.0"]

    marker = json.loads((dest / "MUTANT.json").read_text())
    assert marker["mutant"] == name and marker["file"] == mutant.file and marker["vllm_version"] == "0.34.0"
    assert marker["methods"] == list(mutant.methods) and marker["methods"]
    assert marker["anchor"] == mutant.anchor and marker["replacement"] == mutant.replacement
    assert f"+++ b/{mutant.file}" in marker["diff"] and "+                md.num_tokens," in marker["diff"]


def test_the_two_autoregressive_mutants_select_disjoint_prefill_managers():
    td, sa = (mutate_vllm.MUTANTS[n].replacement for n in NAMES[:2])
    assert "slot_mappings_buffer is None and self.decode_query_len > 1" in td
    assert "slot_mappings_buffer is not None" in sa and "is None" not in sa


@pytest.mark.parametrize("name", NAMES)
def test_another_version_is_refused_with_exit_2_and_nothing_at_dest(tmp_path, name):
    # 0.33.0-like: the AR capture differs and dflash's capture file is absent.
    src = fake_prefix(tmp_path / "src", version="0.33.0", ar_excerpt=AR_EXCERPT.replace("num_reqs,\n", "n,\n", 1))
    (src / SPEC / "dflash" / "cudagraph.py").unlink()
    before = snapshot(src)
    dest = tmp_path / "dest"
    done = run(str(src), str(dest), "--mutant", name)
    assert done.returncode == 2
    assert "refused" in done.stderr and name in done.stderr and "0.33.0" in done.stderr
    assert not dest.exists() and snapshot(src) == before


def test_a_prefix_already_patched_is_refused_and_an_empty_dest_stays_empty(tmp_path):
    src = fake_prefix(tmp_path / "src")
    first = tmp_path / "first"
    assert run(str(src), str(first), "--mutant", NAMES[2]).returncode == 0
    again = tmp_path / "again"
    again.mkdir()
    done = run(str(first), str(again), "--mutant", NAMES[2])
    assert done.returncode == 2 and "not found" in done.stderr
    assert list(again.iterdir()) == []


def test_a_nonempty_dest_or_an_unknown_mutant_is_refused(tmp_path):
    src = fake_prefix(tmp_path / "src")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep").write_text("x")
    assert run(str(src), str(dest), "--mutant", NAMES[0]).returncode == 2
    assert [p.name for p in dest.iterdir()] == ["keep"]
    done = run(str(src), str(tmp_path / "other"), "--mutant", "no-such")
    assert done.returncode == 2 and "no-such" in done.stderr and not (tmp_path / "other").exists()


def test_list_names_every_mutant_with_its_methods():
    done = run("--list")
    assert done.returncode == 0
    for name in NAMES:
        assert name in done.stdout
    for method in ("eagle", "eagle3", "mtp", "draft_model", "dflash"):
        assert method in done.stdout
