"""One home for naming and counting stale entries (repro.attention.staleness): the attention-layer diff, the freshness auditor
inside vLLM and the gate's summary of the auditor's report use the same key per field and the same words."""

from __future__ import annotations

import json
import subprocess
import sys

from repro.attention.staleness import FieldDiff, count_fields, field_key, summarize
from repro.contract.channel import Channel
from repro.contract.tags import AUDIT_TAG
from repro.vllm_integration.gate.judge import audit_evidence
from repro.vllm_integration.plugin.audit import Mismatch


def test_a_plain_buffer_counts_under_its_name_a_decoded_field_under_buffer_dot_field():
    assert field_key("seq_lens", "seq_lens") == "seq_lens"
    assert field_key("scheduler_metadata", "num_splits_dynamic") == "scheduler_metadata.num_splits_dynamic"
    # the auditor could not decode the layout: the whole buffer is the field
    assert field_key("scheduler_metadata", "scheduler_metadata") == "scheduler_metadata"
    diffs = [
        FieldDiff("seq_lens", "seq_lens", 0, 5, 6),
        FieldDiff("scheduler_metadata", "semaphore", 0, 1, 0),
        FieldDiff("seq_lens", "seq_lens", 3, 5, 6),
    ]
    assert summarize(diffs) == {"seq_lens": 2, "scheduler_metadata.semaphore": 1}
    assert list(summarize(diffs)) == ["seq_lens", "scheduler_metadata.semaphore"]  # first seen first
    assert count_fields([]) == {}


def test_the_gate_names_and_counts_the_auditors_mismatches_as_the_auditor_does():
    ms = [
        Mismatch("t32r8", "query_start_loc", "query_start_loc", 2, 7, 9),
        Mismatch("t32r8", "scheduler_metadata", "prepare_seqlen_q", 1, 4, 0),
        Mismatch("t16r4", "query_start_loc", "query_start_loc", 1, 3, 5),
    ]
    out = "\n".join(f"{AUDIT_TAG} {json.dumps({'stale': m.to_dict()})}" for m in ms)
    ev = audit_evidence(Channel.from_output(out), None)
    assert ev["stale"] == 3 and ev["first_descriptor"] == "t32r8" and ev["descriptor"] == 0  # none stale-descriptor
    assert ev["fields"] == {"query_start_loc": 2, "scheduler_metadata.prepare_seqlen_q": 1}
    assert [f"stale attention metadata for {x}" for x in ev["first"]] == [str(m) for m in ms]
    assert ev["first"][0] == "t32r8: query_start_loc.query_start_loc[2] is 9, the build wrote 7"


def test_staleness_imports_no_other_module_at_run_time():
    """The auditor inside vLLM imports it: nothing of torch, vLLM or the rest of repro comes with it (but the packages
    that hold it)."""
    code = (
        "import sys, repro.attention.staleness; print(sorted(m for m, mod in sys.modules.items()"
        " if m.split('.')[0] in ('repro', 'torch') and not hasattr(mod, '__path__')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['repro.attention.staleness']"
