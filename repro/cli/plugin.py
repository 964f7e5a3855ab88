"""`python -m repro plugin-request`: the plugin's request for a person's own vLLM run outside the gate, printed as the
value of REPRO_REQUEST (repro.contract.request.PluginRequest.to_json). REPRO_AUDIT=1 alone asks for the probe and the
auditor; this asks for any feature of the plugin (the SM margin, the poison, the self control's injection, the gate's
weights), each value checked here as the plugin checks it (repro.vllm_integration.plugin.requested)."""

from __future__ import annotations

import argparse
import os

from repro import exit_codes
from repro.case.spec import MAX_SMS
from repro.cli.outputs import check_file, json_of
from repro.contract.request import ENV, PluginRequest
from repro.errors import BadRequest, ConfigError
from repro.vllm_integration.plugin import requested
from repro.vllm_integration.plugin.backend_fields import DEFAULT_BACKEND, known_name
from repro.vllm_integration.plugin.inject import ALL_INJECTIONS, SOURCES
from repro.vllm_integration.plugin.weights import DUMMY, WEIGHTS


def add_parsers(sub) -> None:
    what = (
        f'print the plugin\'s request for your own vLLM run: export {ENV}="$(python -m repro plugin-request ...)" '
        "(REPRO_AUDIT=1 alone: the auditor only)"
    )
    p = sub.add_parser("plugin-request", help=what, description=what)
    p.add_argument("--backend", default=DEFAULT_BACKEND, help="vLLM's attention backend to hook (default %(default)s)")
    p.add_argument("--no-audit", action="store_true", help="no freshness auditor (the probe's counters still run)")
    p.add_argument(
        "--audit-file",
        help="where the auditor writes its whole report at exit, one file every process of the vLLM run merges its "
        "report into (`processes`: each with its checks; default: none)",
    )
    p.add_argument("--sm-margin", type=int, default=0, help="FA3 plans and launches for N fewer SMs (default 0)")
    p.add_argument("--poison", help="fill FA3's never-written scheduler entries (repro.case.poison; default: none)")
    p.add_argument(
        "--inject", choices=ALL_INJECTIONS, help="re-create the capture defect (the self control; default: none)"
    )
    p.add_argument("--inject-source", choices=SOURCES, help=f"with --inject: whose capture (default {SOURCES[0]})")
    p.add_argument(
        "--weights", choices=(*WEIGHTS, DUMMY), default=DUMMY, help="the model's weights (default %(default)s)"
    )
    p.add_argument(
        "--no-refresh-judging",
        action="store_true",
        help="leave the draft-decode refresh unjudged (counted in refresh_unjudged; default: judged)",
    )
    p.add_argument(
        "--no-replay-check",
        action="store_true",
        help="no check at graph replays (default: on where torch has the hook)",
    )
    p.set_defaults(func=cmd_plugin_request)


def cmd_plugin_request(a: argparse.Namespace) -> int:
    if a.sm_margin > MAX_SMS:  # as gate --modes sm_margin:N: more than any GPU has (FA3 would plan for fewer than 0)
        raise ConfigError(f"--sm-margin {a.sm_margin}: impossible SM count: 0 to {MAX_SMS} (no GPU has more SMs)")
    if a.inject_source is not None and a.inject is None:  # it would choose nothing
        raise ConfigError("--inject-source chooses whose capture --inject re-creates the defect in: give --inject too")
    if a.audit_file is not None and not a.audit_file.strip():
        raise ConfigError("--audit-file: an empty name; give a file name")
    if a.audit_file is not None and not a.no_audit:  # the auditor writes it at the end of a vLLM run: judged now
        check_file(a.audit_file, "--audit-file", own=json_of(lambda d: "checks" in d and "mismatches" in d))
        a.audit_file = os.path.abspath(a.audit_file)  # every process of the run reports into it, whatever its cwd
    try:
        want = PluginRequest(
            attention_backend=a.backend,
            probe=True,
            audit=not a.no_audit,
            audit_file=None if a.no_audit else a.audit_file,
            sm_margin=a.sm_margin,
            poison=a.poison,
            inject=a.inject,
            inject_source=a.inject_source or SOURCES[0],
            weights=a.weights,
            judge_refresh=not a.no_refresh_judging,
            check_replay=not a.no_replay_check,
        )
        requested(want)  # what the plugin would refuse inside vLLM is refused here
    except (BadRequest, ValueError) as e:
        raise ConfigError(str(e)) from None
    if not known_name(a.backend):  # as `gate --backends` judges a name: no hook could go on it
        raise ConfigError(f"--backend {a.backend}: not a name vLLM gives a backend (FLASH_ATTN, TRITON_ATTN, ...)")
    if a.no_audit and a.audit_file:
        raise ConfigError("--audit-file with --no-audit: no auditor writes it")
    print(want.to_json())
    return exit_codes.Exit.OK
