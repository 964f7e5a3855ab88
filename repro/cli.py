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

EXIT_BAD_INPUT = 2


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
    g.add_argument("--q-heads", type=int, default=d.num_heads_q)
    g.add_argument("--kv-heads", type=int, default=d.num_heads_kv)
    g.add_argument("--head-dim", type=int, default=d.head_dim)
    g.add_argument("--page-size", type=int, default=d.page_size)
    g.add_argument("--max-model-len", type=int, default=d.max_model_len)
    g.add_argument("--spec-tokens", type=int, default=d.num_speculative_tokens)
    g.add_argument("--capture-sizes", default=",".join(map(str, d.capture_sizes)))
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--window", type=int, default=-1, help="sliding window (left); -1 = none")
    g.add_argument("--non-causal", action="store_true")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per case process")
    p.add_argument("--poison", default=None, help="none, zero, minus-one, int-max, int-min, splits-33 or an int32")
    p.add_argument("--sanitizer", action="store_true", help="run under compute-sanitizer memcheck")
    p.add_argument("--out", default="results/latest", help="folder for logs and reports")


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


def cmd_run(a: argparse.Namespace) -> int:
    from repro.descriptors import descriptor_from_label
    from repro.runner import run_case
    from repro.smcontrol import Unavailable, maybe_mps

    _check_paths(a.backend_path)
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
        a.poison,
        a.sanitizer,
        pair,
        a.backend_path,
        a.timeout,
    )
    try:
        with maybe_mps(sm.kind == "mps") as mps:
            res = run_case(spec, a.out, mps)
    except Unavailable as e:
        print(f"skip: {e}")
        return 0
    print(f"{res.verdict}: {res.case_id}\n  {res.reason}")
    if res.kernel:
        print(f"  kernel: {res.kernel}")
    if res.stale_fields:
        print(f"  stale fields: {res.stale_fields}")
    for d in res.first_diffs:
        print(f"  {d}")
    if a.json:
        Path(a.json).write_text(json.dumps(res.to_dict(), indent=1) + "\n")
    return 0 if res.verdict in ("clean", "skip") else 1


def _gpu_present() -> bool:
    from repro.runner import device_sm_count
    from repro.smcontrol import Unavailable

    try:
        device_sm_count()
    except (Unavailable, OSError, subprocess.SubprocessError, ValueError):
        return False
    return True


def cmd_model_matrix(a: argparse.Namespace, reason: str) -> int:
    from repro.fa3_model import predict

    poison = _poison(a)
    backends = _backends(a.backends)
    sms = _ints(a.model_sms)
    if not sms or min(sms) <= 0 or max(sms) > predict.H200_SMS:
        raise ConfigError(f"model SM counts must be in 1..{predict.H200_SMS}")
    cases, seconds = predict.predict_matrix(
        backends=backends, sms=sms, splits=_ints(a.splits), poison=poison, cfg=_cfg(a, 32)
    )
    md = f"{reason}\n\n" + predict.markdown(cases, seconds, poison)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "predicted.md").write_text(redact(md))
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                [{"case": c.case_id, "descriptor": c.descriptor, **c.prediction.to_dict()} for c in cases], indent=1
            )
            + "\n"
        )
    print(md)
    return 0


def cmd_agree(a: argparse.Namespace) -> int:
    from repro.fa3_model.agreement import compare, markdown

    for p in a.results:
        _check_paths(p)
    rows = compare(a.results)
    md = markdown(rows, a.results)
    if a.out:
        Path(a.out).write_text(redact(md))
    print(md)
    return 0 if all(r.verdict_agrees for r in rows) else 1


