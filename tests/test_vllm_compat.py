"""The wheel/checkout checker on synthetic trees (the real-wheel results are recorded in results/)."""

import json
import zipfile
from pathlib import Path

from repro.vllm_integration.compat import check_source, plugin_compat

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


def test_recorded_real_wheels():
    rows = json.loads((Path(__file__).parent.parent / "results" / "vllm-source-check.json").read_text())
    verdicts = {r["source"].split("-")[1]: r["verdict"] for r in rows}
    assert verdicts == {"0.24.0": "bad", "0.25.1": "bad", "0.26.0": "good"}
    assert all(r["plugin_ok"] for r in rows)
