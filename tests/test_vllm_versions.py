"""The vLLM version table: docs/versions.md's copy is markdown()'s (and docs/backend-fields.md's field table is
backend_fields.markdown()'s), the two records (results/vllm-source-check.json and
results/vllm-versions.json) cover the same releases, plugin_facts reads what a tree holds, and, with
REPRO_VLLM_WHEELS naming a folder of the real wheels, each recorded row re-made from its wheel."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from repro.vllm_integration.plugin.backend_fields import markdown as fields_markdown
from repro.vllm_integration.releases import versions
from repro.vllm_integration.releases.compat import plugin_facts

DOCS = Path(__file__).resolve().parent.parent / "docs"
FACTS, SOURCES = versions.load(), versions.load(versions.SOURCE_FILE)


def test_versions_page_holds_the_generated_version_table():
    assert versions.markdown() in (DOCS / "versions.md").read_text(), (
        "regenerate docs/versions.md's table: python -c 'from repro.vllm_integration.releases.versions import markdown; "
        "print(markdown())'"
    )


def test_backend_fields_page_holds_the_generated_field_table():
    assert fields_markdown() in (DOCS / "backend-fields.md").read_text(), (
        "regenerate docs/backend-fields.md's table: python -c "
        "'from repro.vllm_integration.plugin.backend_fields import markdown; print(markdown())'"
    )


def test_both_records_cover_the_same_releases():
    facts = [r["version"] for r in FACTS]
    assert facts == sorted(facts, key=versions.version_key)
    assert set(facts) == {versions.wheel_version(s["source"]) for s in SOURCES}
    assert {r["wheel"] for r in FACTS} == {s["source"] for s in SOURCES}


def test_the_table_says_what_the_records_hold():
    """One row per release, its cells from its records: a changed record changes the table."""
    rows = versions.markdown().splitlines()[2:]
    assert len(rows) == len(FACTS)
    verdicts = {versions.wheel_version(s["source"]): s["verdict"] for s in SOURCES}
    for row, facts in zip(rows, FACTS):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == facts["version"] and cells[1] == verdicts[facts["version"]]
        assert (cells[-3].startswith("hooked")) == bool(facts["in_graph_refresh_callers"])
    changed = [{**FACTS[0], "layout": "some_future_layout"}]
    assert "`some_future_layout` (unknown: cannot vouch)" in versions.markdown(changed, SOURCES)


def test_wheel_versions():
    assert versions.wheel_version("vllm-0.23.0-2-cp38-abi3-manylinux_2_28_x86_64.whl") == "0.23.0"
    with pytest.raises(ValueError, match="not a vllm wheel"):
        versions.wheel_version("torch-2.13.0.whl")


REFRESH_SPECULATOR = "def step(self, attn_group, md):\n    attn_group.update_draft_decode_metadata(md)\n"
FLASH = """
from vllm.v1.attention.backends.fa_utils import get_scheduler_metadata

class FlashAttentionMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    new_field: torch.Tensor | None = None
    max_seq_len: int

class FlashAttentionMetadataBuilder:
    def build(self, common_prefix_len, common_attn_metadata):
        pass
{extra}
class FlashAttentionImpl:
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        pass
"""


def _tree(root: Path, refresh: bool) -> Path:
    extra = "    def update_draft_decode_metadata(self, metadata):\n        pass\n" if refresh else ""
    files = {
        "vllm/v1/attention/backends/flash_attn.py": FLASH.format(extra=extra),
        "vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py": REFRESH_SPECULATOR if refresh else "",
        "vllm/vllm_flash_attn/flash_attn_interface.py": "def get_scheduler_metadata(batch_size, sm_margin=0):\n  pass\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize("refresh", [True, False])
def test_plugin_facts_read_what_the_tree_holds(tmp_path, refresh):
    f = plugin_facts(_tree(tmp_path, refresh))
    fa = f["backends"]["FLASH_ATTN"]
    assert f["layout"] == "target_dependent_ar" and fa["update_draft_decode_metadata"] == refresh
    assert bool(f["in_graph_refresh_callers"]) == refresh
    assert fa["metadata_tensor_fields"] == ["new_field", "query_start_loc", "seq_lens"]
    assert fa["unlisted_fields"] == ["new_field"] and fa["impl_forward_takes_attn_metadata"]
    assert not f["backends"]["TRITON_ATTN"]["module_found"]
    assert f["fa3_hooks"] == {"get_scheduler_metadata_in_flash_attn": True, "sm_margin_in_get_scheduler_metadata": True}
    assert "no: module, builder.build" in versions._auditor(f["backends"]["TRITON_ATTN"])
    assert versions._auditor(fa) == "yes, 1 unlisted fields checked by the rule"


WHEELS = os.environ.get("REPRO_VLLM_WHEELS")  # a folder holding the real wheels the record names


@pytest.mark.parametrize("row", FACTS, ids=[r["version"] for r in FACTS])
def test_recorded_facts_from_the_real_wheels(row):
    wheel = Path(WHEELS or "/nonexistent") / row["wheel"]
    if not wheel.is_file():
        pytest.skip(f"{row['wheel']} not in REPRO_VLLM_WHEELS ({WHEELS})")
    assert versions.row(wheel) == row
