"""What an audited run shows, judged in the gate's words (PASS / AFFECTED / CANNOT VOUCH) from the typed records the
plugin left: the merged audit file (every process's report: plugin.audit_file.merged_report) and the marks of the
processes that installed the auditor (plugin.counters.mark_started). The command's own exit status is kept beside the
answer, never in it: a command that fails with nothing stale is not AFFECTED, one that passes with stale metadata is.

AFFECTED: any stale view or stale-descriptor field, each descriptor named with its fields. CANNOT VOUCH: no process
reported, the auditor not installed or 0 checks, no FULL capture audited, the descriptor check never ran or could not
run at a FULL pass, a spec-decode layout the auditor does not know, a process that installed the auditor and never
reported (killed, or died before its exit report, leaving no snapshot either), a run stopped at its timeout, or a
method (speculator, capture manager) other than the one asked for (gate.coverage.method_problems), a capture manager
whose FULL captures were none of them audited (the hook on its metadata's builder never fired). PASS otherwise,
with what it rests on.

A process whose last report is a snapshot (plugin.counters.keep_snapshot: `final` false; killed before its exit
report, as `vllm serve`'s shutdown force-kills its engine core) reported: its counts and findings are judged as any
report's, and the report says "no exit report (killed, or still running when read); last snapshot after <event> at
<time>; checks after <time> not seen". A snapshot proves what was checked up to it: the plugin writes one at every
FULL capture's end while nothing was found and at once at the first stale finding (later ones within 2 s), so a
process that found anything stale says so; the checks after it (clean ones, their counts) are not seen.

Beside the answer, never in it: what the replay check and the refresh judging judged (gate.checked.judged, the
gate's words): replays judged and left unjudged with the most common reason, or the check off with its reason. A
PASS rests on the capture-time checks; where the replay check judged 0 replays it says "0 judged", never clean."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from repro.judge.decision import GateOutcome
from repro.vllm_integration.gate.checked import judged
from repro.vllm_integration.gate.coverage import method_problems
from repro.vllm_integration.plugin.audit import STALE_DESCRIPTOR
from repro.vllm_integration.plugin.audit_file import is_final

# vLLM's speculative method names over the releases the harness covers (SpeculativeConfig.method; an MTP model type
# ends in _mtp and vLLM runs and reports it as mtp)
KNOWN_METHODS = frozenset(
    {"ngram", "ngram_gpu", "draft_model", "suffix", "eagle", "eagle3", "extract_hidden_states", "mtp", "dflash",
     "dspark", "medusa", "mlp_speculator"}
)  # fmt: skip


def expected_method(name: str | None, flag: str = "--expect-method") -> tuple[str | None, str | None]:
    """(the method a run must show, as vLLM reports it, or None; a note for the user or None). An MTP model type
    (deepseek_mtp & co.) is compared as mtp, a name in capitals as the name; ValueError for an empty name or one vLLM
    never gives a method (a typo would cost a whole run and answer CANNOT VOUCH): refused before anything runs."""
    if name is None:
        return None, None
    low = name.strip().lower()
    if not low:
        raise ValueError(f"{flag} '': give a method name ({', '.join(sorted(KNOWN_METHODS))})")
    if low in KNOWN_METHODS:
        return low, None
    if low.endswith("_mtp"):
        return "mtp", f"{flag} {name}: an MTP model type, which vLLM runs and reports as method mtp: compared as mtp"
    raise ValueError(
        f"{flag} {name}: not a speculative method vLLM names: {', '.join(sorted(KNOWN_METHODS))}, or an MTP model type"
    )


@dataclass(frozen=True)
class Expect:
    """What the user asked for and the run must show (`--expect-method` & co.); None: not compared."""

    method: str | None = None
    speculator: str | None = None
    manager: str | None = None


@dataclass(frozen=True)
class CommandStatus:
    """How the audited command ended: its exit status (None: stopped before it exited), timed out, interrupted."""

    argv: tuple[str, ...]
    returncode: int | None
    timed_out: bool = False
    seconds: float = 0.0
    strict: bool = False

    @property
    def words(self) -> str:
        if self.timed_out:
            return f"stopped at its timeout after {self.seconds:.0f} s"
        if self.returncode is None:
            return "did not exit"
        if self.returncode < 0:
            return f"killed by signal {-self.returncode}"
        return f"exit {self.returncode}" + (" (passed)" if self.returncode == 0 else " (failed)")


@dataclass
class Judgement:
    outcome: GateOutcome
    reasons: list[str]
    stale: dict[str, list[str]]  # descriptor -> "field (kind): now vs built" for each stale field
    stale_fields: int  # stale findings, each one (a field may be found at a forward and again at its capture's end)
    checks: int
    descriptor_checks: int
    full_by_manager: dict[str, int]  # capture manager -> FULL captures (an attention forward inside)
    audited_by_manager: dict[str, int]  # capture manager -> captures the auditor checked at capture end
    stale_by_manager: dict[str, int]
    methods: dict[str, str] = field(default_factory=dict)  # "pid N (name)" -> the method its runner ran
    processes: list[dict] = field(default_factory=list)  # one row per process: reported or only started
    snapshots: list[str] = field(default_factory=list)  # "pid N (name): no exit report ...; last snapshot ..." each
    replay: dict = field(default_factory=dict)  # what the replay check judged (gate.checked.judged), its words
    refresh: dict = field(default_factory=dict)  # what the refresh judging judged, its words

    @property
    def distinct_stale_fields(self) -> int:
        """The distinct fields the stale findings name (`stale`: each descriptor's fields, each once)."""
        return sum(len(fields) for fields in self.stale.values())

    def to_dict(self) -> dict:
        out = asdict(self)
        out["outcome"] = str(self.outcome.value)
        out["distinct_stale_fields"] = self.distinct_stale_fields
        return out


def _add(into: dict[str, int], more: Any) -> None:
    for k, v in (more or {}).items():
        if isinstance(v, (int, float)) and v:
            into[k] = into.get(k, 0) + int(v)


def _field_words(m: dict) -> str:
    kind = "stale-descriptor" if m.get("kind") == STALE_DESCRIPTOR else "stale"
    where = m.get("field") or m.get("buffer")
    index = "" if str(where).endswith(")") else f"[{m.get('index')}]"
    return f"{where}{index} ({kind}): {m.get('now')} where its build gives {m.get('built')}"


def stale_by_descriptor(mismatches: list[dict]) -> dict[str, list[str]]:
    """Each descriptor the stale findings name -> its fields in words, each field once (its first finding)."""
    out: dict[str, list[str]] = {}
    for m in mismatches:
        words = _field_words(m)
        have = out.setdefault(str(m.get("descriptor")), [])
        if not any(w.split(" (")[0] == words.split(" (")[0] for w in have):
            have.append(words)
    return out


def _who(p: dict) -> str:
    return f"pid {p.get('pid')} ({p.get('process') or 'unnamed'})"


def last_snapshot(p: dict) -> str | None:
    """What a process's report is, where it is a snapshot (None: its exit report), in the report's words."""
    if is_final(p):
        return None
    at = p.get("written")
    when = time.strftime("%H:%M:%S UTC", time.gmtime(at)) if isinstance(at, (int, float)) and at else None
    why = p.get("snapshot_reason") or "an event not named"
    said = f"no exit report (killed, or still running when read); last snapshot after {why}"
    return f"{said} at {when}; checks after {when} not seen" if when else f"{said}; checks after it not seen"


def judge(doc: dict | None, started: list[dict], expect: Expect, command: CommandStatus | None = None) -> Judgement:
    """The run's answer from its merged audit file (`doc`, None when no process wrote one) and its start marks."""
    reported = [p for p in (doc or {}).get("processes") or [] if isinstance(p, dict)]
    mismatches = [m for m in (doc or {}).get("mismatches") or [] if isinstance(m, dict)]
    full, audited, stale_mgr, unchecked, methods = {}, {}, {}, {}, {}
    installed, layouts_unknown = False, []
    for p in reported:
        c = p.get("counters") or {}
        _add(full, c.get("full_captures_by_manager"))
        _add(audited, c.get("audited_by_manager"))
        _add(stale_mgr, c.get("stale_by_manager"))
        _add(unchecked, c.get("descriptor_unchecked"))
        installed = installed or "audit" in (c.get("installed") or [])
        ran = sorted(c.get("speculative_methods") or {}) or (
            [c["speculative_method"]] if c.get("speculative_method") else []
        )
        if ran:
            methods[_who(p)] = ", ".join(map(str, ran))
        if p.get("checks") and c.get("spec_layout_known") is False:
            layouts_unknown.append(f"{_who(p)}: {c.get('spec_layout') or 'none found'}")
    checks = sum(int(p.get("checks") or 0) for p in reported)
    dchecks = sum(int(p.get("descriptor_checks") or 0) for p in reported)
    pids = {p.get("pid") for p in reported}
    lost = [s for s in started if s.get("pid") not in pids]
    rows = [{**{k: p.get(k) for k in ("pid", "process", "checks", "descriptor_checks", "stale")}, "reported": True,
             "snapshot": last_snapshot(p)} for p in reported]  # fmt: skip
    rows += [{"pid": s.get("pid"), "process": s.get("process"), "reported": False} for s in lost]
    snapshots = [f"{_who(p)}: {last_snapshot(p)}" for p in reported if not is_final(p)]
    stale = stale_by_descriptor(mismatches)
    reasons: list[str] = []
    if mismatches:
        for desc, fields in stale.items():
            reasons.append(f"{desc}: {'; '.join(fields)}")
        outcome = GateOutcome.AFFECTED
    else:
        reasons = _cannot_vouch(reported, installed, checks, dchecks, full, audited, unchecked, layouts_unknown, lost)
        if command is not None and command.timed_out:
            reasons.append(f"the command was {command.words}: what it had not reached was not audited")
        if expect.method and not methods and reported:
            reasons.append(f"speculative method asked for: {expect.method}; no process recorded the method it ran")
        for p in reported:
            for why in method_problems(
                expect.method, {}, p.get("counters"), speculator=expect.speculator, manager=expect.manager
            ):
                reasons.append(f"{_who(p)}: {why}")
        outcome = GateOutcome.CANNOT_VOUCH if reasons else GateOutcome.PASS
    seen = judged([p.get("counters") or {} for p in reported])
    found = (stale, len(mismatches), checks, dchecks, full, audited, stale_mgr)
    return Judgement(outcome, reasons, *found, methods, rows, snapshots, **seen)


def _cannot_vouch(
    reported: list[dict],
    installed: bool,
    checks: int,
    dchecks: int,
    full: dict[str, int],
    audited: dict[str, int],
    unchecked: dict[str, int],
    layouts_unknown: list[str],
    lost: list[dict],
) -> list[str]:
    out = []
    if not reported:
        out.append(
            "no vLLM process reported an audit: the plugin did not load (is repro installed in the environment the "
            "command runs in: `pip install -e .`; did the command start vLLM at all?)"
        )
    elif not installed:
        out.append("no process installed the freshness auditor (its REPRO_PLUGIN error line says why)")
    elif not checks:
        out.append("the freshness auditor made 0 checks")
    if reported and not sum(audited.values()):
        out.append("no FULL CUDA graph capture was audited (FULL graphs off, or no capture manager on the stack)")
    for mgr in sorted(m for m, n in full.items() if n and not audited.get(m)):  # its builder's hook never fired
        out.append(f"{full[mgr]} FULL capture(s) by {mgr}, none audited (its metadata's builder not hooked)")
    if reported and not dchecks:
        out.append("the descriptor check never ran (no FULL capture pass's descriptor found)")
    if unchecked:
        why = "; ".join(f"{k} ({v})" for k, v in unchecked.items())
        out.append(
            f"the descriptor check could not build its reference at {sum(unchecked.values())} FULL pass(es): {why}"
        )
    for layout in layouts_unknown:
        out.append(f"a speculative-decoding layout the auditor does not know ({layout})")
    for s in lost:
        out.append(f"{_who(s)} installed the auditor and never reported (killed, or died before its exit report)")
    return out
