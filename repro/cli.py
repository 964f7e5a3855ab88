"""`python -m repro doctor | run | matrix`. Bad input: one line on stderr and exit code 2, no traceback."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from repro.case import CaseSpec, SmConfig
from repro.descriptors import AttnConfig, ConfigError
from repro.redact import redact
from repro.scenarios import SCENARIOS, STRATEGIES, V2

DEFAULT_POISON = "int-max"
DEFAULT_SMS = "sm_margin:16,mps:16,full"
DEFAULT_MODES = "eager,graph"

EXIT_BAD_INPUT = 2
EXIT_NOT_RUN = 4  # the case could not run on this machine (no GPU, no MPS...): neither clean nor affected


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        sys.stderr.write(f"repro: error: {message}\n")
        raise SystemExit(EXIT_BAD_INPUT)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise ConfigError(f"expected comma-separated integers, got {text!r}") from None


def _items(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def _backends(text: str) -> tuple[str, ...]:
    from repro.backends import BACKENDS

    names = _items(text)
    for b in names:
        if b not in BACKENDS:
            raise ConfigError(f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
    return names


def _poison(a: argparse.Namespace) -> str | None:
    return None if a.poison in (None, "none") else a.poison


def _add_cfg(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("attention shape")
    d = AttnConfig()
    g.add_argument("--q-heads", type=int, default=d.num_heads_q, help="query heads (default %(default)s)")
    g.add_argument("--kv-heads", type=int, default=d.num_heads_kv, help="key/value heads (default %(default)s)")
    g.add_argument("--head-dim", type=int, default=d.head_dim, help="head dimension (default %(default)s)")
    g.add_argument("--page-size", type=int, default=d.page_size, help="KV cache page size (default %(default)s)")
    g.add_argument("--max-model-len", type=int, default=d.max_model_len, help="(default %(default)s)")
    g.add_argument("--spec-tokens", type=int, default=d.num_speculative_tokens, help="(default %(default)s)")
    g.add_argument(
        "--capture-sizes",
        default=",".join(map(str, d.capture_sizes)),
        help="CUDA-graph capture sizes (default %(default)s)",
    )
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="(default %(default)s)")
    g.add_argument("--window", type=int, default=-1, help="sliding window (left); -1 = none (default)")
    g.add_argument("--non-causal", action="store_true", help="non-causal attention (default: causal)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per case process (default %(default)s)")
    p.add_argument(
        "--poison",
        default=DEFAULT_POISON,
        help="fill of the entries FA3 never writes: none, zero, minus-one, int-max, int-min, splits-33 or an int32 "
        "(default %(default)s: the fill that made stale faults repeatable on the H200)",
    )
    p.add_argument("--sanitizer", action="store_true", help="run under compute-sanitizer memcheck (default off)")
    p.add_argument("--out", help="folder for logs and reports (default: a new folder under the system temp folder)")


def _cfg(a: argparse.Namespace, splits: int) -> AttnConfig:
    return AttnConfig(
        num_heads_q=a.q_heads,
        num_heads_kv=a.kv_heads,
        head_dim=a.head_dim,
        page_size=a.page_size,
        max_model_len=a.max_model_len,
        causal=not a.non_causal,
        window_left=a.window,
        num_splits=splits,
        num_speculative_tokens=a.spec_tokens,
        capture_sizes=_ints(a.capture_sizes),
        max_num_seqs=a.max_num_seqs,
    )


def _check_paths(backend_path: str | None) -> None:
    if backend_path and not os.path.exists(backend_path):
        raise ConfigError(f"{backend_path}: no such file or folder")


def _out_dir(path: str | None, kind: str) -> Path:
    """The folder a command writes into: the one asked for (created), or a new one under the temp folder."""
    import tempfile

    if path is None:
        return Path(tempfile.mkdtemp(prefix=f"repro-{kind}-"))
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {path}: exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {path}: cannot create it ({e.strerror or e})") from None
    return out


def _check_out_file(path: str | None, flag: str = "--json") -> None:
    """Fail before any work when a report file cannot be written; leaves nothing behind."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path}: is a folder; give a file name")
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write it ({e.strerror or e})") from None
    if not existed:
        p.unlink()


