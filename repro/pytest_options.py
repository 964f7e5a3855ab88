"""The options of the strict gate (`--gate`, `--gate-report DIR`, `--gate-require LIST`) as a pytest plugin of their
own, registered by the `pytest11` entry point in pyproject.toml: pytest knows them however the command line orders
them, even where conftest.py is not loaded yet. conftest.py names this module in `pytest_plugins` too, for a checkout
run without `pip install -e .`; the entry point carries the module's name, so pytest registers it once.

`--gate-report DIR` as pytest users type it (space-separated): pytest picks its rootdir, and so its configuration
file, before it loads any plugin (pytest-dev/pytest#8846), so an existing DIR outside the checkout is taken for a
test path there and the run is rooted in DIR, without pyproject.toml's settings. Where that can have happened (a
gate option's value given space-separated that names an existing path), the command starts again at once as
`--gate-report=DIR`, the form pytest reads the same way at every stage.

Bad input is what the project says it is (docs/exit-codes.md): `--gate-require bogus` (or a bad REPRO_GATE_REQUIRE
in a gate run) is one line on stderr and exit 2, with or without --gate, before any case runs, and so is a gate run's
`--gate-report` that is a file or a folder that cannot be made or written into (the report is written at the end); pytest's own usage
errors (`--gate=yes`, an option pytest does not know) keep pytest's USAGE_ERROR, 4 (docs/exit-codes.md: under pytest,
4 is pytest's refusal of its command line). Without a gate run, --gate-require and --gate-report are
ignored, and said to be. The gate itself: repro/report/pytest_gate.py's GatePlugin, which conftest.py registers for a
gate run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from repro.cli.outputs import check_writable, is_text, json_of
from repro.errors import ConfigError
from repro.exit_codes import Exit
from repro.files import check_target
from repro.judge.policy import GATE_ENV, REQUIRE_ENV, parse_requirements


def pytest_addoption(parser):
    parser.addoption("--gate", action="store_true", help="strict gate: skipped GPU cases and missing evidence fail")
    parser.addoption("--gate-report", default=None, help="folder for the gate's report (gate.md, gate.json)")
    parser.addoption(
        "--gate-require",
        default=None,
        help="features this runner must cover (mig,mps,vllm,sanitizer): their cases fail instead of being reported "
        "not applicable (default: REPRO_GATE_REQUIRE, else mig on a MIG runner)",
    )


VALUE_OPTIONS = ("--gate-report", "--gate-require")
# what --gate-report's folder gets (repro.report.pytest_gate.write_report), each with how an earlier one is known
REPORT_FILES = (
    ("gate.json", json_of(lambda d: "outcome" in d and "controls" in d)),
    ("gate.md", lambda p: is_text(p) and p.read_text(errors="replace").startswith("# pytest GPU tier (--gate)")),
)


def joined(args: list[str]) -> list[str] | None:
    """`args` with every gate option whose space-separated value names an existing path written as OPTION=VALUE, or
    None when there is none (pytest's rootdir is then the one the command line meant)."""
    out, i, changed = [], 0, False
    while i < len(args):
        if args[i] in VALUE_OPTIONS and i + 1 < len(args) and os.path.exists(args[i + 1]):
            out.append(f"{args[i]}={args[i + 1]}")
            i, changed = i + 2, True
        else:
            out.append(args[i])
            i += 1
    return out if changed else None


def _restart_joined(config) -> None:
    """Start this pytest command again with the gate options joined to their values (see the module's docstring);
    only a command typed on a command line (not pytest.main, not an xdist worker), and only once."""
    args = list(config.invocation_params.args)
    if hasattr(config, "workerinput") or args != sys.argv[1:] or (fixed := joined(args)) is None:
        return
    prefix = sys.orig_argv[: len(sys.orig_argv) - len(args)]  # the interpreter and how it ran pytest (-m pytest)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *prefix[1:], *fixed])


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Judge the gate's options before anything runs: exit 2 with one line for a requirement no runner knows."""
    _restart_joined(config)
    given = config.getoption("gate_require", default=None)
    gating = config.getoption("gate", default=False) or os.environ.get(GATE_ENV) == "1"
    text = given if given is not None else os.environ.get(REQUIRE_ENV) if gating else None
    if text is not None:
        try:
            parse_requirements(text)
        except ValueError as e:
            where = f"--gate-require {given}" if given is not None else f"{REQUIRE_ENV}={text}"
            sys.stderr.write(f"repro: error: {where}: {e}\n")
            return Exit.BAD_INPUT
    if gating and not hasattr(config, "workerinput"):  # the tier's variables, each error naming its variable
        from repro.vllm_integration.gate.settings import settings  # noqa: PLC0415  a gate run's only (the gate's modes)

        try:
            settings()
        except ConfigError as e:
            sys.stderr.write(f"repro: error: {e}\n")
            return Exit.BAD_INPUT
    report = config.getoption("gate_report", default=None)
    if (
        report is not None and gating and not hasattr(config, "workerinput")
    ):  # written when the session ends: judged now
        try:
            if Path(report).exists() and not Path(report).is_dir():
                raise ConfigError(f"--gate-report {report}: exists and is not a folder")
            check_writable(Path(report).absolute(), report, "--gate-report")
            for name, own in REPORT_FILES:  # replaced at the end of the run: only an earlier gate report's
                check_target(Path(report) / name, f"{report}/{name}", "--gate-report")  # never a link or a device
                if (Path(report) / name).exists() and not own(Path(report) / name):
                    raise ConfigError(
                        f"--gate-report {report}: its {name} is not a gate report: give another folder (it is kept)"
                    )
        except ConfigError as e:
            sys.stderr.write(f"repro: error: {e}\n")
            return Exit.BAD_INPUT
    ignored = [f for f, v in (("--gate-require", given), ("--gate-report", report)) if v]
    if ignored and not gating and not hasattr(config, "workerinput"):
        sys.stderr.write(
            f"repro: note: {' and '.join(ignored)} ignored: the gate's options take effect in a gate run only "
            f"(--gate or {GATE_ENV}=1)\n"
        )
    return None
