"""A vLLM gate case's detection mode (GateMode, `--modes`) and its attention backend (`--backends`), each a case
parameter parsed and checked here once; the case itself: repro.vllm_integration.gate.case.

Detection modes (`--modes`, each a case parameter):
  audit            the freshness auditor, loaded by vLLM through the plugin's entry point, full GPU
  plain            nothing added; a crash is rerun once with CUDA_LAUNCH_BLOCKING=1 to name the kernel (a self
                   control's only with --name-control-kernels: GateCase.name_kernel)
  mps:N            an MPS daemon owned by the run gives the case N SMs (the process must report N)
  sm_margin:N      the plugin passes sm_margin = SMs - N to vLLM's get_scheduler_metadata and FA3 forward
  poison:FILL      the plugin fills the scheduler-metadata entries FA3 never writes (repro.case.poison names)
  memcheck         compute-sanitizer memcheck, caching allocator (works with torch.compile); recorded, not gating
  memcheck:async   the same with cudaMallocAsync (what the attention-layer cases use); recorded, not gating
  memcheck:own     memcheck with an allocator of its own (repro.run.own_alloc: one cudaMalloc per tensor, graphs'
                   memory kept, a guard after each): an over-read past a tensor is a finding; gating
  memcheck:own+poison:FILL  the same with the entries FA3 never writes poisoned: a read of one memcheck names
"""

from __future__ import annotations

from dataclasses import dataclass, field

from repro.case.poison import parse_poison
from repro.case.spec import SmConfig
from repro.errors import ConfigError
from repro.judge.control import GatingMode
from repro.vllm_integration.plugin.backend_fields import BACKENDS, known_name

DEFAULT_MODES = ("audit", "plain")
ALL_MODES = ("audit", "plain", "mps:16", "sm_margin:16", "poison:int-max", "memcheck")


@dataclass(frozen=True)
class GateMode:
    name: str
    audit: bool = False
    sm: SmConfig = field(default_factory=SmConfig)
    poison: str | None = None
    sanitizer: str | None = None  # None, "caching", "async" or "own"

    @property
    def gating(self) -> bool:
        """memcheck with torch's allocators is recorded, not gating: on real vLLM it misses the fault (see results/);
        with its own allocator (memcheck:own) it gates."""
        return self.sanitizer in (None, "own")

    @property
    def hooks_fa3(self) -> bool:
        """Does the mode hook FA3's own calls (an SM margin passed to them, their never-written entries poisoned), so
        that it means nothing with another attention backend? Alone or inside another mode (`audit+sm_margin:N`)."""
        return self.sm.kind == "sm_margin" or self.poison is not None

    @property
    def policy_mode(self) -> GatingMode:
        """The mode as the control policy counts its evidence (repro.judge.control.GatingMode): its name, and the
        auditor's stale-audit as the engine's own wherever the auditor runs (`audit`, `audit+mps:16`, ...)."""
        return GatingMode(self.name, engine_audit=self.audit)

    @property
    def label(self) -> str:
        return self.name.replace("sm_margin:", "smmargin").replace(":", "-").replace("mps-", "mps").replace("+", "-")

    @classmethod
    def parse(cls, text: str) -> GateMode:
        text = text.strip()
        if text.startswith("audit+"):  # the auditor in an SM configuration: audit+sm_margin:N, audit+mps:N
            inner = cls.parse(text[len("audit+") :])
            if inner.sm.kind not in ("sm_margin", "mps") or inner.poison or inner.sanitizer or inner.audit:
                raise ConfigError(f"gate mode {text!r}: audit+ takes an SM configuration (sm_margin:N or mps:N)")
            return cls(f"audit+{inner.name}", audit=True, sm=inner.sm)
        # memcheck's own allocator over the poisoned entries: memcheck:own+poison:FILL
        if text.startswith("memcheck:own+"):
            inner = cls.parse(text[len("memcheck:own+") :])
            if not inner.poison or inner.sm.kind != "full" or inner.sanitizer or inner.audit:
                raise ConfigError(f"gate mode {text!r}: memcheck:own+ takes a poison (memcheck:own+poison:FILL)")
            return cls(f"memcheck:own+{inner.name}", poison=inner.poison, sanitizer="own")
        kind, _, arg = text.partition(":")
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
        if kind == "memcheck" and arg in ("", "caching", "async", "own"):
            return cls("memcheck" + (f":{arg}" if arg in ("async", "own") else ""), sanitizer=arg or "caching")
        raise ConfigError(
            f"unknown gate mode {text!r}: use audit, plain, mps:N, sm_margin:N, audit+mps:N, audit+sm_margin:N, "
            f"poison:FILL, memcheck, memcheck:async, memcheck:own, memcheck:own+poison:FILL, or a preset ({', '.join(PRESETS)})"
        )


PLAIN = GateMode("plain")  # nothing added: the mode whose crash an attribution rerun names the kernel of


# The hidden-configuration sweep: the full GPU and five SM counts of each restriction, audit and plain in each; a fixed
# build (0.26.0) must give no false alarm in any, a known-bad one (0.25.1) no miss.
SWEEP_SMS = (8, 16, 24, 40, 66)
PRESETS = {
    "hidden-sweep": ("audit", "plain")
    + tuple(f"{a}{kind}:{n}" for kind in ("sm_margin", "mps") for n in SWEEP_SMS for a in ("audit+", "")),
}


def parse_modes(text: str) -> tuple[GateMode, ...]:
    """--modes: names (GateMode.parse) and presets (PRESETS), comma-separated, each mode at most once."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    modes = tuple(GateMode.parse(m) for x in items for m in PRESETS.get(x, (x,)))
    if not modes:
        raise ConfigError("no gate modes given")
    _refuse_twice("--modes", [m.name for m in modes])
    return modes


def _refuse_twice(flag: str, names: list[str]) -> None:
    """One case id per value: a value given twice (as `matrix` refuses it) would list and run one case twice."""
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ConfigError(f"{flag}: {', '.join(dups)} given twice (one case id each; use --repeat to run again)")


def parse_backends(text: str) -> tuple[str, ...]:
    """--backends FLASH_ATTN,TRITON_ATTN,...: vLLM attention backend names (as vLLM spells them), each a case
    parameter like the modes."""
    names = tuple(x.strip().upper() for x in text.split(",") if x.strip())
    if not names:
        raise ConfigError("no attention backend given")
    _refuse_twice("--backends", list(names))
    bad = [n for n in names if not known_name(n)]
    if bad:
        raise ConfigError(
            f"--backends: {bad[0]!r} is neither a backend the auditor has a table for ({', '.join(BACKENDS)}) nor "
            "named as vLLM names its backends (*_ATTN, *_ATTENTION, *_MLA: repro/vllm_integration/plugin/backend_fields.py)"
        )
    return names
