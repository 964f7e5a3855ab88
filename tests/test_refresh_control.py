"""The self control's form stale-refresh re-creates a defect the auditor can see, and one that re-created none is never
read as a miss. FA3's scheduler metadata depends on seq_lens only through each request's KV block count
(ceil(seqlen_k / kBlockN)): a refresh recomputed one step back changed no entry on the H100
(results/h100-dynamic-sleep-0.34.0: inject_refresh_changed absent, refresh_stale 0), and the gate's table called
every such control "defect re-created: NOT caught". Here: the injection, through a stand-in builder whose answer
counts 128-token blocks, differs from the step's own answer for every request; a control whose injection changed no
refresh is cannot-vouch with its reason and typed flag (the gate's table and headline say so, never "NOT caught"); one
whose injection changed refreshes and was caught stays caught."""

from __future__ import annotations

import copy
import types

import torch

from repro.case.spec import RECREATED_NOTHING, CaseResult
from repro.contract.verdicts import CANNOT_VOUCH, CLEAN, CRASH, STALE_AUDIT
from repro.vllm_integration.gate import coverage, report, why
from repro.vllm_integration.gate import judge as gate_judge
from repro.vllm_integration.gate.case import GateCase
from repro.vllm_integration.gate.modes import GateMode
from repro.vllm_integration.gate.outcome import GateRun
from repro.vllm_integration.plugin import counters, refresh
from repro.vllm_integration.plugin.backend_fields import BACKENDS
from repro.vllm_integration.plugin.inject import STALE_CAPTURE, STALE_REFRESH
from tests.test_vouch_rules import BUILD, identity

BLOCK_N = 128  # FA3's KV block (kBlockN 128-192): its metadata counts blocks, not tokens
LEFTOVER = -7  # what FA3's allocation leaves in the entries past the batch


