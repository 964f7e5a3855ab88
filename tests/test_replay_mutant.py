"""The replay path's source mutant (scripts/mutate_vllm.py's standalone-partial-copy) made from a stand-in of vLLM
0.34.0's StandaloneARSpeculator.propose holding its anchor once, and run on test_replay_check's CPU stand-in of the V2
runner with the replay check on: found by the replay check alone (stale-replay at seq_lens of the FULL prefill
graph), the eager prefill untouched; a source without its anchor is refused, nothing written."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types

import torch

from repro.vllm_integration.plugin import capture, counters
from repro.vllm_integration.plugin.audit import STALE_REPLAY
from tests import test_descriptor_audit as sd
from tests import test_replay_check as rc
from tests.commands import ROOT
from tests.test_refresh_judged import _mutate_vllm
from tests.test_replay_check import graph_of

plugin_state, hooked = rc.plugin_state, rc.hooked  # the stand-in runner with the replay check on

MUTANT = _mutate_vllm().MUTANTS["standalone-partial-copy"]


def _mutant_of(tmp_path, name, text):
    """scripts/mutate_vllm.py's mutant `name` made from a stand-in prefix whose patched file is `text`: the mutant and
    the patched module, loaded."""
    mutant = _mutate_vllm().MUTANTS[name]
    src = tmp_path / "src"
    for rel, body in {"vllm/__init__.py": "\n", mutant.file: text}.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(body)
    script = [sys.executable, str(ROOT / "scripts" / "mutate_vllm.py"), str(src), str(tmp_path / "d")]
    done = subprocess.run([*script, "--mutant", name], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (src / mutant.file).read_text() == text  # SRC never written
    spec = importlib.util.spec_from_file_location("patched_speculator", tmp_path / "d" / mutant.file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return mutant, module


# vLLM 0.34.0's StandaloneARSpeculator.propose cut to what the mutant reads: the expanded prefill's inputs prepared
# (prepare_prefill_inputs' kernel writes every request's seq_lens), the batch's build, then its FULL graph replayed
# or the eager prefill run (the mutant's anchor, at its own indentation, inside `if True:`)
_STANDALONE = """\
class CUDAGraphMode:
    FULL = "FULL"


class StandaloneARSpeculator:
    def __init__(self, input_buffers, prefill_cudagraph_manager, prepare, build):
        self.input_buffers = input_buffers
        self.prefill_cudagraph_manager = prefill_cudagraph_manager
        self.prepare, self.build = prepare, build

    def _prefill(self, desc):
        self.prefill_cudagraph_manager.eager.append(desc)

    def propose(self, num_reqs, seq_lens, prefill_batch_desc):
        self.prepare(seq_lens)
        self.build()
        if True:
{anchor}            else:
                self._prefill(prefill_batch_desc)
"""


class PrefillManager:
    """The StandaloneAR prefill capture manager at runtime: run_fullgraph replays the graph of the descriptor."""

    def __init__(self, graphs):
        self.graphs, self.eager, self.seen = graphs, [], []

    def run_fullgraph(self, desc):
        self.seen.append(sd.BUF["seq_lens"][:2].tolist())  # what the replay reads
        self.graphs.replay(graph_of(self.graphs, desc.suffix))


def test_the_partial_copy_mutant_is_found_by_the_replay_check_alone(hooked, tmp_path):
    """standalone-partial-copy, made from a stand-in of vLLM 0.34.0's propose holding its anchor once:
    StandaloneARSpeculator's runtime FULL prefill replays with the last request's seq_lens entry left at the previous
    batch's, after the batch's own build. Its second replay is stale-replay at seq_lens[1] of the prefill graph
    (built 40, read 30), its first (no previous batch) clean; the eager prefill is untouched."""
    runner, graphs = hooked
    anchor = MUTANT.anchor
    mutant, module = _mutant_of(tmp_path, "standalone-partial-copy", _STANDALONE.format(anchor=anchor))
    assert mutant.methods == ("draft_model",)

    def prepare(lens):
        sd.BUF["seq_lens"][:2] = torch.tensor(lens)
        sd.BUF["query_start_loc"][:3] = torch.tensor([0, 4, 8])
        sd.BUF["slot_mapping"][:8] = torch.arange(8)

    def build():  # the speculator's runtime build of the expanded prefill (t8r2 q4): a speculator frame on the stack
        cm = sd.CommonAttentionMetadata(
            sd.BUF["query_start_loc"][:3], sd.BUF["seq_lens"][:2], 2, 8, 4, sd.BUF["block_table"][:2],
            sd.BUF["slot_mapping"][:8],
        )  # fmt: skip
        runner.builder.build(0, cm)

    manager = PrefillManager(graphs)
    buffers = types.SimpleNamespace(seq_lens=sd.BUF["seq_lens"])
    speculator = module.StandaloneARSpeculator(buffers, manager, prepare, build)
    full = types.SimpleNamespace(cg_mode="FULL", suffix="t8r2 q4")
    for lens in ([20, 30], [21, 40]):
        speculator.propose(2, lens, full)
    assert manager.seen == [[20, 30], [21, 30]]  # the second batch's last request replayed with the first's
    label = graph_of(graphs, "t8r2 q4")
    label = capture._REPLAY["on"].graphs.get(label).label
    found = [m for m in counters.AUDITOR.mismatches if m.kind == STALE_REPLAY]
    assert [(m.descriptor, m.buffer, m.index, m.built, m.now) for m in found] == [(label, "seq_lens", 1, 40, 30)]
    assert counters.COUNTERS["replay_checks"] == 2 and not counters.COUNTERS["replay_unjudged"]
    assert not [m for m in counters.AUDITOR.mismatches if m.kind != STALE_REPLAY]  # nothing at capture
    eager = types.SimpleNamespace(cg_mode="PIECEWISE", suffix="t8r2 q4")
    speculator.propose(2, [22, 50], eager)
    assert manager.eager == [eager] and sd.BUF["seq_lens"][:2].tolist() == [22, 50]  # the eager prefill untouched


def test_the_partial_copy_mutant_is_refused_where_its_anchor_is_not_once(tmp_path):
    """A propose without the FULL prefill replay (vLLM before 0.34.0's FULL draft_model graphs) is refused, nothing
    written."""
    mutant = MUTANT
    src = tmp_path / "src"
    for rel, body in {"vllm/__init__.py": "\n", mutant.file: _STANDALONE.format(anchor="")}.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(body)
    script = [sys.executable, str(ROOT / "scripts" / "mutate_vllm.py"), str(src), str(tmp_path / "d")]
    done = subprocess.run([*script, "--mutant", mutant.name], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "anchor text is not found" in done.stderr and not (tmp_path / "d").exists()
