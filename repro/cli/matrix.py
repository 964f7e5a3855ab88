"""`python -m repro matrix`: the parametrized case set on a GPU, or the CPU model's prediction of it."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import replace

from repro import exit_codes
from repro.case.matrix import DEFAULT_SMS, MatrixOptions, build_specs
from repro.case.scenarios import DEFAULT_PAIR, SCENARIOS, STRATEGIES, V2
from repro.case.spec import CaseSpec
from repro.cli.common import (
    DEFAULT_MODES,
    MAX_REPEAT,
    add_shape_args,
    check_file_and_folder,
    command_started_at,
    gpu_present,
    parse_backends,
    parse_ints,
    parse_items,
    poison_arg,
    repeats,
    shape_config,
    splits,
)
from repro.cli.outputs import check_file, check_folder, json_of, open_folder
from repro.errors import ConfigError
from repro.fa3_model.scope import H200_SMS
from repro.files import replacing, write_whole
from repro.judge.expectations import unmodelled
from repro.report import environment
from repro.report import results as report
from repro.report.benchmark import compare_executors
from repro.report.redact import redact
from repro.run.executor import DEFAULT_EXECUTOR, EXECUTORS
from repro.run.matrix import MatrixRun, attach_expectations, run_matrix, text_progress
from repro.run.mps_cases import DEFAULT_MPS_DAEMON, MPS_DAEMON_POLICIES
from repro.run.runner import default_executor, device_sm_count, make_executor
from repro.run.smcontrol import sm_refusal


def add_parsers(sub) -> None:
    m = sub.add_parser("matrix", help="run the parametrized case set in parallel and write reports")
    m.add_argument("--backends", default="upstream,vllm", help="FA3 builds: upstream, vllm (default %(default)s)")
    m.add_argument("--strategies", default="stale,fresh", help="metadata strategies (default %(default)s)")
    m.add_argument(
        "--sms",
        help=f"SM restrictions: full, sm_margin:N, mps:N, green:N, mig[:uuid] (default {','.join(DEFAULT_SMS)})",
    )
    m.add_argument(
        "--modes", help=f"eager (the draft's warmup), graph (captured and replayed) (default {DEFAULT_MODES})"
    )
    m.add_argument("--splits", default="32,0", help="FA3 num_splits values; 0 = FA3's heuristic (default %(default)s)")
    m.add_argument(
        "--repeat", type=repeats, default=1, help=f"runs of every case, 1 to {MAX_REPEAT} (default %(default)s)"
    )
    m.add_argument(
        "--scenario", choices=SCENARIOS, help=f"attention layer ({V2}, default), pair, or spec-decode (models)"
    )
    m.add_argument(
        "--built-for",
        help=f"--scenario pair: the descriptor the buffers hold, t<tokens>r<reqs> (default {DEFAULT_PAIR[0]})",
    )
    m.add_argument("--launched", help=f"--scenario pair: the descriptor launched (default {DEFAULT_PAIR[1]})")
    m.add_argument("--jobs", type=int, default=6, help="cases at a time, MPS cases aside (default %(default)s)")
    m.add_argument(
        "--compare-executors",
        action="store_true",
        help="benchmark: run the matrix on the old path (a fresh interpreter per case, an MPS daemon per case) and "
        "the new one (forkserver, one shared MPS daemon) in one command, and diff the verdicts (GPU)",
    )
    m.add_argument(
        "--executor",
        choices=EXECUTORS,
        help="process: a fresh interpreter per case; forkserver: cases forked from a server this command starts, "
        "that imported torch and the FA3 libraries once; server: from the repro server (`python -m repro serve`), "
        f"which outlives commands (default: the server when one runs this code, else {DEFAULT_EXECUTOR})",
    )
    m.add_argument(
        "--mps-daemon",
        choices=MPS_DAEMON_POLICIES,
        help="per-case: each MPS case alone under a daemon of its own; shared: one daemon, positive controls one at "
        "a time, expected-clean cases as concurrent clients, a batch with any fault rerun case by case "
        f"(default {DEFAULT_MPS_DAEMON})",
    )
    m.add_argument("--json", help="also write the machine-readable result here")
    m.add_argument("--title", default="Stale-metadata verdicts", help="report title (default %(default)r)")
    m.add_argument(
        "--dry-run",
        action="store_true",
        help="list the case ids this command would run here (the CPU model's cases without a GPU), nothing run",
    )
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
    add_shape_args(m)
    out = next(x for x in m._actions if x.dest == "out")
    out.help = (
        "a new or empty folder for verdicts.md, results.json, heatmap.png, logs/ (default: on a GPU a new folder under "
        "the temp folder; the CPU model's predictions: none, the table is printed)"
    )
    sub.choices["matrix"].set_defaults(func=cmd_matrix)


class Beside:
    """`fn()` in a daemon thread; `result()` waits for it (and raises what it raised)."""

    def __init__(self, fn):
        self._out: list = []
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._out.append((fn(), None))
        except Exception as e:  # handed to result()
            self._out.append((None, e))

    def result(self):
        self._thread.join()
        value, error = self._out[0]
        if error is not None:
            raise error
        return value


def _model_specs(a: argparse.Namespace, opts, specs: list[CaseSpec]) -> list[CaseSpec]:
    """The cases the CPU model predicts, or ConfigError naming the flag it cannot honour."""

    from repro.fa3_model.predict import model_sms  # the CPU model (numpy): for --model only

    if opts.scenario != V2:
        raise ConfigError(f"the CPU model predicts --scenario {V2} only; run --scenario {opts.scenario} on a GPU")
    for s in specs:
        if why := unmodelled(s):  # its prediction would be a guess (repro.judge.expectations.UNMODELLED)
            raise ConfigError(
                f"the CPU model does not model a feature of these cases ({'; '.join(why)}): run them on a GPU"
            )
    if a.modes is not None and "graph" in opts.modes:
        raise ConfigError("the CPU model predicts the eager warmups only: use --modes eager, or run graph on a GPU")
    if opts.repeat > 1:
        raise ConfigError("the CPU model is deterministic: --repeat needs a GPU")
    for flag, given in (
        ("--executor", a.executor),
        ("--mps-daemon", a.mps_daemon),
        ("--compare-executors", a.compare_executors or None),
    ):
        if given is not None:
            raise ConfigError(f"{flag} chooses how case processes run on a GPU; the CPU model runs none")
    if a.sms is None:  # the model's own SM list
        sms = parse_ints(a.model_sms)
        if twice := sorted({n for n in sms if sms.count(n) > 1}):  # its own flag, never blamed on --sms
            raise ConfigError(f"--model-sms: {twice[0]} given twice (one case id each)")
        if not sms or min(sms) <= 0 or max(sms) > H200_SMS:
            raise ConfigError(f"model SM counts must be in 1..{H200_SMS}")
        labels = tuple("full" if n == H200_SMS else f"sm_margin:{n}" for n in sms)
        specs = build_specs(replace(opts, sms=labels))
    for s in specs:
        if model_sms(s) > H200_SMS:  # as --model-sms refuses it: the model predicts for an H200
            raise ConfigError(
                f"--sms {s.sm.kind}:{s.sm.sms}: impossible SM count, the model predicts for an H200 ({H200_SMS} SMs)"
            )
    return [s for s in specs if s.mode == "eager"]


def _check_sms_fit(specs: list[CaseSpec]) -> None:
    """On a GPU: an SM count over the GPU's is bad input (as `run --sm` says), before any case runs."""

    total = device_sm_count()
    for s in specs:
        if why := sm_refusal(s.sm.kind, s.sm.sms, total):
            raise ConfigError(f"--sms {why}")


