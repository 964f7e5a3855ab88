"""The vLLM gate: every vLLM build x detection mode as its own process (repro.vllm_integration.gate) under a timeout,
classified by the same verdict code as the attention-layer cases (repro.classify), then compared with the
build's own reference run in the same SM configuration.

Detection modes (`--modes`, each a case parameter):
  audit            the freshness auditor, loaded by vLLM through the plugin's entry point, full GPU
  plain            nothing added; a crash is rerun once with CUDA_LAUNCH_BLOCKING=1 to name the kernel
  mps:N            an MPS daemon owned by the run gives the case N SMs (the process must report N)
  sm_margin:N      the plugin passes sm_margin = SMs - N to vLLM's get_scheduler_metadata and FA3 forward
  poison:FILL      the plugin fills the scheduler-metadata entries FA3 never writes (repro.poison names)
  memcheck         compute-sanitizer memcheck, caching allocator (works with torch.compile); recorded, not gating
  memcheck:async   the same with cudaMallocAsync (what the attention-layer cases use); recorded, not gating

Builds under test must be `clean` in every mode and repetition; a control build (known bad) must be detected with
kernel evidence (fault, hang, wrong tokens) in every gating mode, or by the audit in the audit mode, else the run is
HARNESS BLIND."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from repro import policy
from repro.case import CaseResult, SmConfig
from repro.channel import Channel
from repro.descriptors import ConfigError
from repro.poison import parse_poison
from repro.runner import case_logs, device_sm_count, run_process
from repro.sanitizer import sanitizer_env
from repro.smcontrol import MpsDaemon, Unavailable, mps_sm_mismatch
from repro.tags import AUDIT_TAG, COUNTERS_TAG, DEVICE_TAG, ENGINE_TAG, PLUGIN_TAG, RESULT_TAG
from repro.verdicts import CANNOT_VOUCH as NOT_VOUCHED
from repro.verdicts import (
    CLEAN,
    CRASH,
    ERROR,
    FAULTS,
    HANG,
    KERNEL_EVIDENCE,
    OOB,
    SKIP,
    STALE_AUDIT,
    WRONG,
)
from repro.vllm_integration.builds import UNDER_TEST, VllmBuild, build_pythonpath

DEFAULT_MODES = ("audit", "plain")
ALL_MODES = ("audit", "plain", "mps:16", "sm_margin:16", "poison:int-max", "memcheck")
TIE_MARGIN = 0.1  # nats: a reference token whose top-2 margin is below this is a tie, not a reference
MIN_COVERAGE = 0.5  # a comparison that covers less than this share of the tokens cannot vouch for a build
PASS, AFFECTED, BLIND, CANNOT_VOUCH = "PASS", "AFFECTED", "HARNESS BLIND", "CANNOT VOUCH"
EXIT = {PASS: 0, AFFECTED: 1, BLIND: 3, CANNOT_VOUCH: 4}  # 2 is bad input; a bisect step maps 3 and 4 to 125
NO_CONTROL = "no known-bad control build ran in a gating mode"
BASE_ENV = {
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine in the case process: one process, one CUDA context
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # the V2 sampler probes FlashInfer otherwise
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
    "REPRO_WEIGHTS": "margin",
}


@dataclass(frozen=True)
class GateMode:
    name: str
    audit: bool = False
    sm: SmConfig = field(default_factory=SmConfig)
    poison: str | None = None
    sanitizer: str | None = None  # None, "caching" or "async"

    @property
    def gating(self) -> bool:
        """Memcheck is recorded, not gating: on real vLLM it misses the fault (see results/)."""
        return self.sanitizer is None

    @property
    def label(self) -> str:
        return self.name.replace("sm_margin:", "smmargin").replace(":", "-").replace("mps-", "mps")

    @classmethod
    def parse(cls, text: str) -> GateMode:
        kind, _, arg = text.strip().partition(":")
        if kind == "audit" and not arg:
            return cls("audit", audit=True)
        if kind == "plain" and not arg:
            return cls("plain")
        if kind in ("mps", "sm_margin"):
            sm = SmConfig.parse(text.strip())
            return cls(f"{kind}:{sm.sms}", sm=sm)
        if kind == "poison" and arg:
            p = parse_poison(arg)
            if p is None:
                raise ConfigError("poison:none is the plain mode")
            return cls(f"poison:{p.name}", poison=p.name)
        if kind == "memcheck" and arg in ("", "caching", "async"):
            return cls("memcheck" + (":async" if arg == "async" else ""), sanitizer=arg or "caching")
        raise ConfigError(
            f"unknown gate mode {text!r}: use audit, plain, mps:N, sm_margin:N, poison:FILL, memcheck or memcheck:async"
        )


def parse_modes(text: str) -> tuple[GateMode, ...]:
    modes = tuple(GateMode.parse(x) for x in text.split(",") if x.strip())
    if not modes:
        raise ConfigError("no gate modes given")
    return modes


@dataclass(frozen=True)
class GateCase:
    build: VllmBuild
    mode: GateMode
    reference: bool = False
    rep: int = 0
    launch_blocking: bool = False
    timeout_s: float = 300.0

    @property
    def case_id(self) -> str:
        what = f"reference-{self.mode.sm.label}" if self.reference else self.mode.label
        parts = ["stale_metadata", "vllm", self.build.label, self.build.role, what]
        if self.rep:
            parts.append(f"rep{self.rep}")
        if self.launch_blocking:
            parts.append("launch-blocking")
        return "-".join(parts)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, d: dict) -> GateCase:
        """The inverse of to_json (results.json keeps it as each result's spec)."""
        mode = dict(d["mode"])
        mode["sm"] = SmConfig(**mode["sm"])
        return cls(**{**d, "build": VllmBuild(**d["build"]), "mode": GateMode(**mode)})


def reference_for(case: GateCase) -> GateCase:
    return GateCase(
        case.build, GateMode(f"reference-{case.mode.sm.label}", sm=case.mode.sm), True, 0, False, case.timeout_s
    )


def case_env(
    case: GateCase,
    builds: list[VllmBuild],
    audit_file: Path,
    mps: MpsDaemon | None,
    total_sms: Callable[[], int],
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one gate case process. Raises Unavailable when the machine cannot give the mode."""
    env = dict(os.environ if base is None else base)
    for k in (
        "REPRO_AUDIT",
        "REPRO_AUDIT_FILE",
        "REPRO_PROBE",
        "REPRO_SM_MARGIN",
        "REPRO_POISON",
        "CUDA_LAUNCH_BLOCKING",
    ):
        env.pop(k, None)
    env.update(BASE_ENV)
    root = str(Path(__file__).resolve().parents[2])
    path = build_pythonpath(case.build, builds, env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, root) if p)
    # torch.compile artifacts of concurrent cases must not share one folder; inductor's own cache locks itself
    env["VLLM_CACHE_ROOT"] = str(audit_file.parent / f"{case.case_id}.vllm-cache")
    mode = case.mode
    if not case.reference:
        env["REPRO_PROBE"] = "1"  # coverage counters in every case but the references
    if mode.audit and not case.reference:
        env.update(REPRO_AUDIT="1", REPRO_AUDIT_FILE=str(audit_file))
    if mode.poison and not case.reference:
        env["REPRO_POISON"] = mode.poison
    if mode.sm.kind == "sm_margin":
        total = total_sms()
        if mode.sm.sms > total:
            raise ConfigError(f"sm_margin:{mode.sm.sms}: this GPU has {total} SMs")
        env["REPRO_SM_MARGIN"] = str(total - mode.sm.sms)
    elif mode.sm.kind == "mps":
        if mps is None:
            raise Unavailable("MPS case without an MPS daemon")
        env.update(mps.client_env(mode.sm.sms, total_sms()))
    elif mode.sm.kind != "full":
        raise ConfigError(f"gate SM restriction {mode.sm.kind!r} is not supported (full, mps:N, sm_margin:N)")
    if mode.sanitizer and not case.reference:
        if mode.sanitizer == "async":
            env = sanitizer_env(env)
        else:  # torch's caching allocator: inductor's launcher fails under memcheck with cudaMallocAsync
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if case.launch_blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    return env


def run_case(
    case: GateCase,
    builds: list[VllmBuild],
    log_dir: str | Path,
    mps: MpsDaemon | None = None,
    total_sms: Callable[[], int] = device_sm_count,
) -> CaseResult:
    """One gate case in its own process; never raises for a faulting case."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    audit_file = log_dir / f"{case.case_id}.audit.json"
    try:
        env = case_env(case, builds, audit_file, mps, total_sms)
    except Unavailable as e:
        return _skipped(case, str(e))
    model_dir = log_dir / f"{case.case_id}.models"
    cmd = [sys.executable, "-m", "repro.vllm_integration.gate", "--out", str(model_dir)]
    if case.reference:
        cmd.append("--reference")
    res, out = run_process(case, cmd, env, log_dir, bool(case.mode.sanitizer) and not case.reference)
    if not case.reference:
        res.expected = expected(case)  # fixed before the case is judged
    if res.verdict == SKIP:
        res.vllm_version = case.build.version
        return res
    ch = Channel.of_case(case_logs(log_dir, case.case_id)[0], out)
    return annotate(res, case, ch, audit_file if audit_file.exists() else None)


def run_attributed(
    case: GateCase, builds: list[VllmBuild], log_dir: str | Path, mps: MpsDaemon | None = None
) -> tuple[CaseResult, tuple[GateCase, CaseResult] | None]:
    """run_case, and for a crash in the plain mode (first repetition) a rerun with CUDA_LAUNCH_BLOCKING=1 that names
    the faulting kernel: (result, (rerun case, rerun result) or None)."""
    res = run_case(case, builds, log_dir, mps)
    if res.verdict != CRASH or case.mode.name != "plain" or case.rep or case.reference:
        return res, None
    rc = GateCase(case.build, case.mode, False, case.rep, True, case.timeout_s)
    rerun = run_case(rc, builds, log_dir, mps)
    kernel = rerun.kernel if rerun.verdict == CRASH else None
    if kernel:
        res = res.revised(
            "attribution rerun",
            f"{rc.case_id} crashed in the {kernel} kernel's launch check",
            kernel=kernel,
            evidence=f"fault in the {kernel} kernel (named by a CUDA_LAUNCH_BLOCKING=1 rerun)",
        )
    return res, (rc, rerun)


def _skipped(case: GateCase, reason: str) -> CaseResult:
    res = CaseResult.skipped(case, reason)
    res.vllm_version = case.build.version
    if not case.reference:
        res.expected = expected(case)
    return res


def annotate(res: CaseResult, case: GateCase, output: str | Channel, audit_file: Path | None) -> CaseResult:
    """The gate's record of a case: the shared classification completed with what the gate case process and the
    plugin inside vLLM reported on the channel (version, engine configuration and counters in backend_identity:
    {"engine", "counters", "acceptance"}, the auditor's stale views, the evidence line), then revised where that
    changes the verdict (an install error of any hook under any tag, an MPS SM count other than asked, stale views
    behind a clean run). `output`: the case's Channel, or a log's text (records written before the channel)."""
    ch = output if isinstance(output, Channel) else Channel.from_output(output)
    result = ch.last(RESULT_TAG) or {}
    plugin = ch.of(PLUGIN_TAG)
    installed = {p["installed"] for p in plugin if "installed" in p}
    needed = {"weights"}
    if not case.reference:
        needed.add("probe")
    if case.mode.audit and not case.reference:
        needed.add("audit")
    if (case.mode.sm.kind == "sm_margin") or (case.mode.poison and not case.reference):
        needed.add("fa3")
    engine, counters = ch.last(ENGINE_TAG), ch.last(COUNTERS_TAG)
    identity = res.backend_identity
    if engine or counters:
        e = dict(engine or {})
        identity = {
            "engine": {k: v for k, v in e.items() if k not in ("counters", "acceptance")},
            "counters": e.get("counters") or counters or {},
            "acceptance": e.get("acceptance"),
        }
    audit = _audit_evidence(ch, audit_file)
    # without CUDA_LAUNCH_BLOCKING=1 a crash surfaces at any later call: not attributed (with it, classify named the
    # kernel from the first fault line only)
    kernel = None if res.verdict == CRASH and not case.launch_blocking else res.kernel
    evidence = []
    if res.verdict in KERNEL_EVIDENCE:
        evidence.append(res.evidence + (f", {kernel} kernel" if kernel else ""))
    if case.mode.sanitizer and res.verdict not in (OOB, SKIP):
        evidence.append("memcheck: no finding")
    if case.mode.audit and not case.reference:
        evidence.append(f"audit: {audit['stale']} stale fields in {audit['checks']} checks")
    res = replace(
        res,
        vllm_version=result.get("vllm_version") or case.build.version,
        kernel=kernel,
        backend_identity=identity,
        stale_fields=audit["fields"] if audit["stale"] else res.stale_fields,
        first_diffs=audit["first"] if audit["stale"] else res.first_diffs,
        evidence="; ".join(evidence) or None,
    )
    if res.verdict == SKIP:
        return res
    errors = ch.errors()  # an install error of any hook, under any tag, reaches the verdict
    missing = needed - installed
    if errors or (missing and (result or plugin)):
        what = "; ".join(errors) or (
            f"plugin features {sorted(missing)} not installed: vLLM did not load the repro plugin through its entry "
            "point (python -m pip install -e <this project> in the environment that runs vLLM)"
        )
        why = f"{what} (case verdict would have been {res.verdict}: {res.reason})"
        return res.revised("plugin", "a hook reported an error or was not installed", verdict=ERROR, reason=why)
    devices = ch.of(DEVICE_TAG)
    if devices and (why := mps_sm_mismatch(case.mode.sm, devices[-1].get("sms"))):
        return res.revised("MPS SM count", why, verdict=ERROR, reason=why)
    if res.verdict == CLEAN and audit["stale"]:
        why = f"no fault this run, but the auditor caught stale views: {audit['first'][0]}"
        return res.revised("audit", why, verdict=STALE_AUDIT, reason=why, descriptor=audit["descriptor"])
    if audit["stale"] and res.verdict in (CRASH, HANG):
        return res.revised(
            "audit",
            "the auditor saw stale views before the fault",
            reason=res.reason + f"; the auditor caught stale views before it: {audit['first'][0]}",
            descriptor=res.descriptor or audit["descriptor"],
        )
    return res


FULL_MODES = ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def not_fired(case: GateCase, identity: dict | None) -> list[str]:
    """What this case exists to exercise and did not: the engine's resolved configuration (V2 runner, FLASH_ATTN with
    FA3, FULL graphs, speculative decoding) and the mode's own counter (audit checks, sm_margin calls, poisoned
    entries), from what the case process reported. Empty when everything fired."""
    if case.reference:
        return []
    if not identity or not identity.get("engine"):
        return ["the case process reported no engine configuration and no counters (no REPRO_ENGINE line)"]
    e, c = identity["engine"], identity.get("counters") or {}
    out = []
    if not e.get("model_runner_v2"):
        out.append(f"not the V2 model runner (runner: {e.get('model_runner') or 'none seen'})")
    if not c.get("attention_forwards"):
        out.append(
            "no attention forward went through FlashAttentionImpl.forward, the hooked path (another attention "
            f"backend, or renamed classes; requested {e.get('attention_backend_requested')})"
        )
    else:
        versions = c.get("fa_versions") or {}
        if set(versions) != {"3"}:
            out.append(f"FlashAttention version {', '.join(sorted(versions)) or 'unknown'}, not FA3")
    mode = e.get("cudagraph_mode")
    if mode not in FULL_MODES:
        out.append(f"cudagraph mode {mode}: no FULL CUDA graphs")
    elif not sum((c.get("captures_with_attention") or {}).values()):
        out.append(f"cudagraph mode {mode}, but no CUDA graph capture ran an attention forward (no FULL graph seen)")
    if not e.get("speculative_method") or not e.get("num_speculative_tokens"):
        out.append(
            f"no speculative decoding (method {e.get('speculative_method')}, k {e.get('num_speculative_tokens')})"
        )
    else:
        acc = identity.get("acceptance") or {}
        drafts = acc.get("spec_decode_num_drafts")
        if isinstance(drafts, (int, float)) and drafts == 0:
            out.append("speculative decoding configured, but vLLM counted 0 drafts")
    if case.mode.audit and not c.get("checks"):
        out.append("the freshness auditor made 0 checks")
    if case.mode.sm.kind == "sm_margin":
        if not c.get("sched_sm_margin"):
            out.append("no get_scheduler_metadata call received the injected sm_margin")
        if not c.get("fwd_sm_margin"):
            out.append("no FA3 forward (torch.ops._vllm_fa3_C.fwd) received the injected sm_margin")
    if case.mode.poison and not c.get("entries_poisoned"):
        out.append(
            f"0 scheduler-metadata entries poisoned ({c.get('sched_calls', 0)} get_scheduler_metadata calls seen)"
        )
    return out


def vouch(case: GateCase, res: CaseResult) -> CaseResult:
    """A case that would be clean or stale-audit, but whose feature did not fire, becomes cannot-vouch with the
    reason (a new record); a crash, a hang or wrong tokens stay evidence."""
    if case.reference or res.verdict not in (CLEAN, STALE_AUDIT):
        return res
    missing = not_fired(case, res.backend_identity)
    if not missing:
        return res
    reason = f"{'; '.join(missing)} (case verdict would have been {res.verdict}: {res.reason[:200]})"
    return res.revised("coverage", "; ".join(missing), verdict=NOT_VOUCHED, reason=reason)


def finish(case: GateCase, res: CaseResult, out: dict | None, ref: CaseResult, ref_out: dict | None) -> CaseResult:
    """Judge a finished case: its reference comparison, then what fired (vouch); each a new record."""
    return vouch(case, apply_reference(res, out, ref, ref_out))


def _audit_evidence(ch: Channel, audit_file: Path | None) -> dict:
    lines = ch.of(AUDIT_TAG)
    stale = [x["stale"] for x in lines if "stale" in x and isinstance(x["stale"], dict)]
    checks = 0
    if audit_file is not None:
        try:
            report = json.loads(audit_file.read_text())
            checks = int(report.get("checks", 0))
            stale = report.get("mismatches", stale) or stale
        except (OSError, ValueError):
            pass
    summaries = [x for x in lines if "checks" in x]
    if summaries:
        checks = max(checks, int(summaries[-1]["checks"]))
    fields: dict[str, int] = {}
    for m in stale:
        key = f"{m['buffer']}.{m['field']}" if m["field"] != m["buffer"] else m["buffer"]
        fields[key] = fields.get(key, 0) + 1
    first = [
        f"{m['descriptor']}: {m['buffer']}.{m['field']}[{m['index']}] is {m['now']}, the build wrote {m['built']}"
        for m in stale[:3]
    ]
    return {
        "stale": len(stale),
        "checks": checks,
        "fields": fields,
        "first": first,
        "descriptor": stale[0]["descriptor"] if stale else None,
    }


@dataclass
class TokenCheck:
    compared: int = 0  # positions compared (up to the first tie or difference of each request)
    total: int = 0
    ties: int = 0  # requests whose comparison stopped at a near-tied reference token
    wrong: list[str] = field(default_factory=list)
    worst_margin: float | None = None  # largest reference margin among the wrong tokens (nats)

    @property
    def coverage(self) -> float:
        return self.compared / self.total if self.total else 0.0

    def describe(self) -> str:
        s = f"tokens: {self.compared} of {self.total} compared equal to the reference"
        if self.ties:
            s += f", {self.ties} request(s) stopped at a near tie (< {TIE_MARGIN} nats)"
        if self.wrong:
            s += f"; {len(self.wrong)} differ where the reference was decided: {self.wrong[0]}"
        return s


def compare_tokens(
    tokens: list[list[int]], ref_tokens: list[list[int]], ref_margins: list[list[float | None]] | None
) -> TokenCheck:
    """Greedy tokens of the speculative, graph-captured run against the reference. A difference where the reference's
    top-2 log-probability margin is below TIE_MARGIN is a tie (numerics may pick either): the request stops being
    compared there. A difference where the reference was decided is wrong output; the margin is the measured error."""
    c = TokenCheck(total=sum(len(r) for r in ref_tokens))
    for i, (got, want) in enumerate(zip(tokens, ref_tokens)):
        margins = ref_margins[i] if ref_margins and i < len(ref_margins) else []
        for j, w in enumerate(want):
            g = got[j] if j < len(got) else None
            if g == w:
                c.compared += 1
                continue
            m = margins[j] if j < len(margins) else None
            if m is not None and m < TIE_MARGIN:
                c.ties += 1
            else:
                c.wrong.append(f"request {i} token {j}: {g}, reference {w} (reference margin {m} nats)")
                if m is not None:
                    c.worst_margin = max(c.worst_margin or 0.0, m)
            break
    return c


def apply_reference(res: CaseResult, out: dict | None, ref: CaseResult, ref_out: dict | None) -> CaseResult:
    """A finished speculative case judged against its reference (a new record): wrong-output where the greedy tokens
    differ where the reference was decided, error without a reference or with too many near ties.
    out, ref_out: the RESULT records of the two processes (result_line)."""
    if res.verdict not in (CLEAN, STALE_AUDIT):
        return res
    step = "reference comparison"
    if ref.verdict != CLEAN or not ref_out or not out:
        why = f"no reference to compare with ({ref.case_id}: {ref.verdict}: {ref.reason[:200]})"
        return res.revised(step, why, verdict=ERROR, reason=why)
    chk = compare_tokens(out["tokens"], ref_out["tokens"], ref_out.get("margins"))
    evidence = "; ".join(x for x in (res.evidence, chk.describe()) if x)
    if chk.wrong:
        why = f"greedy tokens differ from the reference where it was decided: {chk.wrong[0]}"
        return res.revised(step, why, verdict=WRONG, max_abs_err=chk.worst_margin, reason=why, evidence=evidence)
    if chk.coverage < MIN_COVERAGE and res.verdict == CLEAN:
        why = f"the reference comparison covered {chk.compared} of {chk.total} tokens: too many near ties"
        return res.revised(step, why, verdict=ERROR, reason=why, evidence=evidence)
    return res.revised(step, chk.describe(), evidence=evidence)


def expected(case: GateCase) -> str:
    """The policy expectation (repro.policy) of a gate case: clean (a build under test), detected (a control: kernel
    evidence), audit (a control in the audit mode: the auditor's stale views from the engine count too) or recorded
    (memcheck on a control: what it finds is recorded, not required)."""
    if case.build.role == UNDER_TEST:
        return policy.EXPECT_CLEAN
    if not case.mode.gating:
        return policy.RECORDED
    return policy.AUDIT if case.mode.audit else policy.DETECTED


def meets(case: GateCase, res: CaseResult) -> bool:
    """Does the case meet its expectation (the one stored in the result, else computed)? repro.policy.problem."""
    return policy.problem(res.expected or expected(case), res.verdict) is None


@dataclass
class GateRun:
    cases: list[tuple[GateCase, CaseResult]] = field(default_factory=list)
    references: list[tuple[GateCase, CaseResult]] = field(default_factory=list)
    attributions: list[tuple[GateCase, CaseResult]] = field(default_factory=list)  # launch-blocking reruns
    wall_s: float = 0.0
    build_wall_s: dict[str, float] = field(default_factory=dict)

    def controls(self) -> list[policy.Control]:
        """Every case as the policy sees it: mode = the gate mode's name."""
        return [
            policy.Control(c.case_id, r.expected or expected(c), r.verdict, c.mode.name, r.reason)
            for c, r in self.cases
        ]

    def decision(self, need_control: bool = True) -> policy.GateDecision:
        """repro.policy.decide over every case; without need_control (a bisect step answering for its build alone)
        the missing positive control is not a failure."""
        d = policy.decide(self.controls())
        if not need_control:
            d.failures = [f for f in d.failures if "no positive control ran" not in f]
        return d

    def affected(self) -> list[tuple[GateCase, CaseResult]]:
        """Builds under test whose case did not come back clean (the bug, or no answer)."""
        return [(c, r) for c, r in self.cases if c.build.role == UNDER_TEST and not meets(c, r)]

    def not_vouched(self) -> list[tuple[GateCase, CaseResult]]:
        """Cases (under test or control) whose checked feature did not fire."""
        return [(c, r) for c, r in self.cases if r.verdict == NOT_VOUCHED]

    def blind(self, need_control: bool = True) -> list[str]:
        """Why the controls cannot vouch for the run: the policy's failures that are not about a build under test."""
        under = {c.case_id for c, _ in self.cases if c.build.role == UNDER_TEST}
        out = []
        for f in self.decision(need_control).failures:
            if f.split(":")[0] in under:
                continue
            if "no positive control ran" in f:
                f = f"{NO_CONTROL} (set REPRO_VLLM_CONTROL=0.25.1=<prefix>): {f}"
            out.append(f)
        return out

    def outcome(self, need_control: bool = True) -> str:
        """AFFECTED (a build under test showed the bug), CANNOT VOUCH (a case's checked feature did not fire, or a
        build under test errored or skipped), HARNESS BLIND (repro.policy.decide failed on the controls: a control
        missed, or a gating mode has no evidence from its own control, or none ran while one is needed) or PASS;
        EXIT maps them to exit codes."""
        affected = self.affected()
        if any(r.verdict in FAULTS for _, r in affected):
            return AFFECTED
        if affected or self.not_vouched():
            return CANNOT_VOUCH
        return BLIND if self.blind(need_control) else PASS


def plan(builds: list[VllmBuild], modes: tuple[GateMode, ...], repeat: int, timeout_s: float) -> list[GateCase]:
    if repeat < 1:
        raise ConfigError("--repeat must be at least 1")
    return [GateCase(b, m, rep=r, timeout_s=timeout_s) for b in builds for m in modes for r in range(repeat)]


def run_gate(
    builds: list[VllmBuild],
    modes: tuple[GateMode, ...],
    log_dir: str | Path,
    repeat: int = 1,
    jobs: int = 3,
    timeout_s: float = 300.0,
    progress: Callable[[GateCase, CaseResult], None] | None = None,
) -> GateRun:
    """Every case, references included; non-MPS cases `jobs` at a time, MPS cases one at a time under one daemon
    owned by the run (a faulting MPS client can take the server's other clients down)."""
    if not builds:
        raise ConfigError("no vLLM build to test: install vllm, or set REPRO_VLLM / REPRO_VLLM_CONTROL")
    cases = plan(builds, modes, repeat, timeout_s)
    asked = [m.sm.sms for m in modes if m.sm.kind in ("sm_margin", "mps")]
    if asked:
        try:
            total = device_sm_count()
        except Unavailable:
            total = None  # no GPU: those cases skip with the reason
        if total is not None and max(asked) > total:
            raise ConfigError(f"a mode asks for {max(asked)} SMs; this GPU has {total}")
    refs = list(dict.fromkeys(reference_for(c) for c in cases))
    run = GateRun()
    lock = threading.Lock()
    starts: dict[str, list[float]] = {}
    outputs: dict[str, dict | None] = {}
    t0 = time.time()

    def one(c: GateCase, mps: MpsDaemon | None) -> None:
        t = time.time()
        res, attribution = run_attributed(c, builds, log_dir, mps)
        out = result_line(log_dir, c)
        with lock:
            outputs[c.case_id] = out
            (run.references if c.reference else run.cases).append((c, res))
            if attribution:
                run.attributions.append(attribution)
            span = starts.setdefault(c.build.label, [t, t])
            span[0], span[1] = min(span[0], t), max(span[1], time.time())
        if progress:
            progress(c, res)

    everything = refs + cases
    serial = [c for c in everything if c.mode.sm.kind == "mps"]
    parallel = [c for c in everything if c.mode.sm.kind != "mps"]

    def serial_part() -> None:
        if not serial:
            return
        try:
            with MpsDaemon() as mps:
                for c in serial:
                    one(c, mps)
        except Unavailable as e:
            for c in serial:
                res = _skipped(c, str(e))
                with lock:
                    (run.references if c.reference else run.cases).append((c, res))

    mps_thread = threading.Thread(target=serial_part, daemon=True)
    mps_thread.start()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(lambda c: one(c, None), parallel))
    mps_thread.join()
    ref_by_key = {(c.build, c.mode.sm): (c, r) for c, r in run.references}
    judged = []
    for c, r in run.cases:
        rc, rr = ref_by_key[(c.build, c.mode.sm)]
        judged.append((c, finish(c, r, outputs.get(c.case_id), rr, outputs.get(rc.case_id))))
    run.cases = judged
    order = {c.case_id: i for i, c in enumerate(cases)}
    run.cases.sort(key=lambda cr: order[cr[0].case_id])
    run.wall_s = round(time.time() - t0, 1)
    run.build_wall_s = {k: round(v[1] - v[0], 1) for k, v in starts.items()}
    return run


def result_line(log_dir: str | Path, case: GateCase) -> dict | None:
    """The RESULT record a finished case process wrote (tokens, margins, version, timing), or None."""
    return Channel.of_case(case_logs(log_dir, case.case_id)[0]).last(RESULT_TAG)