def _poison_arg(text: str | None) -> str | None:
    """`none` and no poison mean the same case (no suffix in its id)."""
    from repro.poison import parse_poison

    p = parse_poison(text)
    return p.name if p else None


def cmd_run(a: argparse.Namespace) -> int:
    from repro.descriptors import descriptor_from_label
    from repro.runner import run_case
    from repro.smcontrol import Unavailable, maybe_mps

    _check_paths(a.backend_path)
    _check_out_file(a.json)
    sm = SmConfig.parse(a.sm)
    cfg = _cfg(a, a.num_splits)
    pair = (a.built_for, a.launched) if a.scenario == "pair" else None
    for label in pair or ():
        d = descriptor_from_label(label, cfg.decode_query_len)
        if d.num_reqs > cfg.max_batch:
            raise ConfigError(f"descriptor {label} has {d.num_reqs} requests, over the max batch {cfg.max_batch}")
    if sm.sms and _gpu_present():
        from repro.runner import device_sm_count

        if sm.sms > device_sm_count():
            raise ConfigError(f"impossible SM count {sm.sms}: this GPU has {device_sm_count()}")
    spec = CaseSpec(
        a.backend,
        a.strategy,
        a.mode,
        a.scenario,
        sm,
        cfg,
        _poison_arg(a.poison),
        a.sanitizer,
        pair,
        a.backend_path,
        a.timeout,
    )
    if not _gpu_present():
        print(
            f"skip: no CUDA GPU here, {spec.case_id} cannot run. For the CPU model's prediction of such cases: "
            "python -m repro matrix --model",
            file=sys.stderr,
        )
        return EXIT_NOT_RUN
    out = _out_dir(a.out, "run")
    try:
        with maybe_mps(sm.kind == "mps") as mps:
            res = run_case(spec, out, mps)
    except Unavailable as e:
        print(f"skip: {e}", file=sys.stderr)
        return EXIT_NOT_RUN
    print(f"logs: {out}")
    print(f"{res.verdict}: {res.case_id}\n  {res.reason}")
    if res.kernel:
        print(f"  kernel: {res.kernel}")
    if res.stale_fields:
        print(f"  stale fields: {res.stale_fields}")
    for d in res.first_diffs:
        print(f"  {d}")
    if a.json:
        Path(a.json).write_text(json.dumps(res.to_dict(), indent=1) + "\n")
    if res.verdict == "skip":
        return EXIT_NOT_RUN
    return 0 if res.verdict == "clean" else 1


def _gpu_present() -> bool:
    from repro.runner import device_sm_count
    from repro.smcontrol import Unavailable

    try:
        device_sm_count()
    except (Unavailable, OSError, subprocess.SubprocessError, ValueError):
        return False
    return True


def cmd_agree(a: argparse.Namespace) -> int:
    from repro.fa3_model.agreement import compare, markdown
    from repro.report import MODEL, load_json

    for p in a.results:
        _check_paths(p)
    _check_out_file(a.out, "--out")
    runs = {p: load_json(p) for p in a.results}  # one line, exit 2, for anything that is not a results.json
    measured = [p for p, run in runs.items() if run.source != MODEL]
    for p in a.results:
        if p not in measured:
            print(f"note: {p} holds CPU-model predictions, not GPU verdicts: left out", file=sys.stderr)
    if not measured:
        raise ConfigError("no GPU run to compare with: give results.json files of GPU runs (e.g. results/h200-*/)")
    rows = compare(measured)
    md = markdown(rows, measured)
    if a.out:
        Path(a.out).write_text(redact(md))
    print(md)
    return 0 if all(r.verdict_agrees for r in rows) else 1