def cmd_matrix(a: argparse.Namespace) -> int:

    if a.backend is not None and a.backend != "model":
        raise ConfigError(f"--backend takes only 'model' (use --backends for FA3 builds), got {a.backend!r}")
    if a.gpu_only and (a.model or a.backend == "model"):  # one wins silently otherwise: the model did
        raise ConfigError("--gpu-only refuses the CPU model that --model asks for: give one of them")
    if a.jobs < 1:
        raise ConfigError("--jobs must be at least 1")
    opts = MatrixOptions(
        backends=parse_backends(a.backends),
        strategies=parse_items(a.strategies),
        sms=parse_items(a.sms if a.sms is not None else ",".join(DEFAULT_SMS)),
        modes=parse_items(a.modes if a.modes is not None else DEFAULT_MODES),
        splits=splits(parse_ints(a.splits), "--splits"),
        poison=poison_arg(a.poison),
        sanitizer=a.sanitizer,
        timeout_s=a.timeout,
        repeat=a.repeat,
        scenario=a.scenario or V2,
        cfg=shape_config(a, 32),
        pair=(a.built_for or DEFAULT_PAIR[0], a.launched or DEFAULT_PAIR[1]) if (a.built_for or a.launched) else None,
    )
    for st in opts.strategies:
        if st not in STRATEGIES:
            raise ConfigError(f"unknown strategy {st!r}; choose from {', '.join(STRATEGIES)}")
    specs = build_specs(opts)  # validates every axis, GPU or not
    model = a.model or a.backend == "model"
    t_probe = time.time()
    gpu = None if model else gpu_present()  # with --model the GPU is not asked
    if not model and not gpu:
        if a.gpu_only and not a.dry_run:
            print("repro: cannot run here: no CUDA GPU visible (--gpu-only)", file=sys.stderr)
            return exit_codes.Exit.NOT_RUN
        model = not a.gpu_only  # --gpu-only --dry-run: the GPU matrix, listed where it cannot run
        banner = "No GPU here: these are the CPU model's predictions for an H200 (use --gpu-only to refuse)."
    else:
        banner = "Backend: the CPU model."
    if model:
        specs = _model_specs(a, opts, specs)
    elif gpu:
        _check_sms_fit(specs)
    if a.dry_run:  # exactly the cases this command would run here, and which path says so on stderr
        if model:
            why = "--model" if (a.model or a.backend == "model") else "no GPU here"
            sms = "--sms" if a.sms is not None else f"--model-sms {a.model_sms}"
            which = f"the CPU model's predictions ({why}; eager warmups only, SM counts of {sms})"
        elif gpu:
            which = "the GPU matrix (kernels run, each case in its own process)"
        else:
            which = "the GPU matrix (--gpu-only; no GPU here, so the run itself would exit 4)"
        print(f"dry run: {len(specs)} cases, {which}", file=sys.stderr)
        for s in specs:
            print(s.case_id)
        return exit_codes.Exit.OK
    check_file_and_folder(a.json, a.out)
    check_file(  # a results.json; predictions never replace a GPU run's record
        a.json, own=json_of(lambda doc: isinstance(doc["cases"], list) and (not model or doc["source"] == report.MODEL))
    )
    check_folder(a.out, a.overwrite)
    out = open_folder(a.out, "matrix", a.overwrite) if (a.out or not model) else None
    # Beside the run: the environment table's facts (a child that imports torch; run_matrix computes the controls'
    # expectations beside its cases): seconds, which the first case need not wait for.
    facts = Beside(environment.collect)  # a daemon thread: Ctrl-C never waits for it
    if model:
        import torch  # noqa: F401  the model's buffers are torch's: imported before the line that says it works

        from repro.fa3_model.predict import predict_specs  # the CPU model (numpy): for --model only

        if not a.quiet:  # a Ctrl-C after this line never lands in torch's import (its C++ init then aborts)
            print(f"[matrix] predicting {len(specs)} case(s) with the CPU model", file=sys.stderr, flush=True)
        t0 = time.time()
        run = MatrixRun(predict_specs(specs), round(time.time() - t0, 2), None, source=report.MODEL)
        attach_expectations(run.results, {})
        title = f"{a.title} (predicted by the CPU model)"
    else:
        if a.compare_executors:
            if a.executor or a.mps_daemon:
                raise ConfigError("--compare-executors runs both paths; leave out --executor and --mps-daemon")
            probe_s = time.time() - t_probe  # before either path: the GPU probe (the CUDA driver, in a child)
            md_bench, runs = compare_executors(specs, out, a.jobs, progress=None if a.quiet else text_progress)
            md_bench += (
                f"\nBefore any path the command spent {probe_s:.1f} s finding the GPU (the CUDA driver's SM count, "
                "asked in a child process); the times above count from each path's start.\n"
            )
            env = facts.result()
            write_whole(out / "executors.md", redact("\n".join(report.header(a.title, env))) + "\n" + md_bench)
            for name, path_run in runs.items():
                report.write_json(path_run, out / name / "results.json", env)
                write_whole(out / name / "verdicts.md", report.markdown(path_run, env, title=f"{a.title} ({name})"))
            print(md_bench + f"\nreports: {out}")
            return exit_codes.matrix(not (runs["new"].failures() or runs["old"].failures()))
        executor = make_executor(a.executor, a.jobs) if a.executor else default_executor(a.jobs)
        how = executor.started_by if executor is not None else "a fresh interpreter each"
        if executor is not None and executor.name == "server":
            print(f"cases forked by {how}", file=sys.stderr)
        run = run_matrix(
            specs,
            out / "logs",
            jobs=a.jobs,
            progress=None if a.quiet else text_progress,
            executor=executor,
            mps_daemon=a.mps_daemon or DEFAULT_MPS_DAEMON,
        )
        run.setup_s = round(run.started_at - command_started_at(), 2)  # CLI, GPU probe, executor start-up
        title = a.title
    env = facts.result()
    if not model:
        how = executor.started_by if executor is not None else how  # the repro server's may have fallen back
        fresh = getattr(executor, "notes", None) or []  # cases its forkserver could not start, and why
        env["cases started by"] = how + (f"; some started fresh instead: {'; '.join(fresh)}" if fresh else "")
    md = report.markdown(run, env, title=title)
    if out is not None:
        write_whole(out / "verdicts.md", md)
        report.write_json(run, out / "results.json", env)
        report.heatmap(run, out / "heatmap.png")
    if a.json:
        with replacing(a.json) as tmp:
            report.write_json(run, tmp, env)
    print((banner + "\n\n" if model else "") + md)
    if out is not None:
        print(f"reports: {out}")
    if not model:
        for line in report.control_lines(run):  # HARNESS BLIND (no evidence) apart from disagreements (evidence)
            print(line, file=sys.stderr)
    gate_passed = None  # without --gate
    if a.gate and not model:
        why = report.gate_failures(run)
        if why:
            print(f"GATE FAILED: {why[0]}" + (f" (+{len(why) - 1} more)" if len(why) > 1 else ""), file=sys.stderr)
        gate_passed = not why
    if a.gate and model:
        print("GATE FAILED: no GPU, so no kernel evidence: the CPU model cannot pass a gate", file=sys.stderr)
        gate_passed = False
    return exit_codes.matrix(not run.failures(), gate_passed)