def _blocks(seq: torch.Tensor, b: int) -> torch.Tensor:
    """The stand-in of get_scheduler_metadata: num_splits_dynamic, one entry a request (its KV block count), in a
    vector of round_up(b, 4) entries, then the tile-count semaphore."""
    rounded = (b + 3) // 4 * 4
    out = torch.full((rounded + 1,), LEFTOVER, dtype=torch.int32)
    out[:b] = ((seq[:b] + BLOCK_N - 1) // BLOCK_N).to(torch.int32)
    return out


class Builder:
    def _get_scheduler_metadata(self, *, batch_size, seqlens, **_):
        return _blocks(seqlens, batch_size)


def _metadata(seq: list[int]) -> types.SimpleNamespace:
    """A draft step's metadata whose lengths sit inside their blocks: one token less stays in the same block."""
    b = len(seq)
    return types.SimpleNamespace(
        num_decode_reqs=b,
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        query_start_loc=torch.arange(b + 1, dtype=torch.int32),
        max_query_len=1,
        max_seq_len=1024,
        causal=True,
        max_num_splits=64,
    )


def test_the_injection_differs_from_the_steps_own_answer_for_every_request():
    """The refresh as vLLM wrote it (the step's own answer), then the injection: every request's entry differs, where
    one step back (the source mutant's shift) would have changed none of these lengths; the change is counted."""
    seq = [5, 130, 300, 77, 1000]
    md, builder = _metadata(seq), Builder()
    own = builder._get_scheduler_metadata(batch_size=len(seq), seqlens=md.seq_lens)
    assert torch.equal(own, builder._get_scheduler_metadata(batch_size=len(seq), seqlens=md.seq_lens - 1))
    views = {"scheduler_metadata": own.clone()}
    c = counters.new_counters()
    injector = refresh.make_refresh_injector(c, lambda record: None)
    assert injector.after_refresh(builder, md, BACKENDS["FLASH_ATTN"], views, capturing=False)
    wrote = views["scheduler_metadata"]
    assert all(wrote[i] != own[i] for i in range(len(seq))), (wrote, own)
    assert c["inject_refresh_changed"] == 1 and c["inject_writes"] == {"draft refresh": 1}
    assert wrote.max() <= md.max_num_splits  # the stand-in's block counts stay under the forward's split cap


def _stale_refresh(mode: str) -> GateCase:
    return GateCase(BUILD, GateMode.parse(mode), backend="FLASH_ATTN", inject=STALE_REFRESH)


def _wrote_refreshes(changed: int | None) -> dict:
    """A stale-refresh control's record in which everything fired: its injection rewrote 408 refreshes (the H100's
    count) and changed `changed` eager ones (None: the counter absent, as the plugin leaves it before a change)."""
    return identity(
        counters={
            "captures_injected": {"draft decode": 128},
            "inject_writes": {"draft refresh": 408},
            "inject_refresh_changed": changed,
        },
        injection=[{"injection_wrote": "draft refresh"}],
    )


def test_a_control_that_changed_no_refresh_cannot_vouch_with_its_reason_and_flag_one_that_changed_some_is_caught():
    """Clean in plain, clean in audit, and a crash too: whatever it showed, a control that re-created nothing is no
    evidence either way; its cause is read from its flag. The same control whose injection changed eager refreshes
    keeps its evidence: caught by the auditor's stale-refresh findings in audit, by its fault in plain."""
    for mode, verdict in (("plain", CLEAN), ("audit", CLEAN), ("plain", CRASH), ("audit", STALE_AUDIT)):
        for changed in (0, None):
            c = _stale_refresh(mode)
            res = CaseResult(
                c.case_id, verdict, "4 requests x 16 tokens decoded", backend_identity=_wrote_refreshes(changed)
            )
            got = gate_judge.vouch(c, res)
            assert got.verdict == CANNOT_VOUCH, (mode, verdict, changed)
            assert got.reason.startswith(coverage.REFRESH_RECREATED_NOTHING), got.reason
            assert coverage.REFRESH_RECREATED_NOTHING == (
                "the stale-refresh injection changed no refreshed entry of a batch (inject_refresh_changed 0): it "
                "re-created no defect to catch"
            )
            assert RECREATED_NOTHING in got.flags and why.cause(got, True) == why.RECREATED
    c = _stale_refresh("audit")
    ident = _wrote_refreshes(216)
    ident["counters"].update(refresh_checks=344, refresh_stale=216)
    res = CaseResult(c.case_id, STALE_AUDIT, "stale-refresh: 216 refreshes", backend_identity=ident)
    assert gate_judge.vouch(c, res) is res
    plain = _stale_refresh("plain")
    faulted = CaseResult(plain.case_id, CRASH, "it faulted", backend_identity=_wrote_refreshes(216))
    assert gate_judge.vouch(plain, faulted) is faulted


def test_the_rule_is_the_stale_refresh_forms_and_asks_a_write_first():
    """Another form has no inject_refresh_changed to count; a stale-refresh control that wrote no refresh is the
    injection-missed row's (NEEDS), not this rule's."""
    other = GateCase(BUILD, GateMode.parse("plain"), backend="FLASH_ATTN", inject=STALE_CAPTURE)
    assert coverage.recreated_nothing(other, _wrote_refreshes(0)["counters"]) is None
    unwritten = {**_wrote_refreshes(0)["counters"], "inject_writes": {}}
    assert coverage.recreated_nothing(_stale_refresh("plain"), unwritten) is None


def _row(run: GateRun) -> str:
    return next(line for line in report.markdown(run).splitlines() if "(self control, stale-refresh)" in line)


def test_the_gates_table_says_no_defect_re_created_never_not_caught_and_caught_when_it_was():
    nothing, caught = [], []
    for mode in ("plain", "audit"):
        c = _stale_refresh(mode)
        res = CaseResult(c.case_id, CLEAN, "decoded", backend_identity=_wrote_refreshes(0))
        nothing.append((c, gate_judge.vouch(c, res)))
        ident = copy.deepcopy(_wrote_refreshes(216))
        caught.append(
            (c, CaseResult(c.case_id, STALE_AUDIT if mode == "audit" else CRASH, "x", backend_identity=ident))
        )
    row = _row(GateRun(cases=nothing))
    assert "**no defect re-created: cannot vouch**" in row and "NOT caught" not in row
    headline = next(line for line in report.markdown(GateRun(cases=nothing)).splitlines() if line.startswith("**Gate:"))
    assert headline.startswith("**Gate: CANNOT VOUCH** because: a self control re-created no defect"), headline
    assert "**defect re-created: caught**" in _row(GateRun(cases=caught))


def test_a_repetition_that_answered_clean_is_a_miss_whatever_the_other_repetitions_said():
    """With --repeat, a mode whose repetitions were clean and cannot-vouch answered once: the row says NOT caught."""
    cases = []
    for mode in ("plain", "audit"):
        c = _stale_refresh(mode)
        cases.append((c, gate_judge.vouch(c, CaseResult(c.case_id, CLEAN, "x", backend_identity=_wrote_refreshes(0)))))
        cases.append((c, CaseResult(c.case_id, CLEAN, "decoded", backend_identity=_wrote_refreshes(216))))
    assert "**defect re-created: NOT caught**" in _row(GateRun(cases=cases))
