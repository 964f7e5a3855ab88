"""The harness inside vLLM, as a general plugin (entry point group `vllm.general_plugins`). vLLM loads it in every
process it starts; each feature is off unless the request asks for it. In a gate case the request is the case's
PluginRequest (repro.contract.request: the one variable REPRO_REQUEST, which the processes vLLM starts inherit). In
a person's own vLLM run: REPRO_AUDIT=1 alone asks for the probe and the auditor, nothing else (REPRO_AUDIT_FILE=PATH
for its whole report, REPRO_ATTENTION_BACKEND=NAME for another backend; `repro audit` adds REPRO_AUDIT_STARTED, a
folder for each process's start mark, and REPRO_AUDIT_STRICT=1, the first stale capture ends the run: the plugin's
only variables of its own, counters.STARTED_ENV, STRICT_ENV); any
other feature (sm_margin, poison, inject, weights) is asked for by a request of the plugin alone in REPRO_REQUEST,
which `python -m repro plugin-request ...` prints (from_environment). The request's fields:

- attention_backend=NAME  the attention backend the probe and the auditor hook, named as vLLM names it
                          (FLASH_ATTN for REPRO_AUDIT=1 without REPRO_ATTENTION_BACKEND; TRITON_ATTN, FLASHINFER,
                          or any backend vLLM's registry knows: see repro.vllm_integration.plugin.backend_fields). Set it to the backend the engine is asked to use
                          (LLM(attention_backend=NAME)): the hooks go on that backend's classes only, and a backend
                          whose classes are not found is an error line, never a silent clean run.
- probe                   coverage counters (every gate case but the references): the backend impl's forward calls
                          (per backend) and, for FLASH_ATTN, the FA version of the impl that made them, and every CUDA graph capture (torch.cuda.graph)
                          with its graph kind (target decode, target mixed, draft prefill, draft decode, read from the
                          vLLM objects on the capture's call stack; "unknown kind" when none says) and whether an
                          attention forward ran inside it (a FULL graph). The model runner class seen capturing.
- audit                   freshness auditor (implies the probe): wraps the backend's <X>MetadataBuilder.build and
                          build_for_cudagraph_capture (record what every tensor of each build's metadata shows, by the
                          backend's field table) and <X>Impl.forward (before every eager forward, check they still
                          show it); at the end of every capture, the metadata its attention forwards used is checked
                          too (what the graph baked in). Nothing is copied to the host while a graph is captured.
                          Where the builder has update_draft_decode_metadata (vLLM 0.28 on: the fused draft loop
                          refreshes the draft-decode metadata in place, inside the captured graph), every refresh is
                          judged (plugin.refresh): what it computed against what the builder gives for the draft
                          step its views show (stale-refresh), right after an eager one (then the metadata's new
                          reference), at the capture's end for one inside a capture. At every FULL
                          capture pass (warmup forward, capture end) the descriptor check too: the metadata in use
                          against what the builder gives for the descriptor being captured (stale-descriptor;
                          plugin.audit.descriptor_mismatches). Findings go to stderr as `REPRO_AUDIT <json>` lines
                          and, at exit (atexit, and multiprocessing's finalizers for a forked engine core:
                          counters.at_exit), to audit_file: one report that every process of the run (its token,
                          REPRO_AUDIT_RUN, inherited) merges its own into (vLLM's multi-process engine: a front-end
                          that checks nothing, an engine core that runs the model), whichever exits first;
                          `processes` lists each (pid, name, checks, stale views), the totals are their sums, an
                          earlier run's report in the file is replaced (audit_file.merged_report). While the
                          process runs its report is kept there as a snapshot (`final` false: at a FULL
                          capture's end while nothing was found, at once at the first stale finding, else at
                          most every 2 s;
                          counters.keep_snapshot), which the exit report replaces: a process killed by SIGKILL
                          leaves what it checked.
- judge_refresh, check_replay  with audit, both on unless the request turns them off (`plugin-request
                          --no-refresh-judging`, `--no-replay-check`; the gate: REPRO_CHECKS_OFF=refresh,replay):
                          the refresh judged (above), and the replay check (plugin.replay: at sampled replays of
                          the draft's FULL graphs, the buffers they read against the runtime's build for that graph;
                          where torch has the global replay hook). Off, the counters say so (refresh_judging,
                          replay_check) and every refreshed field is counted unjudged.
- sm_margin=N             FA3 plans and launches for N fewer SMs: sm_margin passed to vLLM's get_scheduler_metadata
                          and to every torch.ops._vllm_fa3_C.fwd call (vLLM itself always passes 0). Counted per call.
- poison=<fill>           the entries FA3's get_scheduler_metadata never writes are filled (repro.case.poison) before vLLM
                          copies them into its persistent buffer, so a stale read does not depend on leftover memory.
                          The entries poisoned are counted.
- inject=stale-capture    the self control: the defect of vLLM 0.21.0-0.25.1 re-created inside this build (the
                          draft's FULL captures run on buffers holding the target's last capture build;
                          repro.vllm_integration.plugin.inject). Counted per capture kind (captures_injected).
  inject=stale-descriptor  its second form: every draft FULL pass gets the metadata of another descriptor of
                          the same capture list, object and buffers one consistent build (StaleDescriptorInjector):
                          only the auditor's descriptor check can see it. inject_source: whose capture
                          contents (first, last).
  inject=stale-refresh    its third form, asked for by a request (not a gate default): every draft-decode refresh
                          computes for a step FAR tokens ahead (plugin.refresh.StaleRefreshInjector): only the
                          refresh judged sees it.
  inject=stale-k          its fourth, the gate's for its dynamic-K methods: each K-specialized draft FULL pass
                          gets another K's metadata of the same batch shape (plugin.dynamic_k): only the
                          descriptor check keyed by K sees it.
- weights=agree           after vLLM's DummyModelLoader, the gate's constructed weights (repro.vllm_integration.
                          weights): a target decided by a wide margin at every token and an EAGLE draft that agrees
                          with it. `margin`: every parameter redrawn from a per-name seed (near ties, no acceptance).
                          vLLM's own dummy weights (uniform +-1e-3) give near-tied logits that flip with the SM count.

Each feature that installed is announced as a `REPRO_PLUGIN {"installed": ...}` line, and only then; a hook that
could not be installed is a `REPRO_PLUGIN {"error": ...}` line (the gate turns either into the case's verdict). The
counters (COUNTERS) are printed at exit as `REPRO_COUNTERS <json>`; the gate process prints them with the engine's
configuration after generate (repro.vllm_integration.gate.worker). With the probe on, the counters also name the
speculative-decoding layout of the vLLM that loaded the plugin (`spec_layout`, read from its files, as the source
check reads them too) and whether the auditor knows it (`spec_layout_known`: a layout the recorded wheels show,
KNOWN_SPEC_LAYOUTS); a gate must not vouch for a run whose layout it does not know. Written
against the names in vllm/v1/attention/backends/ (backend_fields); anything not found is reported, never guessed.

Where each part lives: this module reads the request (from_environment, requested) and installs what it asks for
(register); the hooks on the attention backend's classes are repro.vllm_integration.plugin.backend_hooks, the capture tracker
repro.vllm_integration.plugin.capture, the FA3 hooks repro.vllm_integration.plugin.fa3_hooks, the counters and the auditor's
report repro.vllm_integration.plugin.counters (one object each, shared by all of them)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

from repro.case.poison import parse_poison
from repro.contract import request
from repro.contract.channel import emit
from repro.contract.request import PluginRequest
from repro.contract.tags import PLUGIN_TAG
from repro.errors import ConfigError
from repro.vllm_integration.plugin import capture, counters
from repro.vllm_integration.plugin import weights_dflash as dflash_weights
from repro.vllm_integration.plugin.backend_fields import DEFAULT_BACKEND, backend_for
from repro.vllm_integration.plugin.backend_hooks import install, install_inject, install_probe
from repro.vllm_integration.plugin.fa3_hooks import install_fa3_hooks
from repro.vllm_integration.plugin.inject import ALL_INJECTIONS, SOURCES
from repro.vllm_integration.plugin.weights import DUMMY, WEIGHTS
from repro.vllm_integration.plugin.weights import install as install_weights

# the plugin's own variables, for a person's vLLM run outside the gate (from_environment): the auditor alone
ENV, BACKEND_ENV = "REPRO_AUDIT", "REPRO_ATTENTION_BACKEND"
FILE_ENV, RUN_ENV = counters.FILE_ENV, counters.RUN_ENV
RUN_VARS = (counters.STARTED_ENV, counters.STRICT_ENV)  # `repro audit`'s, for every process of the command it runs
# the V2 speculative-decoding layouts the auditor was checked against (the recorded wheels 0.23.0-0.33.0,
# results/vllm-versions.json; a CPU test keeps the two equal): another layout cannot be vouched for
# eagle (0.20-0.22): its draft loop advances seq_lens inside the draft decode graph (audit.check's `advance`)
KNOWN_SPEC_LAYOUTS = ("eagle", "autoregressive", "target_dependent_ar")
V2_DIR = "vllm/v1/worker/gpu"  # vLLM's V2 model runner, in its source tree
SPEC_DIR = f"{V2_DIR}/spec_decode"


def spec_layout(root: Path) -> str | None:
    """The V2 speculative-decoding layout of the vLLM source tree at root (the folder holding vllm/), from its
    folders alone (the plugin's report and the source check both read it); None when it has none of them."""
    spec = root / SPEC_DIR
    for name in ("target_dependent_ar", "autoregressive", "eagle"):
        if (spec / name).is_dir():
            return name
    if (spec / "eagle_cudagraph.py").exists() or (spec / "eagle.py").exists():
        return "eagle-module"
    return None


def spec_layout_of(vllm_root: str | os.PathLike | None) -> tuple[str | None, bool]:
    """(the V2 speculative-decoding layout of the vLLM installed at vllm_root, the folder holding vllm/; whether the
    auditor knows it). Read from the files, never imported (spec_layout)."""
    layout = spec_layout(Path(vllm_root)) if vllm_root is not None else None
    return layout, layout in KNOWN_SPEC_LAYOUTS


def _installed_vllm_root() -> str | None:
    """The folder holding the vllm package that loaded the plugin (None when it has no files: a stand-in)."""
    vllm = sys.modules.get("vllm")
    paths = list(getattr(vllm, "__path__", None) or [])
    return os.path.dirname(paths[0]) if paths else None


def from_environment(environ: dict[str, str] | None = None) -> PluginRequest | None:
    """What this process's plugin is asked for: the request in repro.contract.request.ENV (a gate case's, or a
    person's of the plugin alone; validated whole), else the auditor alone when a person set REPRO_AUDIT=1 (with
    REPRO_AUDIT_FILE and REPRO_ATTENTION_BACKEND), else None (nothing to install)."""
    env = os.environ if environ is None else environ
    asked = request.plugin_of(env)
    if asked is not None:
        return asked
    if env.get(ENV) != "1":
        return None
    return PluginRequest(
        attention_backend=env.get(BACKEND_ENV) or DEFAULT_BACKEND,
        probe=True,
        audit=True,
        audit_file=env.get(FILE_ENV) or None,
        sm_margin=0,
        poison=None,
        inject=None,
        inject_source=SOURCES[0],
        weights=DUMMY,
        judge_refresh=True,
        check_replay=True,
    )


CHECKS = ("refresh", "replay")  # the auditor's checks a person may turn off (checks_on)


def checks_on(off: str | None) -> tuple[bool, bool]:
    """(judge_refresh, check_replay) of a request, from a comma-separated list of the checks to turn off (CHECKS;
    None or empty: both on). ValueError for a name it does not know."""
    names = {n.strip() for n in (off or "").split(",") if n.strip()}
    if unknown := sorted(names - set(CHECKS)):
        raise ValueError(f"{unknown[0]!r}: the checks that can be turned off are {', '.join(CHECKS)}")
    return "refresh" not in names, "replay" not in names


def checks_of(environ: dict[str, str], var: str) -> dict[str, bool]:
    """The request's judge_refresh and check_replay from the gate's environment (its variable `var` names the checks
    turned off, checks_on); a name it does not know is a ConfigError naming the variable."""
    try:
        judge_refresh, check_replay = checks_on(environ.get(var))
    except ValueError as e:
        raise ConfigError(f"{var}: {e}") from None
    return {"judge_refresh": judge_refresh, "check_replay": check_replay}


def requested(want: PluginRequest | None) -> dict[str, Any]:
    """The features a request asks for, their values checked (a bad one raises ValueError naming its key)."""
    if want is None:
        return {"audit": False, "probe": False, "sm_margin": 0, "poison": None, "weights": None, "inject": None}
    out: dict[str, Any] = {"audit": want.audit, "probe": want.audit or want.probe, "audit_file": want.audit_file}
    out["judge_refresh"], out["check_replay"] = want.judge_refresh, want.check_replay
    if want.sm_margin < 0:
        raise ValueError(f"sm_margin={want.sm_margin}: must not be negative")
    out["sm_margin"] = want.sm_margin
    out["poison"] = parse_poison(want.poison)
    if want.weights not in (*WEIGHTS, DUMMY):
        raise ValueError(f"weights={want.weights!r}: expected {', '.join(WEIGHTS)} or {DUMMY}")
    out["weights"] = None if want.weights == DUMMY else want.weights
    if want.inject_source not in SOURCES:
        raise ValueError(f"inject_source={want.inject_source!r}: expected {' or '.join(SOURCES)}")
    out["inject_source"] = want.inject_source
    backend = want.attention_backend
    if not backend.replace("_", "").isalnum() or backend.upper() != backend:
        raise ValueError(f"attention_backend={backend!r}: expected a vLLM attention backend name such as FLASH_ATTN")
    out["attention_backend"] = backend
    if want.inject is not None and want.inject not in ALL_INJECTIONS:
        raise ValueError(f"inject={want.inject!r}: expected {' or '.join(ALL_INJECTIONS)}")
    out["inject"] = want.inject
    return out


def install_report(audit_file: str | None) -> None:
    """Once the auditor installed: its report at this process's exit (into audit_file, merged), its start mark in
    STARTED_ENV's folder (`repro audit`), and whether the first stale capture stops the run (STRICT_ENV)."""
    counters.at_exit(counters.report_at_exit(audit_file))
    counters.mark_started(os.environ.get(counters.STARTED_ENV))
    capture._AUDIT_ON["strict"] = os.environ.get(counters.STRICT_ENV) == "1"


def register() -> None:
    """vLLM calls this in every process it starts (general plugins). A feature is announced as installed only when
    every hook it needs went in; otherwise its error line says what was missing."""
    try:
        want = requested(from_environment())
    except Exception as e:  # a bad request must be visible, not silently ignored
        emit(PLUGIN_TAG, {"error": str(e)})
        return
    if not (want["probe"] or want["sm_margin"] or want["poison"] or want["weights"] or want["inject"]):
        return
    installed = counters._installed  # the one set the install functions add to
    needs_backend = want["probe"] and "probe" not in installed or want["audit"] and "audit" not in installed
    if needs_backend or want["inject"] and "inject" not in installed:
        try:
            spec = backend_for(want["attention_backend"])
            backend = importlib.import_module(spec.module)
        except (ImportError, KeyError) as e:
            emit(PLUGIN_TAG, {"error": f"cannot import vLLM's attention backend {want['attention_backend']}: {e}"})
            return
        layout = spec_layout_of(_installed_vllm_root())
        counters.COUNTERS["spec_layout"], counters.COUNTERS["spec_layout_known"] = layout
        if want["probe"] and "probe" not in installed:
            if install_probe(backend, spec=spec):
                counters.at_exit(counters.AtExit(counters.write_counters))
                emit(PLUGIN_TAG, {"installed": "probe", "backend": spec.name})
        if want["audit"] and "audit" not in installed:
            if install(backend, spec=spec, judge_refresh=want["judge_refresh"], check_replay=want["check_replay"]):
                install_report(want["audit_file"])
                emit(PLUGIN_TAG, {"installed": "audit", "backend": spec.name})
        if want["inject"] and "inject" not in installed:
            if install_inject(backend, spec=spec, source=want["inject_source"], form=want["inject"]):
                emit(PLUGIN_TAG, {"installed": "inject", "injection": want["inject"], "backend": spec.name})
    if (want["sm_margin"] or want["poison"]) and "fa3" not in installed:
        import torch  # torch and vLLM only when a feature asks for them: the plugin loads in every vLLM process
        from vllm.v1.attention.backends import flash_attn  # vLLM only here, as torch above

        try:
            import vllm.vllm_flash_attn._vllm_fa3_C  # noqa: F401  registers torch.ops._vllm_fa3_C
        except ImportError as e:
            emit(PLUGIN_TAG, {"error": f"vLLM's FA3 library does not import: {e}"})
            return
        done = install_fa3_hooks(flash_attn, torch.ops._vllm_fa3_C, want["sm_margin"], want["poison"])
        expected = 1 + bool(want["sm_margin"])
        if len(done) == expected:
            installed.add("fa3")
            emit(PLUGIN_TAG, {"installed": "fa3", "hooks": done})
    if want["weights"] and "weights" not in installed:
        from vllm.model_executor.model_loader import dummy_loader  # vLLM only when the request's weights ask for it

        loader = getattr(dummy_loader, "DummyModelLoader", None)
        if loader is None or not callable(getattr(loader, "load_weights", None)):
            emit(PLUGIN_TAG, {"error": f"{dummy_loader.__name__}: DummyModelLoader.load_weights not found"})
            return
        install_weights(loader, want["weights"], lambda record: emit(PLUGIN_TAG, record), dflash_weights.BY_MODEL)
        installed.add("weights")
        emit(PLUGIN_TAG, {"installed": "weights", "weights": want["weights"]})
