"""The wheel/checkout checker on synthetic trees (the real-wheel results are recorded in results/)."""

import json
import os
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from repro.vllm_integration.releases.compat import check_source, plugin_compat
from tests.records import RESULTS

FLASH = """
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: object
    seq_lens: object
    scheduler_metadata: object = None

class FlashAttentionMetadataBuilder:
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        pass

class FlashAttentionImpl:
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        pass
"""
MANAGER = """
class PrefillSpeculatorCudaGraphManager(CudaGraphManager):
    def capture(self, forward_fn, attn_states):
        pass
"""


def _make(root: Path, flash: str = FLASH) -> Path:
    for rel, text in (
        ("vllm/__init__.py", ""),
        ("vllm/v1/attention/backends/flash_attn.py", flash),
        ("vllm/v1/worker/gpu/spec_decode/autoregressive/cudagraph_utils.py", MANAGER),
    ):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_tree_and_wheel(tmp_path):
    root = _make(tmp_path / "tree")
    c = check_source(root)
    assert (c.verdict, c.layout, c.plugin_ok) == ("bad", "autoregressive", True)
    whl = tmp_path / "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for p in root.rglob("*.py"):
            z.write(p, p.relative_to(root).as_posix())
    w = check_source(whl)
    assert w.verdict == "bad" and w.source == whl.name


def test_missing_hooks_are_named(tmp_path):
    root = _make(
        tmp_path,
        FLASH.replace("scheduler_metadata: object = None", "").replace(
            "def forward(self, layer,", "def forward(self, lyr,"
        ),
    )
    ok, notes = plugin_compat(root)
    assert not ok
    assert any("arguments differ" in n for n in notes) and any("lacks scheduler_metadata" in n for n in notes)


RECORDED = json.loads((RESULTS / "vllm-source-check.json").read_text())
BAD_WHERE = re.compile(r": (vllm/\S+\.py):(\d+) (\w+)\.capture reuses saved attention states \((\w+)\)$")


def _version(row: dict) -> str:
    return row["source"].split("-")[1]


def _tree_as_recorded(root: Path, row: dict) -> Path:
    """A tree shaped as the record says the wheel is: for a bad wheel, the manager class it names with its `capture`
    taking the saved states argument at the file and line it names; for a good one, a capture that builds its inputs."""
    _make(root)
    if row["layout"] != "autoregressive":  # _make's manager would name the layout: the record's own folder instead
        shutil.rmtree(root / "vllm/v1/worker/gpu/spec_decode/autoregressive")
    m = BAD_WHERE.search(row["reason"])
    if m:
        rel, line, cls, arg = m[1], int(m[2]), m[3], m[4]
        text = (
            "\n" * (line - 2)
            + f"class {cls}(CudaGraphManager):\n    def capture(self, forward_fn, {arg}):\n        pass\n"
        )
    else:
        rel = f"vllm/v1/worker/gpu/spec_decode/{row['layout']}/cudagraph_utils.py"
        (root / "vllm/v1/worker/gpu/spec_decode/autoregressive/cudagraph_utils.py").unlink(missing_ok=True)  # _make's
        text = (
            "class PrefillSpeculatorCudaGraphManager(CudaGraphManager):\n"
            "    def capture(self, forward_fn, prepare_inputs_to_capture):\n"
            "        prepare_inputs_to_capture()\n"
        )
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)
    return root


@pytest.mark.parametrize("row", RECORDED, ids=_version)
def test_the_checker_states_what_was_recorded_for_a_tree_shaped_like_the_wheel(tmp_path, row):
    """results/vllm-source-check.json: today's checker, on a tree with what the record says each wheel holds (the
    manager, file, line and argument its reason names, or its layout's folder; the plugin's hooks), gives the recorded
    row but its source."""
    got = check_source(_tree_as_recorded(tmp_path / "tree", row)).to_dict()
    assert _as_recorded(got, row) == row


def _as_recorded(got: dict, row: dict) -> dict:
    """Today's answer in the record's terms (the rows were written before the answer said what it rests on): the
    pattern the code shows (`good` then: no known bad pattern now, never `good` without a GPU record of the files),
    the reason of a bad pattern after its `known bad pattern: ` prefix, the rest as it was."""
    pattern = {"no-known-bad-pattern": "good"}.get(got["pattern"], got["pattern"])
    reason = got["reason"].removeprefix("known bad pattern: ") if pattern == "bad" else row["reason"]
    kept = {k: got[k] for k in row if k not in ("source", "verdict", "reason")}
    return {**kept, "source": row["source"], "verdict": pattern, "reason": reason}


def test_the_recorded_source_verdicts_agree_with_the_gpu_gate():
    """The static verdicts against what the real-vLLM gate measured on the H200 (results/h200-vllm-coverage): a
    build the gate found affected is `bad`, one it passed is `good`; 0.24.0 predates that run."""
    gate = json.loads((RESULTS / "h200-vllm-coverage" / "results.json").read_text())
    measured = {b["vllm_version"]: b["affected"] for b in gate["builds"]}
    assert measured == {"0.26.0": False, "0.25.1": True}
    verdicts = {_version(r): r["verdict"] for r in RECORDED}
    assert {v: verdicts[v] for v in measured} == {v: "bad" if hit else "good" for v, hit in measured.items()}
    assert all(r["plugin_ok"] for r in RECORDED)


WHEELS = os.environ.get("REPRO_VLLM_WHEELS")  # a folder holding the real wheels the record names


@pytest.mark.parametrize("row", RECORDED, ids=_version)
def test_recorded_real_wheels(row):
    """The record re-made from the real wheel, when a folder of them is named (REPRO_VLLM_WHEELS)."""
    wheel = Path(WHEELS or "/nonexistent") / row["source"]
    if not wheel.is_file():
        pytest.skip(f"{row['source']} not in REPRO_VLLM_WHEELS ({WHEELS})")
    assert _as_recorded(check_source(wheel).to_dict(), row) == row


def test_vllm_check_names_the_wheel_when_its_tree_is_untestable(tmp_path):
    from repro.vllm_integration.releases.compat import check_source

    whl = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("other/__init__.py", "")
    c = check_source(whl)  # the source check itself (the CLI refuses such a wheel before it)
    assert c.verdict == "untestable" and c.source == whl.name and c.reason.startswith(f"{whl.name}: not a vLLM"), c
