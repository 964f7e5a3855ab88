"""A case: what to run (CaseSpec) and what came of it (CaseResult, verdicts)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, replace

from repro.case.descriptors import AttnConfig
from repro.case.poison import parse_poison
from repro.case.scenarios import FRESH, PAIR, SCENARIOS, STRATEGIES, V2
from repro.contract.verdicts import FAULTS, SKIP  # the taxonomy lives in repro.contract.verdicts
from repro.errors import ConfigError

MODES = ("eager", "graph")
SM_KINDS = ("full", "sm_margin", "mps", "green", "mig")


MAX_SMS = 1024  # more SMs than any GPU has: refused before a GPU is asked


@dataclass(frozen=True)
class SmConfig:
    """How the case restricts SMs. sms: the SM count FA3 should plan for (None = whole GPU or MIG slice)."""

    kind: str = "full"
    sms: int | None = None
    mig_uuid: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in SM_KINDS:
            raise ConfigError(f"unknown SM restriction {self.kind!r}; choose from {', '.join(SM_KINDS)}")
        if self.kind in ("sm_margin", "mps", "green") and (self.sms is None or self.sms <= 0):
            raise ConfigError(f"{self.kind} needs a positive SM count")

    @property
    def label(self) -> str:
        if self.kind == "full":
            return "sm-all"
        if self.kind == "mig":
            return f"mig-{(self.mig_uuid or 'slice')[-8:]}"
        return f"{self.kind.replace('_', '')}{self.sms}"

    @classmethod
    def parse(cls, text: str) -> SmConfig:
        """`full`, `sm_margin:16`, `mps:16`, `green:16`, `mig` or `mig:<uuid>`."""
        kind, _, arg = text.partition(":")
        if kind == "mig":
            return cls("mig", None, arg or None)
        if kind == "full" and not arg:
            return cls("full")
        # N in plain digits (a minus: the range below says why not): int() took `1_6`, `+5`, ` 16`
        sms = int(arg) if kind in ("sm_margin", "mps", "green") and re.fullmatch(r"-?[0-9]+", arg) else None
        if sms is None:  # `full:12`, `mps:x`, `bogus:3`: never a count dropped or a kind guessed
            raise ConfigError(
                f"bad SM configuration {text!r}: use full, sm_margin:N, mps:N, green:N (N in digits 0-9) or mig[:uuid]"
            )
        if not 0 <= sms <= MAX_SMS:  # a GPU's own count is checked where one is (sm_refusal)
            raise ConfigError(f"{text}: impossible SM count: 0 to {MAX_SMS} (no GPU has more SMs)")
        return cls(kind, sms)


def mps_sm_mismatch(sm: SmConfig, reported: int | None) -> str | None:
    """Why a case process under an MPS SM restriction (`sm`) did not get the SMs it asked for, or None: the SM count
    the process reports must equal the case's (the attention-layer worker and the vLLM gate both check). The machine
    has MPS and it did not do as asked: an error, never a skip."""
    if sm.kind == "mps" and reported != sm.sms:
        return f"MPS gave this process {reported} SMs, the case asked for {sm.sms}"
    return None


@dataclass(frozen=True)
class CaseSpec:
    backend: str
    strategy: str
    mode: str = "eager"
    scenario: str = V2
    sm: SmConfig = field(default_factory=SmConfig)
    cfg: AttnConfig = field(default_factory=AttnConfig)
    poison: str | None = None
    sanitizer: bool = False
    pair: tuple[str, str] | None = None
    backend_path: str | None = None
    timeout_s: float = 120.0
    seed: int = 0
    rep: int = 0  # repeat index: same case, run again

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"unknown strategy {self.strategy!r}; choose from {', '.join(STRATEGIES)}")
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        if self.scenario not in SCENARIOS:
            raise ConfigError(f"unknown scenario {self.scenario!r}; choose from {', '.join(SCENARIOS)}")

        if self.scenario == PAIR and not self.pair:
            raise ConfigError("the pair scenario needs --built-for and --launched descriptors")
        parse_poison(self.poison)
        if self.timeout_s <= 0:
            raise ConfigError("timeout must be positive")

    @property
    def begun_marker(self) -> str | None:
        """The words of a case's output that say its work under test had begun (classify flags a timeout after them,
        CAPTURING): None for an attention-layer case, whose process prints no such line."""
        return None

    @property
    def case_id(self) -> str:
        """Every parameter that changes what runs, so no two different cases share an id (or a log file); the
        attention config adds only what differs from AttnConfig's defaults, so the default matrix keeps its ids."""
        parts = [
            "stale_metadata",
            self.backend,
            self.scenario,
            self.strategy,
            self.sm.label,
            self.mode,
            f"splits{self.cfg.num_splits}",
            f"h{self.cfg.num_heads_q}-{self.cfg.num_heads_kv}x{self.cfg.head_dim}",
        ]
        parts += self.cfg.id_parts()
        if self.pair:
            parts.append(f"pair-{self.pair[0]}-{self.pair[1]}")
        if self.poison:
            parts.append(f"poison-{self.poison}")
        if self.seed:
            parts.append(f"seed{self.seed}")
        if self.backend_path:
            parts.append("build-" + hashlib.sha1(self.backend_path.encode()).hexdigest()[:8])
        if self.sanitizer:
            parts.append("memcheck")
        if self.rep:
            parts.append(f"rep{self.rep}")
        return "-".join(parts)

    def to_json(self) -> str:
        d = asdict(self)
        d["cfg"] = self.cfg.to_dict()
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> CaseSpec:
        d = json.loads(text)
        d["cfg"] = AttnConfig.from_dict(d["cfg"])
        d["sm"] = SmConfig(**d["sm"])
        if d.get("pair"):
            d["pair"] = tuple(d["pair"])
        return cls(**d)