def _model_specs(a: argparse.Namespace, opts, specs: list[CaseSpec]) -> list[CaseSpec]:
    """The cases the CPU model predicts, or ConfigError naming the flag it cannot honour."""
    from dataclasses import replace

    from repro.fa3_model.predict import H200_SMS, model_sms
    from repro.matrix import build_specs

    if opts.scenario != V2:
        raise ConfigError(f"the CPU model predicts --scenario {V2} only; run --scenario {opts.scenario} on a GPU")
    if a.modes is not None and "graph" in opts.modes:
        raise ConfigError("the CPU model predicts the eager warmups only: use --modes eager, or run graph on a GPU")
    if opts.repeat > 1:
        raise ConfigError("the CPU model is deterministic: --repeat needs a GPU")
    if a.sms is None:  # the model's own SM list
        sms = _ints(a.model_sms)
        if not sms or min(sms) <= 0 or max(sms) > H200_SMS:
            raise ConfigError(f"model SM counts must be in 1..{H200_SMS}")
        labels = tuple("full" if n == H200_SMS else f"sm_margin:{n}" for n in sms)
        specs = build_specs(replace(opts, sms=labels))
    for s in specs:
        model_sms(s)
    return [s for s in specs if s.mode == "eager"]


def cmd_matrix(a: argparse.Namespace) -> int:
    from repro import environment, report
    from repro.matrix import MatrixOptions, MatrixRun, build_specs, run_matrix, text_progress

    if a.backend is not None and a.backend != "model":
        raise ConfigError(f"--backend takes only 'model' (use --backends for FA3 builds), got {a.backend!r}")
    if a.repeat < 1:
        raise ConfigError("--repeat must be at least 1")
    if a.jobs < 1:
        raise ConfigError("--jobs must be at least 1")
    opts = MatrixOptions(
        backends=_backends(a.backends),
        strategies=_items(a.strategies),
        sms=_items(a.sms if a.sms is not None else DEFAULT_SMS),
        modes=_items(a.modes if a.modes is not None else DEFAULT_MODES),
        splits=_ints(a.splits),
        poison=_poison_arg(a.poison),
        sanitizer=a.sanitizer,
        timeout_s=a.timeout,
        repeat=a.repeat,
        scenario=a.scenario or V2,
        cfg=_cfg(a, 32),
    )
    for st in opts.strategies:
        if st not in STRATEGIES:
            raise ConfigError(f"unknown strategy {st!r}; choose from {', '.join(STRATEGIES)}")
    specs = build_specs(opts)  # validates every axis, GPU or not
    model = a.model or a.backend == "model"
    if not model and not a.dry_run and not _gpu_present():
        if a.gpu_only:
            raise ConfigError("no CUDA GPU visible (--gpu-only)")
        model = True
        banner = "No GPU here: these are the CPU model's predictions for an H200 (use --gpu-only to refuse)."
    else:
        banner = "Backend: the CPU model."
    if model:
        specs = _model_specs(a, opts, specs)
    if a.dry_run:
        for s in specs:
            print(s.case_id)
        return 0
    _check_out_file(a.json)
    out = _out_dir(a.out, "matrix") if (a.out or not model) else None
    env = environment.collect()
    if model:
        import time

        from repro.fa3_model.predict import predict_specs

        t0 = time.time()
        run = MatrixRun(predict_specs(specs), round(time.time() - t0, 2), None, source=report.MODEL)
        title = f"{a.title} (predicted by the CPU model)"
    else:
        run = run_matrix(specs, out / "logs", jobs=a.jobs, progress=None if a.quiet else text_progress)
        title = a.title
    md = report.markdown(run, env, title=title)
    if out is not None:
        (out / "verdicts.md").write_text(md)
        report.write_json(run, out / "results.json", env)
        report.heatmap(run, out / "heatmap.png")
    if a.json:
        report.write_json(run, a.json, env)
    print((banner + "\n\n" if model else "") + md)
    if out is not None:
        print(f"reports: {out}")
    blind = run.blind_controls()
    if blind and not model:
        print(
            f"HARNESS BLIND: {len(blind)} positive control(s) not detected in this environment: "
            + ", ".join(s.case_id for s, _ in blind[:5]),
            file=sys.stderr,
        )
    if a.gate and not model:
        why = report.gate_failures(run)
        if why:
            print(f"GATE FAILED: {why[0]}" + (f" (+{len(why) - 1} more)" if len(why) > 1 else ""), file=sys.stderr)
            return 1
    if a.gate and model:
        print("GATE FAILED: no GPU, so no kernel evidence: the CPU model cannot pass a gate", file=sys.stderr)
        return 1
    return 1 if run.failures() else 0