def cmd_matrix(a: argparse.Namespace) -> int:
    from repro import environment, report
    from repro.matrix import MatrixOptions, build_specs, run_matrix, text_progress

    if a.backend is not None and a.backend != "model":
        raise ConfigError(f"--backend takes only 'model' (use --backends for FA3 builds), got {a.backend!r}")
    if a.model or a.backend == "model":
        return cmd_model_matrix(a, "Backend: the CPU model.")
    if not a.dry_run and not _gpu_present():
        if a.gpu_only:
            raise ConfigError("no CUDA GPU visible (--gpu-only)")
        return cmd_model_matrix(
            a, "No GPU here: these are the CPU model's predictions for an H200 (use --gpu-only to refuse)."
        )

    opts = MatrixOptions(
        backends=_backends(a.backends),
        strategies=_items(a.strategies),
        sms=_items(a.sms),
        modes=_items(a.modes),
        splits=_ints(a.splits),
        poison=_poison(a),
        sanitizer=a.sanitizer,
        timeout_s=a.timeout,
        repeat=a.repeat,
        scenario=a.scenario,
        cfg=_cfg(a, 32),
    )
    for s in opts.strategies:
        if s not in STRATEGIES:
            raise ConfigError(f"unknown strategy {s!r}")
    specs = build_specs(opts)
    if a.dry_run:
        for s in specs:
            print(s.case_id)
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment.collect()
    run = run_matrix(specs, out / "logs", jobs=a.jobs, progress=None if a.quiet else text_progress)
    md = report.markdown(run, env, title=a.title)
    (out / "verdicts.md").write_text(md)
    report.write_json(run, a.json or out / "results.json", env)
    report.heatmap(run, out / "heatmap.png")
    print(md)
    blind = run.blind_controls()
    if blind:
        print(
            f"HARNESS BLIND: {len(blind)} positive control(s) not detected in this environment: "
            + ", ".join(s.case_id for s, _ in blind[:5]),
            file=sys.stderr,
        )
    return 1 if run.failures() else 0


def cmd_doctor(a: argparse.Namespace) -> int:
    from repro.doctor import doctor

    print(doctor())
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from repro.benchmark import benchmark_markdown

    for path in (a.plain, a.memcheck):
        _check_paths(path)
    md = benchmark_markdown(a.plain, a.memcheck)
    if a.out:
        Path(a.out).write_text(redact(md))
    print(md)
    return 0


def cmd_xdist(a: argparse.Namespace) -> int:
    from repro.xdist_report import check_junit, markdown

    _check_paths(a.junit)
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
    if a.status:
        v = check_tree(a.vllm)
        print(f"{v.verdict}: {v.reason}" + (f" (layout {v.layout})" if v.layout else ""))
        return {"good": 0, "bad": 1}.get(v.verdict, 125)
    first, log = run_bisect(a.vllm, a.good, a.bad, a.check, [x for x in a.gate_cmd if x != "--"] or None, a.overlay)
    print(log[-4000:])
    if first:
        print(f"first bad commit: {first}")
        return 0
    print("bisect found no first bad commit (see the log above)", file=sys.stderr)
    return 1


def cmd_vllm_check(a: argparse.Namespace) -> int:
    from repro.vllm_integration.compat import check_source

    rows = []
    for path in a.sources:
        _check_paths(path)
        c = check_source(path)
        rows.append(c.to_dict())
        print(f"{c.source}: {c.verdict} ({c.layout or '-'}): {c.reason}")
        print(f"  auditor hooks: {'ok' if c.plugin_ok else 'MISSING'}: {'; '.join(c.plugin_notes)}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


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
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder")

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
    m.add_argument("--backends", default="upstream,vllm")
    m.add_argument("--strategies", default="stale,fresh")
    m.add_argument("--sms", default="sm_margin:16,mps:16,full")
    m.add_argument("--modes", default="eager,graph")
    m.add_argument("--splits", default="32,0")
    m.add_argument("--repeat", type=int, default=1)
    m.add_argument(
        "--scenario", choices=SCENARIOS, default=V2, help="attention layer (v2-capture) or models (spec-decode)"
    )
    m.add_argument("--jobs", type=int, default=6)
    m.add_argument("--json", help="machine-readable result path (default OUT/results.json)")
    m.add_argument("--title", default="Stale-metadata verdicts")
    m.add_argument("--dry-run", action="store_true", help="list case ids only")
    m.add_argument("--quiet", action="store_true")
    m.add_argument("--model", action="store_true", help="predict with the CPU model instead of running kernels")
    m.add_argument("--backend", help="'model': the same as --model")
    m.add_argument("--model-sms", default="16,26,32,60,132", help="SM counts the model predicts for")
    m.add_argument("--gpu-only", action="store_true", help="fail instead of predicting when no GPU is present")
    _add_cfg(m)
    m.set_defaults(poison="int-max")
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
    vc = sub.add_parser("vllm-check", help="source verdict and auditor hooks of vLLM checkouts or wheels (no import)")
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