# What happened to a case process beyond its verdict, as typed flags later steps decide by (CaseResult.flags), never by
# words of its reason: its Stall watch stopped it as hung; the GPU (an MPS server recovering) refused its process, so
# it never ran; it ran again alone under an MPS daemon of its own after a shared run it could not trust; it was stopped
# at its timeout after its output showed the captures begun (the vLLM gate: its stall rule's marker); its GPU computes
# matrix products wrong in its SM configuration, so nothing computed there can be judged (the vLLM gate's platform
# check, or a case not run after another's in the same configuration failed it); the reference it was judged against
# (or, on a reference, itself) was not trusted by its validation (the vLLM gate's reference validation, carried to every
# case compared with it); its output reported a CUDA error (a runtime error, a device-side assert: classify reads it);
# it is a self control whose injection re-created no defect, so nothing it showed is evidence (the vLLM gate's
# stale-refresh form that changed no refreshed entry: gate.coverage.recreated_nothing, set by gate.judge.vouch).
STALLED, REFUSED, RERUN_ALONE, CAPTURING = "stalled", "refused", "rerun-alone", "capturing"
PLATFORM_FAILED, UNTRUSTED_REFERENCE, CUDA_ERROR = "platform-failed", "reference-untrusted", "cuda-error"
RECREATED_NOTHING = "recreated-nothing"
FLAGS = (STALLED, REFUSED, RERUN_ALONE, CAPTURING, PLATFORM_FAILED, UNTRUSTED_REFERENCE, CUDA_ERROR, RECREATED_NOTHING)


def positive_control(spec: CaseSpec) -> bool:
    """Must the case show the bug (stale metadata)? Known from the case alone (no CPU model, no expectation)."""
    return spec.strategy != FRESH


@dataclass
class CaseResult:
    case_id: str
    verdict: str
    reason: str
    kernel: str | None = None  # combine | main | prepare | other | None
    descriptor: str | None = None  # descriptor of the pass that faulted or went wrong
    stale_fields: dict[str, int] = field(default_factory=dict)  # differing entries per field, over all passes
    first_diffs: list[str] = field(default_factory=list)
    findings: list[dict] = field(default_factory=list)
    max_abs_err: float | None = None
    tolerance: float | None = None  # the bound max_abs_err was held to (repro.attention.reference.tolerance)
    sms_reported: int | None = None
    sms_planned: int | None = None
    wall_s: float = 0.0
    returncode: int | None = None
    backend_identity: dict | None = None
    gpu_uuid: str | None = None  # the GPU the case process ran on, read inside it
    vllm_version: str | None = None  # the vLLM build under test (gate cases only)
    evidence: str | None = None  # what the verdict rests on (fault, memcheck finding, audit, token comparison)
    expected: str | None = None  # the control's expectation (repro.judge.policy), fixed before the case was judged
    phases: dict | None = None  # seconds per phase of the case process: start, import, cuda_init, work, teardown
    started_at: float | None = None  # when its process was started or handed the case (epoch s): a run's timeline
    spec: dict | None = None
    log_tail: str = ""
    history: list[dict] = field(default_factory=list)  # the later steps that made this record from earlier ones
    flags: list[str] = field(default_factory=list)  # of FLAGS: what happened to its process, decided on by later steps
    not_applicable: str | None = None  # why the case cannot exist on this runner (a skip, never clean), else None

    def revised(self, step: str, why: str, **changes) -> CaseResult:
        """A new record from a later step (the vLLM gate's reference comparison, attribution rerun, coverage check),
        saying what changed and why; this one is left as it was (classify builds the first record, once)."""
        new = replace(self, **changes, history=list(self.history))
        changed = {k: [getattr(self, k), v] for k, v in changes.items() if getattr(self, k) != v}
        if changed:
            new.history.append({"step": step, "why": why, "changed": changed})
        return new

    @property
    def first_verdict(self) -> str:
        """The verdict classify gave the case's process, before any later step revised it: the first verdict its
        history's changes record (typed data, never a step's name), else its verdict now."""
        return next(
            (h["changed"]["verdict"][0] for h in self.history if "verdict" in h.get("changed", {})), self.verdict
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def skipped(cls, spec: CaseSpec, reason: str) -> CaseResult:
        """A case this machine cannot run: carries its spec like every other result (reports reload it)."""
        return cls(spec.case_id, SKIP, reason, spec=json.loads(spec.to_json()))

    @property
    def detected(self) -> bool:
        return self.verdict in FAULTS