def cmd_doctor(a: argparse.Namespace) -> int:
    from repro.doctor import doctor

    print(doctor())
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from repro.benchmark import benchmark_markdown

    for path in (a.plain, a.memcheck):
        _check_paths(path)
    _check_out_file(a.out, "--out")
    md = benchmark_markdown(a.plain, a.memcheck)
    if a.out:
        Path(a.out).write_text(redact(md))
    print(md)
    return 0


def cmd_xdist(a: argparse.Namespace) -> int:
    from repro.xdist_report import check_junit, markdown

    _check_paths(a.junit)
    _check_out_file(a.out, "--out")
    rep = check_junit(a.junit, a.workers)
    md = markdown(rep, a.junit)
    if a.out:
        Path(a.out).write_text(redact(md))
    print(md)
    return 0 if rep.ok else 1


def cmd_bisect(a: argparse.Namespace) -> int:
    from repro.vllm_integration.bisect import run_bisect
    from repro.vllm_integration.source_check import check_tree

    _check_paths(a.vllm)
    if not os.path.isdir(os.path.join(a.vllm, ".git")):
        raise ConfigError(f"{a.vllm}: not a git checkout")
    if a.check == "gate" and not a.gate_cmd:
        raise ConfigError("--check gate needs a gate command after --")
    for flag, rev in (("--good", a.good), ("--bad", a.bad)):
        r = subprocess.run(
            ["git", "-C", a.vllm, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise ConfigError(f"{flag} {rev}: git knows no such commit in {a.vllm} (git rev-parse --verify failed)")
    if a.status:
        v = check_tree(a.vllm)
        print(f"{v.verdict}: {v.reason}" + (f" (layout {v.layout})" if v.layout else ""))
        return {"good": 0, "bad": 1}.get(v.verdict, 125)
    first, log = run_bisect(a.vllm, a.good, a.bad, a.check, [x for x in a.gate_cmd if x != "--"] or None, a.overlay)
    print(log[-4000:])
    if first:
        print(f"first bad commit: {first}")
        return 0
    print("bisect found no first bad commit: git's log is printed above", file=sys.stderr)
    return 1


def cmd_vllm_check(a: argparse.Namespace) -> int:
    from repro.vllm_integration.compat import check_source

    rows = []
    for path in a.sources:
        _check_paths(path)
    _check_out_file(a.json)
    for path in a.sources:
        c = check_source(path)
        rows.append(c.to_dict())
        print(f"{c.source}: {c.verdict} ({c.layout or '-'}): {c.reason}")
        print(f"  auditor hooks: {'ok' if c.plugin_ok else 'MISSING'}: {'; '.join(c.plugin_notes)}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    verdicts = {r["verdict"] for r in rows}
    return 1 if "bad" in verdicts else (125 if "untestable" in verdicts else 0)


def cmd_gate(a: argparse.Namespace) -> int:
    """Exit 0: every build under test clean and every control caught; 1: a build under test is affected (a fault, a
    hang, wrong tokens or stale views); 4: a build under test could not be vouched for (a case errored or skipped);
    3: HARNESS BLIND (a control missed, or none ran); 2: bad input. A bisect step maps 0 and 1 through, the rest to
    125 (untestable)."""
    from dataclasses import replace

    from repro.environment import collect
    from repro.vllm_integration import gate_report
    from repro.vllm_integration.builds import CONTROL, UNDER_TEST, find_builds, parse_builds
    from repro.vllm_integration.gate_run import EXIT, parse_modes, run_gate

    modes = parse_modes(a.modes)
    if a.repeat < 1 or a.jobs < 1 or a.timeout <= 0:
        raise ConfigError("--repeat and --jobs must be at least 1, --timeout positive")
    builds = find_builds(include_installed=not a.no_installed)
    builds += parse_builds(",".join(a.vllm), UNDER_TEST, "--vllm") + parse_builds(
        ",".join(a.control), CONTROL, "--control"
    )
    if a.installed_label:
        builds = [replace(b, label=a.installed_label) if b.prefix is None else b for b in builds]
    if not builds:
        raise ConfigError("no vLLM build to test: install vllm, or name builds with --vllm / --control LABEL=PREFIX")
    if a.dry_run:
        from repro.vllm_integration.gate_run import plan

        for c in plan(builds, modes, a.repeat, a.timeout):
            print(c.case_id)
        return 0
    out = _out_dir(a.out, "gate")

    def progress(c, r) -> None:
        print(f"[gate] {c.case_id}: {r.verdict} ({r.wall_s:.0f} s) {r.evidence or ''} {r.reason[:160]}", flush=True)

    run = run_gate(builds, modes, Path(a.logs) if a.logs else out / "logs", a.repeat, a.jobs, a.timeout, progress)
    written = gate_report.write(run, out, collect(), need_control=not a.no_control)
    print(gate_report.markdown(run, need_control=not a.no_control).split("\n| case |")[0])
    print(f"written: {', '.join(str(p) for p in written)}")
    return EXIT[run.outcome(need_control=not a.no_control)]


def cmd_redact(a: argparse.Namespace) -> int:
    from repro.redact import redact_tree

    for path in a.paths:
        _check_paths(path)
    changed = redact_tree(a.paths)
    print(f"redacted {len(changed)} file(s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m repro", description="Stale FA3 attention-metadata reproducer and regression harness")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    sub.add_parser("doctor", help="what this machine can run, and how to fix what is missing")
    r = sub.add_parser("run", help="run one case")
    r.add_argument("--backend", choices=("upstream", "vllm"), required=True)
    r.add_argument("--backend-path", help="upstream: folder with flash_attn_3/; vllm: path to _vllm_fa3_C*.so")
    r.add_argument("--strategy", choices=STRATEGIES, default="stale")
    r.add_argument("--mode", choices=("eager", "graph"), default="eager")
    r.add_argument("--scenario", choices=SCENARIOS, default=V2)
    r.add_argument("--sm", default="full", help="full, sm_margin:N, mps:N, green:N, mig[:uuid]")
    r.add_argument("--num-splits", type=int, default=32)
    r.add_argument("--built-for", default="t4r1", help="pair scenario: descriptor the buffers hold")
    r.add_argument("--launched", default="t32r8", help="pair scenario: descriptor launched")
    r.add_argument("--json", help="write the result here")
    _add_cfg(r)
    m = sub.add_parser("matrix", help="run the parametrized case set in parallel and write reports")
    m.add_argument("--backends", default="upstream,vllm", help="FA3 builds: upstream, vllm (default %(default)s)")
    m.add_argument("--strategies", default="stale,fresh", help="metadata strategies (default %(default)s)")
    m.add_argument(
        "--sms", help=f"SM restrictions: full, sm_margin:N, mps:N, green:N, mig[:uuid] (default {DEFAULT_SMS})"
    )
    m.add_argument(
        "--modes", help=f"eager (the draft's warmup), graph (captured and replayed) (default {DEFAULT_MODES})"
    )
    m.add_argument("--splits", default="32,0", help="FA3 num_splits values; 0 = FA3's heuristic (default %(default)s)")
    m.add_argument("--repeat", type=int, default=1, help="runs of every case, at least 1 (default %(default)s)")
    m.add_argument(
        "--scenario", choices=SCENARIOS, help=f"attention layer ({V2}, default), pair, or spec-decode (models)"
    )
    m.add_argument("--jobs", type=int, default=6, help="cases at a time, MPS cases aside (default %(default)s)")
    m.add_argument("--json", help="also write the machine-readable result here")
    m.add_argument("--title", default="Stale-metadata verdicts", help="report title (default %(default)r)")
    m.add_argument("--dry-run", action="store_true", help="list case ids only")
    m.add_argument("--quiet", action="store_true", help="no progress lines")
    m.add_argument("--model", action="store_true", help="predict with the CPU model instead of running kernels")
    m.add_argument("--backend", help="'model': the same as --model")
    m.add_argument(
        "--model-sms",
        default="16,26,32,60,132",
        help="SM counts the model predicts for without --sms (default %(default)s)",
    )
    m.add_argument("--gpu-only", action="store_true", help="fail instead of predicting when no GPU is present")
    m.add_argument(
        "--gate",
        action="store_true",
        help="strict: fail unless every control ran and every positive control showed kernel evidence",
    )
    _add_cfg(m)
    g = sub.add_parser("agree", help="the CPU model's verdicts against recorded GPU results (results.json ...)")
    g.add_argument("results", nargs="+")
    g.add_argument("--out", help="write the Markdown here")
    x = sub.add_parser("xdist-report", help="check from a JUnit XML that each xdist worker had a GPU of its own")
    x.add_argument("junit")
    x.add_argument("--workers", type=int, help="number of workers expected")
    x.add_argument("--out", help="write the Markdown here")
    bi = sub.add_parser("bisect", help="git bisect a vLLM checkout for the stale-metadata capture defect")
    bi.add_argument("--vllm", required=True, help="path of the vLLM git checkout")
    bi.add_argument("--good", default="HEAD~1")
    bi.add_argument("--bad", default="HEAD")
    bi.add_argument("--check", choices=("source", "gate"), default="source")
    bi.add_argument(
        "--overlay", help="installed vllm package folder: reuse its compiled extensions (Python-only changes)"
    )
    bi.add_argument("--status", action="store_true", help="only check the current commit (exit 0/1/125)")
    bi.add_argument("gate_cmd", nargs=argparse.REMAINDER, help="-- command for --check gate")
    vc = sub.add_parser(
        "vllm-check",
        help="source verdict and auditor hooks of vLLM checkouts or wheels (no import); exit 0 good, 1 bad, 125 untestable",
    )
    vc.add_argument("sources", nargs="+")
    vc.add_argument("--json")
    gt = sub.add_parser("gate", help="is this vLLM build affected? real vLLM, every detection mode, one table")
    gt.add_argument(
        "--modes",
        default="audit,plain",
        help="audit, plain, mps:N, sm_margin:N, poison:FILL, memcheck[:async] (default audit,plain)",
    )
    gt.add_argument("--vllm", action="append", default=[], help="LABEL=PREFIX: a build under test (also REPRO_VLLM)")
    gt.add_argument(
        "--control",
        action="append",
        default=[],
        help="LABEL=PREFIX: a known-bad build the gate must catch (also REPRO_VLLM_CONTROL)",
    )
    gt.add_argument("--no-installed", action="store_true", help="leave out the vllm this Python imports")
    gt.add_argument("--installed-label", help="case-id label of the installed vllm (default: its version)")
    gt.add_argument(
        "--no-control", action="store_true", help="answer for the builds alone (bisect steps): no control needed"
    )
    gt.add_argument("--repeat", type=int, default=1, help="repetitions of every case (default 1)")
    gt.add_argument("--jobs", type=int, default=3, help="cases at a time, MPS cases aside (default 3)")
    gt.add_argument("--timeout", type=float, default=300.0, help="seconds per case process (default 300)")
    gt.add_argument(
        "--out", default="gate-results", help="folder for verdicts.md, results.json, logs/ (default ./gate-results)"
    )
    gt.add_argument("--logs", help="folder for each case's output and logs (default OUT/logs)")
    gt.add_argument("--dry-run", action="store_true", help="list case ids only")
    rd = sub.add_parser("redact", help="replace machine paths in recorded results with <repo>/, <path>/ ...")
    rd.add_argument("paths", nargs="+")
    b = sub.add_parser("bench", help="benchmark numbers from a plain and a memcheck matrix run (results.json)")
    b.add_argument("plain")
    b.add_argument("memcheck")
    b.add_argument("--out", help="write the Markdown here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        return {
            "doctor": cmd_doctor,
            "run": cmd_run,
            "matrix": cmd_matrix,
            "bench": cmd_bench,
            "agree": cmd_agree,
            "xdist-report": cmd_xdist,
            "bisect": cmd_bisect,
            "vllm-check": cmd_vllm_check,
            "redact": cmd_redact,
            "gate": cmd_gate,
        }[a.cmd](a)
    except ConfigError as e:
        sys.stderr.write(f"repro: error: {e}\n")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        sys.stderr.write("repro: interrupted\n")
        return 130
    except BrokenPipeError:  # output piped into head & co.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
